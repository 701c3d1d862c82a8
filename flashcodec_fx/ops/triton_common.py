"""Shared pieces of the Triton kernels: device-cached codec matrices, tile sizes, and the stored-row loader.

Every kernel works on the dense stored rows ``S`` of a block (``X = A @ S``): int8 codes are dequantized
and pruned png deltas are scattered to their positions in registers, so no kernel ever writes ``S`` out.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..codecs import Codec, dct_basis


def pow2(n: int, least: int = 1) -> int:
    """Smallest power of two >= max(n, least) (Triton tile dimensions are powers of two)."""
    return max(least, triton.next_power_of_2(max(1, n)))


@functools.lru_cache(maxsize=64)
def _matrices(spec: tuple[int, ...], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    from ..codecs import codec_from_spec

    codec = codec_from_spec(list(spec))
    synthesis = codec.synthesis("cpu").contiguous()
    analysis = dct_basis(codec.block_size, "cpu")[: codec.rows].contiguous() if codec.mode == 0 else synthesis
    return synthesis.to(device), analysis.to(device)


def codec_matrices(codec: Codec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, M)`` fp32 on ``device``, cached so a call inside a CUDA graph capture never copies from the host:
    ``A (r, R_dense)`` synthesis, ``M (K, r)`` the jpeg analysis (png: unused, A again)."""
    return _matrices(tuple(codec.spec), str(device))


def dot_dtype(*dtypes: torch.dtype) -> tl.dtype:
    """Operand dtype of the Q.S / P.S dots: fp32 when any operand is fp32, else the 16-bit I/O dtype."""
    if torch.float32 in dtypes:
        return tl.float32
    return tl.bfloat16 if torch.bfloat16 in dtypes else tl.float16


def dot_precision(q_dtype: torch.dtype) -> str:
    """Precision of the dots whose operands are fp32 (synthesis expansion and fold, png deltas): exact fp32
    (``ieee``) for fp32 I/O; ``tf32x3`` (three tf32 tensor-core passes, about fp32 accuracy) for 16-bit I/O."""
    return "ieee" if q_dtype == torch.float32 else "tf32x3"


def require_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the Triton kernels (the cache allocates it so)")


@triton.jit
def stored_rows(data_ptr, scale_ptr, index_ptr, blk, i, d, valid,
                R: tl.constexpr, D: tl.constexpr, QUANT: tl.constexpr, PRUNED: tl.constexpr, KEPT: tl.constexpr):
    """Dense fp32 stored rows ``S[blk, i, d]`` of contiguous ``(..., NB, R, D)`` storage, zero where not ``valid``.

    ``blk``: linear block ids (``(b * H + h) * NB + n``), ``i``: dense row in the block, ``d``: channel, all
    broadcastable to the tile. Pruned png (``PRUNED``): dense row ``i >= 1`` is the delta at position ``i - 1``,
    found among the ``KEPT`` stored deltas by their uint8 index.
    """
    ok = valid & (d < D)
    if PRUNED:
        rows = tl.load(data_ptr + blk * (R * D) + d, mask=ok & (i == 0), other=0.0).to(tl.float32)
        for m in tl.static_range(KEPT):
            where = tl.load(index_ptr + blk * (KEPT * D) + m * D + d, mask=ok & (i > 0), other=255).to(tl.int32)
            delta = tl.load(data_ptr + blk * (R * D) + (1 + m) * D + d, mask=ok & (where == i - 1), other=0.0)
            rows += delta.to(tl.float32)
    else:
        rows = tl.load(data_ptr + blk * (R * D) + i * D + d, mask=ok & (i < R), other=0.0).to(tl.float32)
        if QUANT:
            rows = rows * tl.load(scale_ptr + blk * R + i, mask=valid & (i < R), other=0.0)
    return rows

@triton.jit
def _round_half_even(x):
    """``torch.round``: nearest integer, ties to even."""
    f = tl.floor(x)
    diff = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((diff > 0.5) | ((diff == 0.5) & odd), f + 1.0, f)


@triton.jit
def archive_block(x, x_prev, i, d, blk, store_ok, an_ptr, syn_ptr, data_ptr, scale_ptr, index_ptr,
                  r: tl.constexpr, D: tl.constexpr, XR: tl.constexpr, KR: tl.constexpr, MODE: tl.constexpr,
                  R: tl.constexpr, QMAX: tl.constexpr, KEPT: tl.constexpr):
    """Encode one block and store it where ``store_ok`` (a ``(1, 1)`` tensor); returns its decoded fp32 rows ``(XR, DP)``.

    ``x (XR, DP)``: fp32 rows ``i`` of the block (zero past ``r``); ``x_prev``: rows ``i - 1`` (png only).
    jpeg (``MODE == 0``): ``C = M @ x`` (``M`` the ``(R, r)`` analysis matrix), int8 codes with a per-row scale
    when ``QMAX > 0``, else ``C`` in the storage dtype. png: anchor + deltas in fp32; ``KEPT > 0`` keeps the
    ``KEPT`` largest deltas per channel (ties to the earlier position), in decreasing magnitude order.
    The decoded rows are what ``codec.decode`` rebuilds from the stored values.
    """
    ok_d = d < D
    if MODE == 0:
        k = tl.arange(0, KR)[:, None]
        an = tl.load(an_ptr + k * r + tl.arange(0, XR)[None, :], mask=(k < R) & (tl.arange(0, XR)[None, :] < r),
                     other=0.0)
        coef = tl.dot(an, x, input_precision="ieee")
        if QMAX > 0:
            # IEEE divisions, as torch does (Triton's fp32 `/` may be approximate on GPUs)
            scale = tl.math.div_rn(tl.max(tl.abs(coef), axis=1), tl.full((KR,), QMAX, tl.float32))
            safe = tl.where(scale > 0, scale, 1.0)
            codes = _round_half_even(tl.math.div_rn(coef, safe[:, None]))
            codes = tl.minimum(tl.maximum(codes, -QMAX), QMAX)
            tl.store(data_ptr + blk * (R * D) + k * D + d, codes.to(tl.int8), mask=store_ok & (k < R) & ok_d)
            tl.store(scale_ptr + blk * R + k, scale[:, None], mask=store_ok & (k < R))
            rows = codes * scale[:, None]
        else:
            stored = coef.to(data_ptr.dtype.element_ty)
            tl.store(data_ptr + blk * (R * D) + k * D + d, stored, mask=store_ok & (k < R) & ok_d)
            rows = stored.to(tl.float32)
        syn = tl.load(syn_ptr + i * R + tl.arange(0, KR)[None, :], mask=(i < r) & (tl.arange(0, KR)[None, :] < R),
                      other=0.0)
        decoded = tl.dot(syn, rows, input_precision="ieee")
    else:
        dense = tl.where(i == 0, x, x - x_prev)
        dense = tl.where(i < r, dense, 0.0)
        if KEPT > 0:
            mag = tl.abs(dense)
            j3 = tl.arange(0, XR)[None, :, None]
            i3 = tl.arange(0, XR)[:, None, None]
            a_i = tl.expand_dims(mag, 1)
            a_j = tl.expand_dims(mag, 0)
            beats = (j3 >= 1) & (j3 < r) & ((a_j > a_i) | ((a_j == a_i) & (j3 < i3)))
            rank = tl.sum(beats.to(tl.int32), axis=1)
            delta_row = (i >= 1) & (i < r)
            tl.store(data_ptr + blk * (R * D) + i * D + d, x, mask=store_ok & (i == 0) & ok_d)
            for m in tl.static_range(KEPT):
                sel = delta_row & (rank == m)
                val = tl.sum(tl.where(sel, dense, 0.0), axis=0)
                pos = tl.sum(tl.where(sel, i - 1, 0), axis=0)
                tl.store(data_ptr + blk * (R * D) + (1 + m) * D + d, tl.expand_dims(val, 0), mask=store_ok & ok_d)
                tl.store(index_ptr + blk * (KEPT * D) + m * D + d, tl.expand_dims(pos, 0).to(tl.uint8),
                         mask=store_ok & ok_d)
            dense = tl.where((i == 0) | (delta_row & (rank < KEPT)), dense, 0.0)
        else:
            tl.store(data_ptr + blk * (R * D) + i * D + d, dense, mask=store_ok & (i < r) & ok_d)
        decoded = tl.cumsum(dense, axis=0)
    return decoded
