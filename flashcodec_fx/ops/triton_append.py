"""Triton `append`: new tokens into the raw tail, completed blocks encoded into their archive slots on the device.

Two kernels and one in-place add, the same launches every step (grids depend on shapes only; the length is
read on the device), so a decode step is capturable in a CUDA graph:

1. ``_archive_kernel``, one program per (batch * head, touched block ``j``): builds the block's rows from the
   old tail and the new tokens, encodes + stores it when it is complete, and writes the memo (decoded rows of a
   newly archived block, raw rows of the open block), exactly as the reference does.
2. ``_tail_kernel``, one program per (batch * head): the open block's rows become the new tail.
3. ``length += T``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._validate import check_append_args
from .append import touched_blocks
from .triton_common import BlockForm, archive_block, check_triton_limits, codec_matrices, pow2, require_contiguous


@triton.jit
def _work_rows(new_ptr, snb, snh, snt, tail_ptr, b, h, bh, w, d, off, T, r: tl.constexpr, D: tl.constexpr):
    """Rows ``w`` of the reference's work buffer (old tail, then ``new`` written from ``off``, zeros after), fp32."""
    in_new = (w >= off) & (w < off + T) & (d < D)
    fresh = tl.load(new_ptr + b * snb + h * snh + (w - off) * snt + d, mask=in_new, other=0.0)
    old = tl.load(tail_ptr + bh * (r * D) + w * D + d, mask=(w >= 0) & (w < r) & (d < D) & ~in_new, other=0.0)
    return tl.where(in_new, fresh.to(tl.float32), old.to(tl.float32))


@triton.jit
def _archive_kernel(data_ptr, scale_ptr, index_ptr, tail_ptr, len_ptr, new_ptr, snb, snh, snt, memo_ptr, an_ptr,
                    syn_ptr, H, NB, T, D: tl.constexpr, DP: tl.constexpr, HAS_MEMO: tl.constexpr,
                    r: tl.constexpr, R: tl.constexpr, IS_JPEG: tl.constexpr, QMAX: tl.constexpr, KEPT: tl.constexpr,
                    XR: tl.constexpr, KR: tl.constexpr):
    """Program ``(bh, j)``: block ``first + j`` of head ``bh``, encoded and stored once complete (never past the
    capacity ``NB``); the memo gets its decoded rows, or the raw rows of the open block."""
    bh = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    b = bh // H
    h = bh % H
    length = tl.load(len_ptr)
    off = length % r
    first = length // r
    end = length + T
    i = tl.arange(0, XR)[:, None]
    d = tl.arange(0, DP)[None, :]
    w = j * r + i
    x = _work_rows(new_ptr, snb, snh, snt, tail_ptr, b, h, bh, w, d, off, T, r, D)
    x_prev = x
    if not IS_JPEG:
        x_prev = _work_rows(new_ptr, snb, snh, snt, tail_ptr, b, h, bh, w - 1, d, off, T, r, D)
    one = tl.zeros((1, 1), tl.int64)
    complete = (first + j + 1) * r + one <= end
    inside = first + j + one < NB  # never past the capacity: length > NB * r records the overflow
    rows = archive_block(x, x_prev, i, d, bh * NB + first + j, complete & inside, an_ptr, syn_ptr, data_ptr, scale_ptr,
                         index_ptr, D, r, R, IS_JPEG, QMAX, KEPT, XR, KR)
    if HAS_MEMO:
        is_open = (j + one == end // r - first) & (end % r + one != 0)
        rows = tl.where(complete, rows, x)
        tl.store(memo_ptr + bh * (NB * r * D) + ((first + j) * r + i) * D + d, rows.to(memo_ptr.dtype.element_ty),
                 mask=(complete | is_open) & inside & (i < r) & (d < D))


@triton.jit
def _tail_kernel(tail_ptr, len_ptr, new_ptr, snb, snh, snt, H, T, r: tl.constexpr, D: tl.constexpr,
                 DP: tl.constexpr, RP: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    length = tl.load(len_ptr)
    off = length % r
    last = (length + T) // r - length // r
    i = tl.arange(0, RP)[:, None]
    d = tl.arange(0, DP)[None, :]
    rows = _work_rows(new_ptr, snb, snh, snt, tail_ptr, bh // H, bh % H, bh, last * r + i, d, off, T, r, D)
    tl.debug_barrier()
    tl.store(tail_ptr + bh * (r * D) + i * D + d, rows.to(tail_ptr.dtype.element_ty), mask=(i < r) & (d < D))


def triton_append(data: torch.Tensor, scale: torch.Tensor, index: torch.Tensor, tail: torch.Tensor, length: torch.Tensor,
                  new: torch.Tensor, spec: list[int], memo: torch.Tensor | None = None) -> None:
    """Triton ``flashcodec::append`` (same contract as the reference): append ``new (B, H, T, D)`` in place.

    Mutates ``data/scale/index`` (archive), ``tail``, ``length`` and ``memo``; no host sync. State tensors must be
    contiguous (the cache allocates them so). Quantized codes may differ from the reference's by one step at
    fp32 rounding ties of the DCT sums; pruned png ties in delta magnitude keep the earlier position.
    """
    codec = check_append_args(data, scale, index, tail, length, new, spec, memo)
    b, h, t, d = new.shape
    r = codec.block_size
    check_triton_limits(codec, d)
    require_contiguous(data=data, scale=scale, index=index, tail=tail, memo=memo)
    if new.stride(3) != 1:
        new = new.contiguous()
    nb = data.shape[2]
    syn, an = codec_matrices(codec, new.device)
    dp = pow2(d, 16)
    strides = (new.stride(0), new.stride(1), new.stride(2))
    if b * h and t:
        _archive_kernel[(b * h, touched_blocks(t, r))](
            data, scale, index, tail, length, new, *strides, tail if memo is None else memo, an, syn, h, nb, t,
            D=d, DP=dp, HAS_MEMO=memo is not None, **BlockForm.of(codec).constexprs())
        _tail_kernel[(b * h,)](tail, length, new, *strides, h, t, r=r, D=d, DP=dp, RP=pow2(r))
    length.add_(t)
