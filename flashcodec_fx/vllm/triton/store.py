"""The store on CUDA: new tokens into their pages as the store plan says (spec: ``reference.store_reference``).

Two launches of grid ``(cdiv(N, BT), H_kv)``, a program taking ``BT`` tokens of one KV head (the plan,
``page.store_plan``, says where each goes): first the raw rows (K then V, bitwise), then the code slots, whose keys
are centered on the mean of raw key rows the first launch may have written (rows added in order, as the reference):
rotated (``x @ R^T``, an fp32 ``ieee`` dot), then the quantizer of ``ops.triton.append`` (base scale, the clipping
search with fp16 scales rounded up, nearest level), the fp16 scale and the packed codes written into the slot's
bytes. The sums run in another order than torch's, so a code may land one level apart at a rounding tie and the
search may pick another factor where two errors tie (tests bound both). Trellis codes (``levels="tcq"``) take
``ops.triton.append.trellis_encode`` instead: the Viterbi search of ``codecs/trellis.py`` with its sums sequential
along the row, as the reference's (the launch turns off FMA contraction for them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.triton.append import base_scales, nearest_codes, search_scales, trellis_encode
from ...ops.triton.common import F_TCQ, KIND_TCQ
from ..page import PageFormat, StorePlan
from ..reference import page_view
from .page_form import (
    P_A,
    P_BS,
    P_CENTER,
    P_D,
    P_DP,
    P_RAW_ROW,
    P_SLOT,
    S_BITS,
    S_CODE,
    S_KIND,
    S_ROTATE,
    S_SCALE,
    S_SEARCH,
    PageConsts,
    check_paged_limits,
    rotation_tile,
    stream_args,
)

STORE_TOKENS = 16  # tokens per program (>= 16: the rotation is a tl.dot)


@triton.jit
def _encode_slots(x, row_ok, slot, rot, levels, factors, F: tl.constexpr, S: tl.constexpr, P: tl.constexpr):
    """Encode rows ``x (BT, DP)`` fp32 into the code slots at byte pointers ``slot (BT,)`` where ``row_ok``."""
    D: tl.constexpr = P[P_D]
    DP: tl.constexpr = P[P_DP]
    BITS: tl.constexpr = S[S_BITS]
    BT: tl.constexpr = x.shape[0]
    d = tl.arange(0, DP)
    ok = row_ok[:, None] & (d[None, :] < D)
    if S[S_ROTATE]:
        x = tl.dot(x, rotation_tile(rot, D, DP, True), input_precision="ieee")
    x = tl.where(ok, x, 0.0)
    bits = tl.full((BT,), BITS, tl.int32)
    kind = tl.full((BT,), S[S_KIND], tl.int32)
    j = tl.zeros((BT,), tl.int32)
    if S[S_KIND] == KIND_TCQ:  # trellis codes: the Viterbi search and its scale
        code, s = trellis_encode(x, row_ok, bits, j, levels, factors, d[None, :], F, D, S[S_SEARCH])
        code = tl.where(ok, code, 0)
    else:
        code, s = _scalar_codes(x, ok, bits, kind, j, levels, factors, F, S, D)
    tl.store((slot + S[S_SCALE]).to(tl.pointer_type(tl.float16)), s.to(tl.float16), mask=row_ok)
    base = slot + S[S_CODE]  # codecs/pack.py: power-of-two slices, widest first (it holds the low bits)
    _store_slice(base, code, row_ok, BITS, 8, D, DP)
    _store_slice(base, code, row_ok, BITS, 4, D, DP)
    _store_slice(base, code, row_ok, BITS, 2, D, DP)
    _store_slice(base, code, row_ok, BITS, 1, D, DP)


@triton.jit
def _scalar_codes(x, ok, bits, kind, j, levels, factors, F: tl.constexpr, S: tl.constexpr, D: tl.constexpr):
    """Scalar codes ``(BT, DP)`` (zero where not ``ok``) and scales ``(BT,)`` of rows ``x``: the base scale, the
    clipping search, the nearest level (``ops.triton.append``'s quantizer)."""
    bits2, kind2, j2 = bits[:, None], kind[:, None], j[:, None]
    amax, low, high, rms = base_scales(x, ok, bits2, kind2, 1, D * 1.0)
    s, z, fit_code = search_scales(x, ok, bits2, kind2, j2, levels, factors, amax, low, high, rms, kind, bits, j, 1, F,
                                   S[S_SEARCH])
    if S[S_SEARCH] == 2:  # "fit": the codes of its last pass
        code = tl.where(ok, fit_code, 0)
    else:
        code = tl.where(ok, nearest_codes(x, s[:, None], z[:, None], bits2, kind2, j2, levels, F), 0)
    return code, s


@triton.jit
def _store_slice(base, code, row_ok, BITS: tl.constexpr, WIDTH: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """Pack the ``WIDTH``-bit slice of codes ``(BT, DP)`` (if their width has one) at byte pointers ``base (BT,)``."""
    SHIFT: tl.constexpr = BITS - (BITS & (2 * WIDTH - 1))
    if (BITS & WIDTH) != 0:
        PB: tl.constexpr = 8 // WIDTH
        part = (code >> SHIFT) & ((1 << WIDTH) - 1)
        weight = (tl.arange(0, PB) * WIDTH)[None, None, :]
        packed = tl.sum(tl.reshape(part, (code.shape[0], DP // PB, PB)) << weight, axis=2)
        byte = tl.arange(0, DP // PB)
        tl.store(base[:, None] + SHIFT * (D // 8) + byte[None, :], packed.to(tl.uint8),
                 mask=row_ok[:, None] & (byte[None, :] < D // PB))


@triton.jit
def _store_kernel(key, value, sk0, sk1, sv0, sv1, slots, raw_rows, code_slots, mean_blocks, n_tokens, cache, sc0, sc1,
                  rot_k, levels_k, factors_k, rot_v, levels_v, factors_v,
                  P: tl.constexpr, KF: tl.constexpr, KS: tl.constexpr, VF: tl.constexpr, VS: tl.constexpr,
                  BT: tl.constexpr, CODES: tl.constexpr):
    """The raw rows of ``BT`` tokens of one head (``CODES`` False), or their code slots (True)."""
    D: tl.constexpr = P[P_D]
    DP: tl.constexpr = P[P_DP]
    BS: tl.constexpr = P[P_BS]
    A: tl.constexpr = P[P_A]
    RAW_ROW: tl.constexpr = P[P_RAW_ROW]
    n = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, DP)
    inside = n < n_tokens
    slot = tl.load(slots + n, mask=inside, other=-1).to(tl.int64)
    target = tl.load((code_slots if CODES else raw_rows) + n, mask=inside, other=-1)
    valid = (slot >= 0) & (target >= 0)
    page = cache + tl.where(valid, slot, 0) // BS * sc0 + h * sc1  # byte pointers (BT,)
    okd = valid[:, None] & (d[None, :] < D)
    k = tl.load(key + n[:, None] * sk0 + h * sk1 + d[None, :], mask=okd, other=0.0)
    v = tl.load(value + n[:, None] * sv0 + h * sv1 + d[None, :], mask=okd, other=0.0)
    if not CODES:  # raw rows: K then V in the model's dtype, bitwise
        row = (page + tl.where(valid, target, 0) * RAW_ROW).to(tl.pointer_type(key.dtype.element_ty))
        tl.store(row[:, None] + d[None, :], k, mask=okd)
        tl.store(row[:, None] + D + d[None, :], v, mask=okd)
    else:
        kf = k.to(tl.float32)
        if P[P_CENTER]:  # minus the mean of the mean block's raw key rows, added in order
            block = tl.load(mean_blocks + n, mask=inside, other=0).to(tl.int64)
            rows = (cache + tl.where(valid, block, 0) * sc0 + h * sc1).to(tl.pointer_type(key.dtype.element_ty))
            total = tl.load(rows[:, None] + d[None, :], mask=okd, other=0.0).to(tl.float32)
            for j in tl.static_range(1, A):
                total += tl.load(rows[:, None] + j * 2 * D + d[None, :], mask=okd, other=0.0).to(tl.float32)
            kf = kf - total / A
        slot_ptr = page + A * RAW_ROW + tl.where(valid, target, 0) * P[P_SLOT]
        _encode_slots(kf, valid, slot_ptr, rot_k, levels_k, factors_k, KF, KS, P)
        _encode_slots(v.to(tl.float32), valid, slot_ptr, rot_v, levels_v, factors_v, VF, VS, P)


def store_launch(fmt: PageFormat, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                 slot_mapping: torch.Tensor, plan: StorePlan) -> None:
    """Validate, then launch the raw rows, then the code slots (the caller, ``kernels.paged_store``, checked shapes
    and dtypes and made the plan)."""
    page_view(cache)
    check_paged_limits(fmt, cache.shape[2])
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value rows must be contiguous along head_dim for the Triton store")
    n, heads = key.shape[0], key.shape[1]
    if n == 0:
        return
    (kf, ks, kt), (vf, vs, vt) = stream_args(fmt, cache.device)
    grid = (triton.cdiv(n, STORE_TOKENS), heads)
    args = (key, value, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            slot_mapping.to(torch.int64).contiguous(), *(x.contiguous() for x in plan), n, cache, cache.stride(0),
            cache.stride(1), *kt, *vt)
    consts = {"P": PageConsts.of(fmt, cache.shape[2]).constexpr(), "KF": kf, "KS": ks, "VF": vf, "VS": vs,
              "BT": STORE_TOKENS, "num_warps": 4, "enable_fp_fusion": not (kf[F_TCQ] or vf[F_TCQ])}
    _store_kernel[grid](*args, CODES=False, **consts)
    if not fmt.raw:
        _store_kernel[grid](*args, CODES=True, **consts)


def triton_paged_store(fmt: PageFormat, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                       slot_mapping: torch.Tensor, plan: StorePlan) -> None:
    """``store_reference``'s twin on the device (CPU tensors under ``TRITON_INTERPRET=1``), ``plan`` its
    ``page.store_plan``."""
    store_launch(fmt, key, value, cache, slot_mapping, plan)
