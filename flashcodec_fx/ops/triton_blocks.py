"""Triton `encode`, `decode` and `read`: one program per block, the whole head_dim in registers.

encode: ``(B, H, NB * r, D)`` -> stored blocks (DCT projection + optional int8, or png anchor + deltas).
decode: stored blocks -> ``(B, H, NB * r, D)`` (``X = A @ S``; png as a prefix sum of the deltas).
read:   decode, then the open block's raw tail rows and zeros past the device-held length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._validate import check_length, check_state, spec_codec
from .triton_common import (
    BlockForm,
    archive_block,
    check_triton_limits,
    codec_matrices,
    pow2,
    require_contiguous,
    stored_rows,
)


@triton.jit
def _encode_kernel(x_ptr, sxb, sxh, sxs, sxd, an_ptr, syn_ptr, data_ptr, scale_ptr, index_ptr, H, NB,
                   D: tl.constexpr, DP: tl.constexpr,
                   r: tl.constexpr, R: tl.constexpr, IS_JPEG: tl.constexpr, QMAX: tl.constexpr, KEPT: tl.constexpr,
                   XR: tl.constexpr, KR: tl.constexpr):
    """One block of ``x`` (any strides) -> its stored rows."""
    blk = tl.program_id(0).to(tl.int64)
    bh = blk // NB
    n = blk % NB
    i = tl.arange(0, XR)[:, None]
    d = tl.arange(0, DP)[None, :]
    base = x_ptr + (bh // H) * sxb + (bh % H) * sxh + d.to(tl.int64) * sxd
    x = tl.load(base + (n * r + i) * sxs, mask=(i < r) & (d < D), other=0.0).to(tl.float32)
    x_prev = x
    if not IS_JPEG:
        x_prev = tl.load(base + (n * r + i - 1) * sxs, mask=(i >= 1) & (i < r) & (d < D), other=0.0).to(tl.float32)
    archive_block(x, x_prev, i, d, blk, tl.full((1, 1), 1, tl.int1), an_ptr, syn_ptr, data_ptr, scale_ptr, index_ptr,
                  D, r, R, IS_JPEG, QMAX, KEPT, XR, KR)


@triton.jit
def _decode_kernel(data_ptr, scale_ptr, index_ptr, syn_ptr, tail_ptr, len_ptr, out_ptr, NB,
                   D: tl.constexpr, DP: tl.constexpr, READ: tl.constexpr,
                   r: tl.constexpr, R: tl.constexpr, IS_JPEG: tl.constexpr, QMAX: tl.constexpr, KEPT: tl.constexpr,
                   XR: tl.constexpr, KR: tl.constexpr):
    """One stored block -> its ``r`` rows of ``out``; ``READ``: rows at and past the device length's open block
    come from the raw tail (zeros past the length)."""
    blk = tl.program_id(0).to(tl.int64)
    bh = blk // NB
    n = blk % NB
    i = tl.arange(0, XR)[:, None]
    d = tl.arange(0, DP)[None, :]
    if IS_JPEG:
        k = tl.arange(0, KR)
        rows = stored_rows(data_ptr, scale_ptr, index_ptr, blk, k[:, None], d, (k < R)[:, None], R, D, QMAX > 0, 0)
        syn = tl.load(syn_ptr + i * R + k[None, :], mask=(i < r) & (k[None, :] < R), other=0.0)
        x = tl.dot(syn, rows, input_precision="ieee")
    else:
        rows = stored_rows(data_ptr, scale_ptr, index_ptr, blk, i, d, i < r, R, D, False, KEPT)
        x = tl.cumsum(rows, axis=0)
    pos = n * r + i
    if READ:
        length = tl.load(len_ptr)
        start = length // r * r
        raw = tl.load(tail_ptr + bh * (r * D) + (pos - start) * D + d, mask=(pos >= start) & (pos < length) & (d < D),
                      other=0.0)
        x = tl.where(pos >= start, raw.to(tl.float32), x)
    tl.store(out_ptr + bh * (NB * r * D) + pos * D + d, x.to(out_ptr.dtype.element_ty), mask=(i < r) & (d < D))


def triton_encode(x: torch.Tensor, spec: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton ``flashcodec::encode``: ``x (B, H, NB * r, D)``, any strides -> ``(data, scale, index)`` as in
    ``codecs.Encoded`` (contiguous).

    Quantized codes may differ from the reference by one step where a coefficient lands within an fp32 rounding
    of a half-step boundary (the DCT sums run in another order); pruned png keeps the same deltas as the
    reference unless magnitudes tie, and stores them in decreasing magnitude order.
    """
    codec = spec_codec("spec", spec)
    if x.dim() != 4 or x.shape[2] % codec.block_size:
        raise ValueError(f"x must be (B, H, S, D) with S a multiple of block_size={codec.block_size}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    b, h, s, d = x.shape
    check_triton_limits(codec, d)
    nb = s // codec.block_size
    data, scale, index = codec.empty_state((b, h), nb, d, x.dtype, x.device)
    if data.numel():
        syn, an = codec_matrices(codec, x.device)
        _encode_kernel[(b * h * nb,)](x, *x.stride(), an, syn, data, scale, index, h, nb, D=d, DP=pow2(d, 16),
                                      **BlockForm.of(codec).constexprs())
    return data, scale, index


def _launch_decode(codec, data, scale, index, tail, length, out, read: bool) -> torch.Tensor:
    b, h, nb, _, d = data.shape
    check_triton_limits(codec, d)
    if out.numel():
        syn, _ = codec_matrices(codec, data.device)
        _decode_kernel[(b * h * nb,)](data, scale, index, syn, tail, length, out, nb, D=d, DP=pow2(d, 16), READ=read,
                                      **BlockForm.of(codec).constexprs())
    return out


def triton_decode(data: torch.Tensor, scale: torch.Tensor, index: torch.Tensor, spec: list[int],
                  dtype: torch.dtype) -> torch.Tensor:
    """Triton ``flashcodec::decode``: stored blocks ``(B, H, NB, R, D)`` -> ``(B, H, NB * r, D)`` in ``dtype``."""
    codec = spec_codec("spec", spec)
    check_state("state", codec, data, scale, index)
    require_contiguous(data=data, scale=scale, index=index)
    b, h, nb, _, d = data.shape
    out = torch.empty(b, h, nb * codec.block_size, d, dtype=dtype, device=data.device)
    return _launch_decode(codec, data, scale, index, data, data, out, False)


def triton_read(data: torch.Tensor, scale: torch.Tensor, index: torch.Tensor, tail: torch.Tensor, length: torch.Tensor,
                spec: list[int]) -> torch.Tensor:
    """Triton ``flashcodec::read``: ``(B, H, NB * r, D)`` in the tail's dtype (archive decoded, raw tail, zeros past
    ``length``); ``length`` is read on the device."""
    codec = spec_codec("spec", spec)
    check_state("archive", codec, data, scale, index, tail)
    check_length(length)
    require_contiguous(data=data, scale=scale, index=index, tail=tail)
    b, h, nb, _, d = data.shape
    out = torch.empty(b, h, nb * codec.block_size, d, dtype=tail.dtype, device=data.device)
    return _launch_decode(codec, data, scale, index, tail, length, out, True)

