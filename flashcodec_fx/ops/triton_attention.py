"""Triton `codec_attention`: flash-decoding split-K attention on the stored rows, plus the combine kernel.

Split kernel, one program per (batch, kv head, row chunk, split): the query heads of one kv head (GQA group,
``G * T`` rows) are processed together, so each stored row is read once per kv head. For a tile of
``BLOCK_N`` archive blocks it loads the stored rows ``S`` (pruned png deltas scattered in registers; int8 codes
as they are, their per-row scales applied outside the dots), computes ``C = q @ S_k^T``, expands ``C`` through
the block-diagonal synthesis matrix to per-position scores, applies scale and mask, runs an online softmax,
folds the probabilities back through the synthesis matrix (``P @ A_v``, times V's row scales) and accumulates
that against ``S_v``. The extra last split attends the raw tail. Each split writes its normalized partial
output and log-sum-exp; the combine kernel merges them. Lengths are read on the device and every block range
derives from them: the launch depends on shapes only (CUDA-graph safe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._validate import check_length
from .attention import check_attention_args
from .triton_common import (
    StoredForm,
    check_triton_limits,
    codec_matrices,
    dot_dtype,
    dot_precision,
    pow2,
    require_contiguous,
    stored_rows,
)

LOG2E = 1.4426950408889634
_LOG2E: tl.constexpr = tl.constexpr(LOG2E)
_MAX_ROWS = 64  # query rows (G * T) per program; more rows get more programs
NO_MASK, BOOL_MASK, ADDITIVE_MASK = 0, 1, 2  # MASK_KIND
_NO_MASK: tl.constexpr = tl.constexpr(NO_MASK)
_BOOL_MASK: tl.constexpr = tl.constexpr(BOOL_MASK)


@triton.jit
def _mask_bias(mask_ptr, smb, smh, smt, sml, mask_len, b, head, t, pos, ok, MASK_KIND: tl.constexpr):
    """Additive fp32 bias for rows (head, t) x positions pos: 0 / -inf for bool masks, the value for float ones.
    Every index is int64 (``t * smt`` alone passes 2**31 for a long mask)."""
    ptr = mask_ptr + b * smb + head[:, None] * smh + t[:, None] * smt + pos[None, :] * sml
    inside = ok & (pos[None, :] < mask_len)
    if MASK_KIND == _BOOL_MASK:
        bias = tl.where(tl.load(ptr, mask=inside, other=1) != 0, 0.0, float("-inf"))
    else:
        bias = tl.load(ptr, mask=inside, other=0.0).to(tl.float32)
    return bias


@triton.jit
def _softmax_step(s, m_i, l_i, acc):
    """One online-softmax step on log2-domain scores ``s (M, P)``; returns probabilities and the rescaled state."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None]


@triton.jit
def split_range(length, split, NB, NUM_SPLITS, r: tl.constexpr, BLOCK_N: tl.constexpr):
    """Archive blocks ``[lo, hi)`` of one split: the ``ceil(n / BLOCK_N)`` stored tiles (``n = min(length // r,
    NB)``: an overflowed append archived only ``NB``) dealt in equal contiguous runs over the ``NUM_SPLITS``
    splits, from the device length (a short fill of a large static cache still spreads over every split)."""
    n_arch = tl.minimum(length // r, NB)
    per_split = tl.cdiv(tl.cdiv(n_arch, BLOCK_N), NUM_SPLITS) * BLOCK_N
    lo = split * per_split
    return lo, tl.minimum(lo + per_split, n_arch)


@triton.jit
def _split_kernel(
    q_ptr, sqb, sqh, sqt,
    kd_ptr, ks_ptr, ki_ptr, kt_ptr, vd_ptr, vs_ptr, vi_ptr, vt_ptr,  # K and V: data, scale, index, raw tail
    ak_ptr, av_ptr, len_ptr,  # synthesis matrices (r, dense rows) and the 0-dim device length
    mask_ptr, smb, smh, smt, sml, mask_len,
    o_part, lse_part, qk_scale, NB, HKV, T, G, N_MCHUNK, NUM_SPLITS,
    D: tl.constexpr, DP: tl.constexpr, r: tl.constexpr, RP: tl.constexpr, TP: tl.constexpr,
    K_ROWS: tl.constexpr, K_DENSE: tl.constexpr, K_DENSE_P: tl.constexpr, K_QUANT: tl.constexpr, K_KEPT: tl.constexpr,
    V_ROWS: tl.constexpr, V_DENSE: tl.constexpr, V_DENSE_P: tl.constexpr, V_QUANT: tl.constexpr, V_KEPT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, MASK_KIND: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr, PREC_S: tl.constexpr,
):
    """Program ``(bh * N_MCHUNK + row chunk, split)``; split ``NUM_SPLITS`` attends the raw tail. Constexprs:
    :class:`AttentionTiles` (``D`` .. ``TP``, ``BLOCK_N``, ``BLOCK_M``), :class:`StoredForm` of K and V, the mask
    kind, and :class:`DotTypes` (``DOT_T``: 16-bit or fp32 dot operands; ``PREC``: fp32 dots; ``PREC_S``: dots on
    stored rows)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    bh = (pid // N_MCHUNK).to(tl.int64)
    b = bh // HKV
    kvh = bh % HKV
    m = (pid % N_MCHUNK) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < G * T
    g = m // T
    t = (m % T).to(tl.int64)
    head = kvh * G + g
    dd = tl.arange(0, DP)
    q = tl.load(q_ptr + b * sqb + head[:, None] * sqh + t[:, None] * sqt + dd[None, :],
                mask=row_ok[:, None] & (dd[None, :] < D), other=0.0).to(DOT_T)
    length = tl.load(len_ptr)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DP), tl.float32)
    if split < NUM_SPLITS:
        lo, hi = split_range(length, split, NB, NUM_SPLITS, r, BLOCK_N)
        ck = tl.arange(0, BLOCK_N * K_DENSE_P)
        nk = ck // K_DENSE_P
        jk = ck % K_DENSE_P
        cv = tl.arange(0, BLOCK_N * V_DENSE_P)
        nv = cv // V_DENSE_P
        jv = cv % V_DENSE_P
        pp = tl.arange(0, BLOCK_N * RP)
        npos = pp // RP
        p_in = pp % RP
        # block-diagonal synthesis: scores = C @ a_k, folded probabilities = P @ a_v
        a_k = tl.load(ak_ptr + p_in[None, :] * K_DENSE + jk[:, None],
                      mask=(nk[:, None] == npos[None, :]) & (jk[:, None] < K_DENSE) & (p_in[None, :] < r), other=0.0)
        a_v = tl.load(av_ptr + p_in[:, None] * V_DENSE + jv[None, :],
                      mask=(npos[:, None] == nv[None, :]) & (p_in[:, None] < r) & (jv[None, :] < V_DENSE), other=0.0)
        for n0 in range(lo, hi, BLOCK_N):
            # S_k^T, loaded transposed; int8 codes enter the dot exactly, their scales multiply its output
            kblk = bh * NB + n0 + nk
            kok = n0 + nk < hi
            sk_t = stored_rows(kd_ptr, ks_ptr, ki_ptr, kblk[None, :], jk[None, :], dd[:, None], kok[None, :],
                               K_ROWS, D, False, K_KEPT)
            coef = tl.dot(q, sk_t.to(DOT_T), input_precision=PREC_S)
            if K_QUANT:
                coef = coef * tl.load(ks_ptr + kblk * K_ROWS + jk, mask=kok & (jk < K_ROWS), other=0.0)[None, :]
            s = tl.dot(coef, a_k, input_precision=PREC) * qk_scale
            pos_ok = (n0 + npos < hi) & (p_in < r)
            if MASK_KIND != _NO_MASK:
                pos = (n0 + npos) * r + p_in
                s += _mask_bias(mask_ptr, smb, smh, smt, sml, mask_len, b, head, t, pos,
                                row_ok[:, None] & pos_ok[None, :], MASK_KIND) * _LOG2E
            s = tl.where(pos_ok[None, :], s, float("-inf"))
            p, m_i, l_i, acc = _softmax_step(s, m_i, l_i, acc)
            # folded probabilities per stored row; V's int8 scales fold in here, so its codes enter the dot exactly
            pc = tl.dot(p, a_v, input_precision=PREC)
            vblk = bh * NB + n0 + nv
            vok = n0 + nv < hi
            if V_QUANT:
                pc = pc * tl.load(vs_ptr + vblk * V_ROWS + jv, mask=vok & (jv < V_ROWS), other=0.0)[None, :]
            sv = stored_rows(vd_ptr, vs_ptr, vi_ptr, vblk[:, None], jv[:, None], dd[None, :], vok[:, None],
                             V_ROWS, D, False, V_KEPT)
            acc += tl.dot(pc.to(DOT_T), sv.to(DOT_T), input_precision=PREC_S)
    else:
        i = tl.arange(0, TP)
        start = length // r * r
        ok = (i < r) & (start + i < length)
        kt_t = tl.load(kt_ptr + bh * (r * D) + i[None, :] * D + dd[:, None], mask=ok[None, :] & (dd[:, None] < D),
                       other=0.0)
        s = tl.dot(q, kt_t.to(DOT_T), input_precision=PREC_S) * qk_scale
        if MASK_KIND != _NO_MASK:
            s += _mask_bias(mask_ptr, smb, smh, smt, sml, mask_len, b, head, t, start + i,
                            row_ok[:, None] & ok[None, :], MASK_KIND) * _LOG2E
        s = tl.where(ok[None, :], s, float("-inf"))
        p, m_i, l_i, acc = _softmax_step(s, m_i, l_i, acc)
        vt = tl.load(vt_ptr + bh * (r * D) + i[:, None] * D + dd[None, :], mask=ok[:, None] & (dd[None, :] < D),
                     other=0.0)
        acc += tl.dot(p.to(DOT_T), vt.to(DOT_T), input_precision=PREC_S)
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    part = pid.to(tl.int64) * (NUM_SPLITS + 1) + split
    rows = tl.arange(0, BLOCK_M)
    tl.store(o_part + part * (BLOCK_M * DP) + rows[:, None] * DP + dd[None, :], out)
    tl.store(lse_part + part * BLOCK_M + rows, lse)


@triton.jit
def _combine_kernel(o_part, lse_part, out_ptr, sob, soh, sot, HKV, T, G, N_MCHUNK, PARTS,
                    D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Merge the ``PARTS`` partial (output, log2-sum-exp) pairs of one program's rows into the final output."""
    pid = tl.program_id(0)
    bh = (pid // N_MCHUNK).to(tl.int64)
    b = bh // HKV
    kvh = bh % HKV
    rows = tl.arange(0, BLOCK_M)
    m = (pid % N_MCHUNK) * BLOCK_M + rows
    dd = tl.arange(0, DP)
    m_run = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_run = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DP), tl.float32)
    for s in range(PARTS):
        part = pid.to(tl.int64) * PARTS + s
        lse = tl.load(lse_part + part * BLOCK_M + rows)
        o = tl.load(o_part + part * (BLOCK_M * DP) + rows[:, None] * DP + dd[None, :])
        m_new = tl.maximum(m_run, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_use)
        w = tl.exp2(lse - m_use)
        acc = acc * alpha[:, None] + w[:, None] * o
        l_run = l_run * alpha + w
        m_run = m_new
    out = tl.where((l_run > 0)[:, None], acc / tl.where(l_run > 0, l_run, 1.0)[:, None], 0.0)
    g = m // T
    t = (m % T).to(tl.int64)
    ptr = out_ptr + b * sob + (kvh * G + g)[:, None] * soh + t[:, None] * sot + dd[None, :]
    tl.store(ptr, out.to(out_ptr.dtype.element_ty), mask=(m < G * T)[:, None] & (dd[None, :] < D))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def attention_plan(batch: int, kv_heads: int, rows: int, blocks: int, block_size: int, rows_k: int, rows_v: int,
                   head_dim: int, device: torch.device, num_splits: int | None = None) -> dict[str, int]:
    """Tile sizes and split count from shapes only (never from the device length, so the launch is fixed).

    - ``BLOCK_M``: the ``G * T`` query rows of a kv head, padded to a power of two >= 16 (tl.dot minimum), at
      most 64 per program; larger groups get more programs.
    - ``BLOCK_N``: archive blocks per tile, chosen so a tile spans about 64 token positions and at least 16
      stored rows of K and of V (tl.dot minimum).
    - splits: enough programs to fill the device twice over (``2 * SMs`` programs on CUDA), never more splits
      than tiles, so short contexts get few splits (little combine work) and long ones many (full occupancy,
      each split streams a contiguous block range). The split count comes from the capacity ``NB`` (shapes
      only); each split's block range comes from the device length inside the kernel: the stored tiles are dealt
      evenly over the splits, so a short fill of a large static cache still spreads over every split.
    - ``num_warps``: 8 when a stored tile holds >= 8192 values (e.g. 8 blocks x 8 rows x D=128), else 4: with
      D=128 on sm_90 that keeps every tier under 255 registers without spills (ptxas -v, Triton 3.9).
    """
    rp = pow2(block_size)
    block_m = pow2(rows, 16) if rows <= _MAX_ROWS else _MAX_ROWS
    n_mchunk = -(-rows // block_m)
    block_n = max(1, 64 // rp)
    while block_n * min(pow2(rows_k), pow2(rows_v), rp) < 16:
        block_n *= 2
    tiles = -(-blocks // block_n)
    if num_splits is None:
        base = batch * kv_heads * n_mchunk
        num_splits = min(tiles, max(1, -(-2 * _sm_count(device) // base)))
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    num_splits = max(1, min(num_splits, tiles))
    warps = 8 if block_n * max(pow2(rows_k), pow2(rows_v)) * pow2(head_dim, 16) >= 8192 else 4
    return {"BLOCK_M": block_m, "n_mchunk": n_mchunk, "BLOCK_N": block_n, "num_splits": num_splits,
            "num_warps": warps}



@dataclass(frozen=True)
class AttentionTiles:
    """The shape constexprs of the split kernel: ``D`` head_dim (``DP`` its tile), ``r`` block size (``RP`` its
    tile, ``TP`` the tail's, >= 16), and the plan's ``BLOCK_N`` blocks per tile and ``BLOCK_M`` query rows."""

    head_dim: int
    block_size: int
    block_n: int
    block_m: int

    def constexprs(self) -> dict[str, int]:
        return {"D": self.head_dim, "DP": pow2(self.head_dim, 16), "r": self.block_size, "RP": pow2(self.block_size),
                "TP": pow2(self.block_size, 16), "BLOCK_N": self.block_n, "BLOCK_M": self.block_m}


@dataclass(frozen=True)
class DotTypes:
    """Dot operand dtype and precisions (see :func:`triton_codec_attention`)."""

    operand: tl.dtype
    precision: str

    @classmethod
    def of(cls, q_dtype: torch.dtype, *stored: torch.dtype) -> DotTypes:
        return cls(dot_dtype(q_dtype, *(dt for dt in stored if dt.is_floating_point)), dot_precision(q_dtype))

    def constexprs(self) -> dict:
        stored = self.precision if self.operand == tl.float32 else "tf32"  # (unused by 16-bit dots)
        return {"DOT_T": self.operand, "PREC": self.precision, "PREC_S": stored}


def _mask_args(mask: torch.Tensor | None, q: torch.Tensor) -> tuple:
    """``(tensor, stride_b, stride_h, stride_t, stride_l, length, kind)``; broadcast dims get stride 0."""
    if mask is None:
        return q, 0, 0, 0, 0, 0, NO_MASK
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    strides = [0 if mask.shape[i] == 1 else mask.stride(i) for i in range(3)]
    return mask, *strides, mask.stride(3), mask.shape[3], BOOL_MASK if mask.dtype == torch.uint8 else ADDITIVE_MASK


def split_partials(q: torch.Tensor, k_state: tuple, v_state: tuple, length: torch.Tensor, spec_k: list[int],
                   spec_v: list[int], mask: torch.Tensor | None, scale: float | None,
                   num_splits: int | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Validate, plan and launch the split kernel. Returns the partial outputs ``(programs, splits + 1, BLOCK_M,
    DP)`` fp32, their log2-sum-exp ``(programs, splits + 1, BLOCK_M)`` (``-inf``: the split saw nothing) and the
    plan; part ``splits`` is the raw tail's. ``k_state``/``v_state``: ``(data, scale, index, tail)``."""
    ck, cv = check_attention_args(q, k_state, v_state, spec_k, spec_v, mask)
    check_length(length)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    b, hq, t, d = q.shape
    check_triton_limits(ck, d, "spec_k")
    check_triton_limits(cv, d, "spec_v")
    require_contiguous(**{f"{s}_{part}": x for s, state in (("k", k_state), ("v", v_state))
                          for part, x in zip(("data", "scale", "index", "tail"), state, strict=True)})
    hkv, nb, r = k_state[0].shape[1], k_state[0].shape[2], ck.block_size
    g = hq // hkv
    q = q if q.stride(3) == 1 else q.contiguous()
    plan = attention_plan(b, hkv, g * t, nb, r, ck.dense_rows, cv.dense_rows, d, q.device, num_splits)
    tiles = AttentionTiles(d, r, plan["BLOCK_N"], plan["BLOCK_M"])
    parts, programs, dp = plan["num_splits"] + 1, b * hkv * plan["n_mchunk"], pow2(d, 16)
    o_part = torch.empty(programs, parts, plan["BLOCK_M"], dp, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(programs, parts, plan["BLOCK_M"], dtype=torch.float32, device=q.device)
    a_k, _ = codec_matrices(ck, q.device)
    a_v, _ = codec_matrices(cv, q.device)
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dots = DotTypes.of(q.dtype, ck.storage_dtype(k_state[3].dtype), cv.storage_dtype(v_state[3].dtype),
                       k_state[3].dtype, v_state[3].dtype)
    mask_t, smb, smh, smt, sml, mask_len, mask_kind = _mask_args(mask, q)
    _split_kernel[(programs, parts)](
        q, q.stride(0), q.stride(1), q.stride(2), *k_state, *v_state, a_k, a_v, length,
        mask_t, smb, smh, smt, sml, mask_len,
        o_part, lse_part, sm_scale * LOG2E, nb, hkv, t, g, plan["n_mchunk"], plan["num_splits"],
        **tiles.constexprs(), **StoredForm.of(ck).constexprs("K"), **StoredForm.of(cv).constexprs("V"),
        MASK_KIND=mask_kind, **dots.constexprs(),
        num_stages=1 if ck.index_rows or cv.index_rows else 2, num_warps=plan["num_warps"],
    )
    return o_part, lse_part, plan


def triton_codec_attention(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, k_index: torch.Tensor,
                           k_tail: torch.Tensor, v_data: torch.Tensor, v_scale: torch.Tensor, v_index: torch.Tensor,
                           v_tail: torch.Tensor, length: torch.Tensor, spec_k: list[int], spec_v: list[int],
                           mask: torch.Tensor | None = None, scale: float | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Triton ``flashcodec::codec_attention``: ``q (B, Hq, T, D)`` over the stored state; ``(B, Hq, T, D)`` in q's dtype.

    Same contract and validation as the reference (:func:`flashcodec_fx.ops.attention.codec_attention`); every
    codec is supported (jpeg any K <= r, int8, png, pruned png) within the Triton limits (``triton_common``).
    fp16/bf16/fp32 I/O, fp32 accumulation: with 16-bit inputs, ``q . S_k`` runs on 16-bit tensor cores on exact
    operands (stored rows, or int8 codes whose scales multiply the dot's output), ``P . S_v`` likewise on V's
    exact int8 codes with the folded probabilities times V's scales rounded once to the I/O dtype (as flash
    attention rounds P; unquantized rows enter as stored), and every fp32 product (synthesis expansion and fold,
    png deltas) runs as tf32x3 (about fp32 accuracy); fp32 inputs use exact fp32 dots throughout.
    Tiles and split count: see :func:`attention_plan` (``num_splits`` overrides the heuristic).
    Two launches (splits, combine) whose grid depends on shapes only: capturable in a CUDA graph.
    """
    o_part, lse_part, plan = split_partials(q, (k_data, k_scale, k_index, k_tail), (v_data, v_scale, v_index, v_tail),
                                            length, spec_k, spec_v, mask, scale, num_splits)
    b, hq, t, d = q.shape
    g = hq // k_data.shape[1]
    out = torch.empty(b, hq, t, d, dtype=q.dtype, device=q.device)
    _combine_kernel[(o_part.shape[0],)](o_part, lse_part, out, out.stride(0), out.stride(1), out.stride(2),
                                        k_data.shape[1], t, g, plan["n_mchunk"], o_part.shape[1], D=d,
                                        DP=o_part.shape[3], BLOCK_M=plan["BLOCK_M"])
    return out
