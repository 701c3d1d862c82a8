"""Shared pieces of the Triton kernels: the codec as constexprs, device-held codec matrices, the Triton path's
limits, and the stored-row loader.

Every kernel works on the dense stored rows ``S`` of a block (``X = A @ S``): int8 codes are dequantized
and pruned png deltas are scattered to their positions in registers, so no kernel ever writes ``S`` out.
One loader per stored form (:func:`stored_rows`), one encoder (:func:`archive_block`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..codecs import JPEG, Codec, dct_basis
from ..codecs.quant import qmax

# What the Triton path accepts (launchers raise a ValueError naming the limit; the reference ops take more):
MAX_BLOCK_SIZE = 64  # a block's rows and a tile's positions live in registers
MAX_PRUNED_BLOCK_SIZE = 16  # pruned png ranks deltas with an (r, r, D) comparison and unrolls one loop per kept delta
MAX_HEAD_DIM = 256  # one program holds a block's whole head_dim (the int8 scale is an amax over it)


def pow2(n: int, least: int = 1) -> int:
    """Smallest power of two >= max(n, least) (Triton tile dimensions are powers of two)."""
    return max(least, triton.next_power_of_2(max(1, n)))


def check_triton_limits(codec: Codec, head_dim: int, name: str = "spec") -> None:
    """Raise a ValueError when ``codec`` / ``head_dim`` exceed what the Triton kernels take (see the constants)."""
    r = codec.block_size
    if r > MAX_BLOCK_SIZE:
        raise ValueError(f"{name}: the Triton kernels take block_size <= {MAX_BLOCK_SIZE}, got {r}")
    if codec.index_rows and r > MAX_PRUNED_BLOCK_SIZE:
        raise ValueError(f"{name}: the Triton kernels take pruned png (keep_ratio < 1) with block_size <= "
                         f"{MAX_PRUNED_BLOCK_SIZE}, got {r}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels take head_dim <= {MAX_HEAD_DIM}, got {head_dim}")


@dataclass(frozen=True)
class BlockForm:
    """One codec as the constexprs of the kernels that encode or decode whole blocks.

    ``r`` tokens per block, ``rows`` stored rows (``R``), ``is_jpeg`` (else png), ``qmax`` the largest int code
    (0: not quantized), ``kept`` the kept deltas of a pruned png (0: not pruned); ``XR``/``KR`` the register
    tiles of a block's tokens and of its stored rows (>= 16: ``tl.dot``'s minimum).
    """

    r: int
    rows: int
    is_jpeg: bool
    qmax: int
    kept: int

    @classmethod
    def of(cls, codec: Codec) -> BlockForm:
        return cls(codec.block_size, codec.rows, codec.mode == JPEG, qmax(codec.quant_bits) if codec.quant_bits else 0,
                   codec.index_rows)

    def constexprs(self) -> dict[str, int | bool]:
        return {"r": self.r, "R": self.rows, "IS_JPEG": self.is_jpeg, "QMAX": self.qmax, "KEPT": self.kept,
                "XR": pow2(self.r, 16), "KR": pow2(self.rows, 16)}


@dataclass(frozen=True)
class StoredForm:
    """How one stream's blocks are read by attention: ``rows`` stored rows, ``dense`` rows of ``S`` (``A``'s
    columns), ``quant`` (int8 codes, one fp32 scale per stored row), ``kept`` (pruned png: kept deltas, else 0)."""

    rows: int
    dense: int
    quant: bool
    kept: int

    @classmethod
    def of(cls, codec: Codec) -> StoredForm:
        return cls(codec.rows, codec.dense_rows, bool(codec.quant_bits), codec.index_rows)

    def constexprs(self, prefix: str) -> dict[str, int | bool]:
        """``{prefix}_ROWS, _DENSE, _DENSE_P`` (the dense rows' power-of-two tile), ``_QUANT, _KEPT``."""
        return {f"{prefix}_ROWS": self.rows, f"{prefix}_DENSE": self.dense, f"{prefix}_DENSE_P": pow2(self.dense),
                f"{prefix}_QUANT": self.quant, f"{prefix}_KEPT": self.kept}


@functools.cache
def _matrices(spec: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    from ..codecs import codec_from_spec

    codec = codec_from_spec(list(spec))
    synthesis = codec.synthesis("cpu").contiguous()
    analysis = dct_basis(codec.block_size, "cpu")[: codec.rows].contiguous() if codec.mode == JPEG else synthesis
    return synthesis.to(device), analysis.to(device)


def codec_matrices(codec: Codec, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, M)`` fp32 on ``device``: ``A (r, R_dense)`` synthesis, ``M (K, r)`` the jpeg analysis (png: A again).

    Cached per (codec, device) for the process: the first call copies from the host, so it must not happen inside
    a CUDA-graph capture; ``CodecStream`` makes that call when it allocates its storage (see :func:`prepare`)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _matrices(tuple(codec.spec), device)


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
                R: tl.constexpr, D: tl.constexpr, QUANT: tl.constexpr, KEPT: tl.constexpr):
    """Dense fp32 stored rows ``S[blk, i, d]`` of contiguous ``(..., NB, R, D)`` storage, zero where not ``valid``.

    ``blk``: linear block ids (``(b * H + h) * NB + n``, int64), ``i``: dense row in the block, ``d``: channel,
    all broadcastable to the tile. ``QUANT``: int8 codes times their row's fp32 scale. Pruned png
    (``KEPT > 0``): dense row ``i >= 1`` is the delta at position ``i - 1``, found among the ``KEPT`` stored
    deltas by their uint8 index.
    """
    ok = valid & (d < D)
    if KEPT > 0:
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
                  D: tl.constexpr, r: tl.constexpr, R: tl.constexpr, IS_JPEG: tl.constexpr, QMAX: tl.constexpr,
                  KEPT: tl.constexpr, XR: tl.constexpr, KR: tl.constexpr):
    """Encode one block and store it where ``store_ok`` (a ``(1, 1)`` tensor); returns its decoded fp32 rows ``(XR, DP)``.

    ``x (XR, DP)``: fp32 rows ``i`` of the block (zero past ``r``); ``x_prev``: rows ``i - 1`` (png only).
    jpeg: ``C = M @ x`` (``M`` the ``(R, r)`` analysis matrix), int8 codes with a per-row scale ``amax / QMAX``
    when ``QMAX > 0``, else ``C`` in the storage dtype. png: anchor + deltas in fp32; ``KEPT > 0`` keeps the
    ``KEPT`` largest deltas per channel (ties to the earlier position), in decreasing magnitude order.
    The decoded rows are what ``codec.decode`` rebuilds from the stored values. (``BlockForm`` holds the
    constexprs after ``D``.)
    """
    ok_d = d < D
    if IS_JPEG:
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
