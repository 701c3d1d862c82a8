"""Paged attention on CUDA: decode steps and prefill chunks of many requests in one launch, on the stored codes
(spec: ``reference.attention_reference``).

Grid ``(R, H_kv, q tiles)``: a program takes ``TQ`` of request ``r``'s tokens in this call and the ``G`` query heads
of one KV head (GQA: rows ``(token, g)``, ``BM = max(16, TQ * pow2(G))`` rows), so every page is read once per KV
head and q tile. It walks the request's history pages through its block-table row (positions below
``seq_lens[r] - t``): a page's raw rows that hold history tokens (``page.history_rows``: the first page's sinks, a
later page's ring) as stored, its code slots holding the others decoded in registers (``level[code] * scale``, in
the codec's rotated space: the keys' scores use ``q @ R_k^T`` once per program, plus ``q . m`` for centered keys,
``m`` the mean of the page before's raw key rows; the values' weighted sum stays rotated and is rotated back once at
the end), then the call's own tokens exactly from
``key`` / ``value`` (causal). One online softmax (base 2, fp32) over all of them, optional sink logits ``s_aux``.
Every dot is fp32 ``ieee``; rows of one request's tokens beyond the tile, heads ``>= G``, are masked.

Untuned first choices (never run on a GPU): ``TQ`` from the longest request's tokens in the call, at most
``16 / pow2(G)``; ``num_warps`` 4; no split over the history (one program walks all of a request's pages).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.triton.common import pow2
from ..page import PageFormat
from ..reference import page_view
from .page_form import (
    P_A,
    P_BS,
    P_CENTER,
    P_D,
    P_DP,
    P_RAW,
    P_RAW_ROW,
    P_SLOT,
    S_ROTATE,
    PageConsts,
    check_paged_limits,
    rotation_tile,
    slot_rows,
    stream_args,
)

LOG2E = 1.4426950408889634
MAX_ROWS = 16  # query rows (tokens x GQA heads) of one program (64 spilled 91 KB at sm_90)

# Indices into the launch tuple (``attention_tiles``):
T_G: tl.constexpr = tl.constexpr(0)
T_GP: tl.constexpr = tl.constexpr(1)
T_TQ: tl.constexpr = tl.constexpr(2)
T_BM: tl.constexpr = tl.constexpr(3)
T_BN_RAW: tl.constexpr = tl.constexpr(4)
T_BN_CODE: tl.constexpr = tl.constexpr(5)
T_BN_OWN: tl.constexpr = tl.constexpr(6)
T_SINKS: tl.constexpr = tl.constexpr(7)


def attention_tiles(fmt: PageFormat, block_size: int, group: int, max_query_len: int, sinks: bool) -> tuple:
    """``(G, pow2(G), TQ, BM, raw-row tile, code-slot tile, own-token tile, sinks)``: shapes only."""
    gp = pow2(group)
    tq = max(1, min(pow2(max_query_len), MAX_ROWS // gp))
    a = fmt.raw_rows(block_size)
    return (group, gp, tq, max(16, tq * gp), pow2(a, 16), pow2(block_size - a, 16), 16, sinks)


@triton.jit
def _update(s, ok, m, mass, acc, acc_rot):
    """One online-softmax step on scores ``s (BM, BN)`` (base 2) masked by ``ok``: ``(p, m, mass, acc, acc_rot)`` with
    the accumulators rescaled (``p`` still to be multiplied by the tile's values)."""
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.where(ok, tl.exp2(s - m_safe[:, None]), 0.0)
    return p, m_new, mass * alpha + tl.sum(p, 1), acc * alpha[:, None], acc_rot * alpha[:, None]


@triton.jit
def _attention_kernel(query, sq0, sq1, key, sk0, sk1, value, sv0, sv1, out, so0, so1, cache, sc0, sc1,
                      block_table, sbt, seq_lens, starts, sinks, scale,
                      rot_k, levels_k, rot_v, levels_v,
                      P: tl.constexpr, KS: tl.constexpr, VS: tl.constexpr, T: tl.constexpr):
    D: tl.constexpr = P[P_D]
    DP: tl.constexpr = P[P_DP]
    BS: tl.constexpr = P[P_BS]
    A: tl.constexpr = P[P_A]
    RAW_ROW: tl.constexpr = P[P_RAW_ROW]
    G: tl.constexpr = T[T_G]
    GP: tl.constexpr = T[T_GP]
    TQ: tl.constexpr = T[T_TQ]
    BM: tl.constexpr = T[T_BM]
    BNR: tl.constexpr = T[T_BN_RAW]
    BNC: tl.constexpr = T[T_BN_CODE]
    BNO: tl.constexpr = T[T_BN_OWN]
    KROT: tl.constexpr = (not P[P_RAW]) and KS[S_ROTATE]
    VROT: tl.constexpr = (not P[P_RAW]) and VS[S_ROTATE]
    r = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    qt = tl.program_id(2)
    qs = tl.load(starts + r).to(tl.int64)
    t = tl.load(starts + r + 1).to(tl.int64) - qs
    if qt * TQ < t:
        ctx = tl.load(seq_lens + r).to(tl.int64) - t
        i = tl.arange(0, BM)
        tok = qt * TQ + i // GP  # this call's token index inside the request
        g = i % GP
        row_ok = (g < G) & (tok < t) & (i < TQ * GP)
        qh = h * G + g
        d = tl.arange(0, DP)
        dok = d[None, :] < D
        q = tl.load(query + (qs + tok)[:, None] * sq0 + qh[:, None] * sq1 + d[None, :], mask=row_ok[:, None] & dok,
                    other=0.0).to(tl.float32) * (scale * 1.4426950408889634)
        qk = q
        if KROT:  # scores on rotated keys: (R q) . (R k)
            qk = tl.dot(q, rotation_tile(rot_k, D, DP, True), input_precision="ieee")
        m = tl.full((BM,), float("-inf"), tl.float32)
        mass = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, DP), tl.float32)
        acc_rot = tl.zeros((BM, DP), tl.float32)  # values' rotated space (VROT)
        dtype_ptr = tl.pointer_type(key.dtype.element_ty)
        total = ctx + t  # positions stored by this call's store (page.history_rows)
        jr = tl.arange(0, BNR)
        for pg in range(0, tl.cdiv(ctx, BS)):
            phys = tl.load(block_table + r.to(tl.int64) * sbt + pg).to(tl.int64)
            page = cache + phys * sc0 + h * sc1
            held = tl.minimum(BS, ctx - pg * BS)  # history tokens in the page
            ring_from = tl.maximum(tl.where(total - pg * BS >= BS, BS - A, held - A), 0)
            if A > 0:
                # the first page's sinks; a later page's ring, row j holding offset ring_from + ((j - ring_from) mod A)
                ok = (jr < A) & tl.where(pg == 0, jr < held, ring_from + (jr - ring_from % A + A) % A < held)
                row = (page + jr * RAW_ROW).to(dtype_ptr)
                okd = ok[:, None] & dok
                kr = tl.load(row[:, None] + d[None, :], mask=okd, other=0.0).to(tl.float32)
                vr = tl.load(row[:, None] + D + d[None, :], mask=okd, other=0.0).to(tl.float32)
                s = tl.dot(q, tl.trans(kr), input_precision="ieee")
                p, m, mass, acc, acc_rot = _update(s, row_ok[:, None] & ok[None, :], m, mass, acc, acc_rot)
                acc += tl.dot(p, vr, input_precision="ieee")
            if not P[P_RAW]:
                jc = tl.arange(0, BNC)
                ok = (jc < BS - A) & (jc < tl.where(pg == 0, held - A, tl.minimum(ring_from, held)))
                slot = page + A * RAW_ROW + jc * P[P_SLOT]
                kc = slot_rows(slot, ok, levels_k, KS, P)
                vc = slot_rows(slot, ok, levels_v, VS, P)
                s = tl.dot(qk, tl.trans(kc), input_precision="ieee")
                if P[P_CENTER]:  # + q . m, m the page before's raw key rows' mean (the first page: its own)
                    before = tl.load(block_table + r.to(tl.int64) * sbt + tl.maximum(pg - 1, 0)).to(tl.int64)
                    rows = (cache + before * sc0 + h * sc1 + jr * RAW_ROW).to(dtype_ptr)
                    mk = tl.load(rows[:, None] + d[None, :], mask=(jr < A)[:, None] & dok, other=0.0).to(tl.float32)
                    s += tl.sum(q * (tl.sum(mk, 0) / A)[None, :], 1)[:, None]
                p, m, mass, acc, acc_rot = _update(s, row_ok[:, None] & ok[None, :], m, mass, acc, acc_rot)
                if VROT:
                    acc_rot += tl.dot(p, vc, input_precision="ieee")
                else:
                    acc += tl.dot(p, vc, input_precision="ieee")
        last = tl.minimum(t, (qt + 1) * TQ)  # own tokens up to the tile's last query (causal)
        for o in range(0, last, BNO):
            jo = o + tl.arange(0, BNO)
            ok = jo < t
            okd = ok[:, None] & dok
            ko = tl.load(key + (qs + jo)[:, None] * sk0 + h * sk1 + d[None, :], mask=okd, other=0.0).to(tl.float32)
            vo = tl.load(value + (qs + jo)[:, None] * sv0 + h * sv1 + d[None, :], mask=okd, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(ko), input_precision="ieee")
            visible = row_ok[:, None] & ok[None, :] & (jo[None, :] <= tok[:, None])
            p, m, mass, acc, acc_rot = _update(s, visible, m, mass, acc, acc_rot)
            acc += tl.dot(p, vo, input_precision="ieee")
        if VROT:  # back from the values' rotated space: v = v_rot @ R
            acc += tl.dot(acc_rot, rotation_tile(rot_v, D, DP, False), input_precision="ieee")
        if T[T_SINKS]:
            sk = tl.load(sinks + qh, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_new = tl.maximum(m, sk)
            alpha = tl.exp2(m - m_new)
            mass = mass * alpha + tl.exp2(sk - m_new)
            acc = acc * alpha[:, None]
        res = acc / tl.where(mass > 0, mass, 1.0)[:, None]
        tl.store(out + (qs + tok)[:, None] * so0 + qh[:, None] * so1 + d[None, :], res.to(out.dtype.element_ty),
                 mask=row_ok[:, None] & dok)


def triton_paged_attention(fmt: PageFormat, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, scale: float, s_aux: torch.Tensor | None, out: torch.Tensor,
                           max_query_len: int | None = None) -> None:
    """``attention_reference``'s twin into ``out (N, H_q, D)`` (the caller, ``kernels.paged_attention``, checked
    shapes and dtypes). ``max_query_len``: the most tokens of one request in the call (computed when None: a host
    sync)."""
    page_view(cache)
    bs = cache.shape[2]
    check_paged_limits(fmt, bs)
    for name, x in (("query", query), ("key", key), ("value", value), ("out", out)):
        if x.stride(2) != 1:
            raise ValueError(f"{name} rows must be contiguous along head_dim for the Triton attention")
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous")
    requests = seq_lens.shape[0]
    if query_start_loc.shape != (requests + 1,):
        raise ValueError(f"query_start_loc must be (R + 1,) = ({requests + 1},), got {tuple(query_start_loc.shape)}")
    hq, heads = query.shape[1], cache.shape[1]
    if s_aux is not None and s_aux.numel() != hq:
        raise ValueError(f"s_aux must hold one logit per query head ({hq}), got {tuple(s_aux.shape)}")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if requests else 0
    if requests == 0 or max_query_len <= 0:
        return
    tiles = attention_tiles(fmt, bs, hq // heads, max_query_len, s_aux is not None)
    (_, ks, kt), (_, vs, vt) = stream_args(fmt, cache.device)
    sinks = query.new_zeros(1, dtype=torch.float32) if s_aux is None else s_aux.float().contiguous()
    grid = (requests, heads, triton.cdiv(max_query_len, tiles[2]))
    _attention_kernel[grid](query, query.stride(0), query.stride(1), key, key.stride(0), key.stride(1), value,
                            value.stride(0), value.stride(1), out, out.stride(0), out.stride(1), cache,
                            cache.stride(0), cache.stride(1), block_table, block_table.stride(0),
                            seq_lens.contiguous(), query_start_loc.contiguous(), sinks, float(scale),
                            kt[0], kt[1], vt[0], vt[1], P=PageConsts.of(fmt, bs).constexpr(), KS=ks, VS=vs, T=tiles,
                            num_warps=4)
