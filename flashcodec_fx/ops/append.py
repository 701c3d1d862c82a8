"""`flashcodec::append`: new tokens into the raw tail; completed blocks archived in place, on the device.

Lengths live in a 0-dim int64 device tensor and every shape depends only on input shapes, so one step
is the same launch sequence every time (no host sync, capturable in a CUDA graph, compileable).
"""

from __future__ import annotations

import torch

from ..codecs import Encoded
from ._validate import check_append_args


def touched_blocks(new_tokens: int, block_size: int) -> int:
    """Most blocks that ``new_tokens >= 1`` appended at any offset ``0 <= off < r`` can touch: positions
    ``off .. off + T - 1`` span ``(off + T - 1) // r + 1`` blocks, largest at ``off = r - 1``."""
    return (new_tokens + block_size - 2) // block_size + 1


def _write_blocks(store: torch.Tensor, blocks: torch.Tensor, write: torch.Tensor, first: torch.Tensor) -> None:
    """``store[:, :, first + j] = blocks[:, :, j]`` where ``write[j]``, in place; every other block is unchanged.

    ``store (B, H, NB, ...)``, ``blocks (B, H, nblk, ...)``, ``write (nblk,)`` bool (false wherever
    ``first + j >= NB``). One ``index_copy_`` of fixed shape: unwritten entries rewrite block ``home`` with its
    own value (``home = first`` when block 0 is written, so no slot gets two different values)."""
    if store.shape[2] == 0:
        return
    nblk = blocks.shape[2]
    home = first.clamp(max=store.shape[2] - 1)
    slots = torch.where(write, first + torch.arange(nblk, device=first.device), home)
    keep = torch.where(write[0], blocks[:, :, 0], store.index_select(2, home[None])[:, :, 0])
    pick = write.view(1, 1, nblk, *[1] * (blocks.dim() - 3))
    store.index_copy_(2, slots, torch.where(pick, blocks, keep.unsqueeze(2)))


@torch.library.custom_op("flashcodec::append", mutates_args=("data", "scale", "index", "tail", "length", "memo"))
def append(data: torch.Tensor, scale: torch.Tensor, index: torch.Tensor, tail: torch.Tensor, length: torch.Tensor,
           new: torch.Tensor, spec: list[int], memo: torch.Tensor | None = None) -> None:
    """Append ``new (B, H, T, D)`` to a stream whose first ``length`` tokens are stored.

    State (mutated): ``data/scale/index`` the archive ``(B, H, NB, ...)``, ``tail (B, H, r, D)`` raw tokens of
    the open block, ``length`` 0-dim int64. ``memo`` (optional, ``(B, H, NB * r, D)`` stream dtype) receives
    the decoded rows of each newly archived block and the raw rows of the open block, so reads never
    re-decode history.

    Overflow: blocks past the capacity ``NB`` are never written (archive and memo); the tail and ``length``
    still advance, so ``length > NB * r`` after the call is the device-side record that tokens were dropped
    (``CodecStream`` checks it on the host, outside the decode step).
    """
    codec = check_append_args(data, scale, index, tail, length, new, spec, memo)
    b, h, t, d = new.shape
    r = codec.block_size
    nblk = touched_blocks(t, r)
    dev = new.device
    capacity = data.shape[2]
    first = torch.div(length, r, rounding_mode="floor")
    work = new.new_zeros(b, h, (nblk + 1) * r, d)  # one zero block past the touched ones: the new tail when T ends one
    work[:, :, :r] = tail
    work.index_copy_(2, length % r + torch.arange(t, device=dev), new)
    enc = codec.encode(work[:, :, : nblk * r])

    j = torch.arange(nblk, device=dev)
    end = length + t
    complete = (first + j + 1) * r <= end
    inside = first + j < capacity  # nothing is written past the capacity: see the docstring (overflow)
    for store, fresh in zip((data, scale, index), enc, strict=True):
        _write_blocks(store, fresh, complete & inside, first)

    last = torch.div(end, r, rounding_mode="floor") - first
    if memo is not None:
        rows = codec.decode(Encoded(*enc), tail.dtype).view(b, h, nblk, r, d)
        raw = work[:, :, : nblk * r].view(b, h, nblk, r, d)
        open_block = (j == last) & (end % r != 0)
        value = torch.where(complete.view(1, 1, nblk, 1, 1), rows, raw)
        _write_blocks(memo.view(b, h, capacity, r, d), value, (complete | open_block) & inside, first)
    tail.copy_(work.index_select(2, last * r + torch.arange(r, device=dev)))
    length.add_(t)


@append.register_fake
def _(data, scale, index, tail, length, new, spec, memo=None):
    return None
