"""`flashcodec::append`: new tokens into the raw tail; completed blocks archived in place, on the device.

Lengths live in a 0-dim int64 device tensor and every shape depends only on input shapes, so one step
is the same launch sequence every time (no host sync, capturable in a CUDA graph, compileable).
"""

from __future__ import annotations

import torch

from ..codecs import Encoded
from ._validate import check_append_args


def touched_blocks(new_tokens: int, block_size: int) -> int:
    """Upper bound on the blocks that ``new_tokens`` appended at any offset can touch."""
    return new_tokens // block_size + 2


@torch.library.custom_op("flashcodec::append", mutates_args=("data", "scale", "index", "tail", "length", "memo"))
def append(data: torch.Tensor, scale: torch.Tensor, index: torch.Tensor, tail: torch.Tensor, length: torch.Tensor,
           new: torch.Tensor, spec: list[int], memo: torch.Tensor | None = None) -> None:
    """Append ``new (B, H, T, D)`` to a stream whose first ``length`` tokens are stored.

    State (mutated): ``data/scale/index`` the archive ``(B, H, NB, ...)``, ``tail (B, H, r, D)`` raw tokens of
    the open block, ``length`` 0-dim int64. ``memo`` (optional, ``(B, H, NB * r, D)`` stream dtype) receives
    the decoded rows of each newly archived block and the raw rows of the open block, so reads never
    re-decode history. The caller guarantees ``length + T <= NB * r``.
    """
    codec = check_append_args(data, scale, index, tail, length, new, spec, memo)
    b, h, t, d = new.shape
    r = codec.block_size
    nblk = touched_blocks(t, r)
    dev = new.device
    first = torch.div(length, r, rounding_mode="floor")
    work = new.new_zeros(b, h, nblk * r, d)
    work[:, :, :r] = tail
    work.index_copy_(2, length % r + torch.arange(t, device=dev), new)
    enc = codec.encode(work)

    j = torch.arange(nblk, device=dev)
    end = length + t
    complete = (first + j + 1) * r <= end
    slots = torch.where(complete, first + j, first)
    for store, fresh in zip((data, scale, index), enc, strict=True):
        keep = torch.where(complete[0], fresh[:, :, 0], store.index_select(2, first[None])[:, :, 0])
        pick = complete.view(1, 1, nblk, *[1] * (fresh.dim() - 3))
        store.index_copy_(2, slots, torch.where(pick, fresh, keep.unsqueeze(2)))

    last = torch.div(end, r, rounding_mode="floor") - first
    if memo is not None:
        rows = codec.decode(Encoded(*enc), tail.dtype).view(b, h, nblk, r, d)
        raw = work.view(b, h, nblk, r, d)
        open_block = (j == last) & (end % r != 0)
        value = torch.where(complete.view(1, 1, nblk, 1, 1), rows, raw)
        first_value = torch.where(complete[0] | open_block[0], value[:, :, 0], memo.view(b, h, -1, r, d)
                                  .index_select(2, first[None])[:, :, 0])
        use = (complete | open_block).view(1, 1, nblk, 1, 1)
        value = torch.where(use, value, first_value.unsqueeze(2))
        mslots = torch.where(complete | open_block, first + j, first)
        memo.view(b, h, -1, r, d).index_copy_(2, mslots, value)
    tail.copy_(work.index_select(2, last * r + torch.arange(r, device=dev)))
    length.add_(t)


@append.register_fake
def _(data, scale, index, tail, length, new, spec, memo=None):
    return None
