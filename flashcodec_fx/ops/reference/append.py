"""`flashcodec::append`: new tokens into the stream; groups that complete and leave the window are archived in place.

Every position and decision comes from the 0-dim device length and the input shapes, so one step is the same
launch sequence every time (no host sync, capturable in a CUDA graph, compileable). The reference below is the spec:

1. tokens at positions below ``sinks`` are written to the sink rows;
2. the first append that reaches past the sinks sets the per-channel mean (``center``): the mean of its non-sink tokens;
3. the tail and the non-sink new tokens form a work buffer (row ``i`` = position ``start + i``); its first
   ``completable_groups(T, G)`` groups are encoded, and the ones :func:`~flashcodec_fx.ops.state.advance` moves out of
   the tail (the window stays raw) are written to their archive slots;
4. the rows after the newly archived groups become the tail (zeros past the new length); ``start`` moves past the
   archived groups; ``length += T``.

``memo`` (optional, ``(B, H, capacity, D)`` stream dtype): the view attention reads, kept up to date: new tokens are
written raw at their positions, newly archived groups as their decoded values.
"""

from __future__ import annotations

import torch

from ...codecs import Codec
from ..state import StreamState, advance, capacity, check_state, spec_codec


def completable_groups(new_tokens: int, group: int) -> int:
    """Upper bound on the archive groups that ``new_tokens`` appended at any length can complete: ``ceil(T / G)``."""
    return -(-new_tokens // group)


def check_append_args(state, new: torch.Tensor, spec: str, memo: torch.Tensor | None) -> tuple[Codec, StreamState]:
    """Validate ``flashcodec::append`` arguments (every kernel's launcher uses this); returns the codec and state."""
    codec = spec_codec("spec", spec)
    state = check_state("state", codec, state)
    b, h, _, d = state.tail.shape
    if new.dim() != 4 or (new.shape[0], new.shape[1], new.shape[3]) != (b, h, d) or new.dtype != state.tail.dtype:
        raise ValueError(f"new must be (B, H, T, D) = ({b}, {h}, T, {d}) in {state.tail.dtype}, got {new.dtype} "
                         f"{tuple(new.shape)}")
    want = (b, h, capacity(codec, state), d)
    if memo is not None and (tuple(memo.shape) != want or memo.dtype != state.tail.dtype):
        raise ValueError(f"memo must be {state.tail.dtype} of shape {want}, got {memo.dtype} {tuple(memo.shape)}")
    return codec, state


def _write_sinks(codec: Codec, st: StreamState, new: torch.Tensor) -> None:
    """Sink row ``s`` takes new token ``s - length`` when that token exists."""
    t = new.shape[2]
    token = torch.arange(codec.sinks, device=new.device) - st.length
    fresh = new.index_select(2, token.clamp(0, t - 1))
    st.sink.copy_(torch.where(((token >= 0) & (token < t)).view(1, 1, -1, 1), fresh, st.sink))


def _set_mean(st: StreamState, codec: Codec, new: torch.Tensor) -> None:
    """The first append reaching past the sinks sets the mean of its non-sink tokens."""
    t = new.shape[2]
    counted = ((st.length + torch.arange(t, device=new.device)) >= codec.sinks).float()
    mean = (new.float() * counted.view(1, 1, -1, 1)).sum(2) / counted.sum().clamp_min(1)
    first = (st.length <= codec.sinks) & (st.length + t > codec.sinks)
    st.mean.copy_(torch.where(first, mean, st.mean))


def write_prefix(store: torch.Tensor, first: torch.Tensor, values: torch.Tensor, write: torch.Tensor) -> None:
    """``store[:, :, first + j] = values[:, :, j]`` where ``write[j]``, in place, every other slot unchanged.

    ``store (B, H, N, ...)``, ``values (B, H, n, ...)``, ``write (n,)`` bool, a prefix (True then False) that is False
    wherever ``first + j >= N``. One ``index_copy_`` of fixed shape: unwritten entries rewrite slot ``home`` with the
    value it ends up with (``home = first``, clamped), so no slot gets two different values."""
    n = values.shape[2]
    if store.shape[2] == 0 or n == 0:
        return
    home = first.clamp(max=store.shape[2] - 1)
    slots = torch.where(write, first + torch.arange(n, device=first.device), home)
    keep = torch.where(write[0], values[:, :, 0], store.index_select(2, home[None])[:, :, 0])
    pick = write.view(1, 1, n, *[1] * (values.dim() - 3))
    store.index_copy_(2, slots, torch.where(pick, values, keep.unsqueeze(2)))


def _write_groups(codec: Codec, st: StreamState, work: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                  memo: torch.Tensor | None) -> None:
    """Encode the first groups of ``work`` (rows from position ``start``) and archive those complete by ``end``
    that fit in the capacity (an overflowing append never writes past it)."""
    b, h, _, d = work.shape
    g, ng = codec.group, st.data.shape[2]
    n = completable_groups(work.shape[2] - codec.tail_capacity, g)
    enc = codec.encode(work[:, :, : n * g], st.mean)
    first = torch.div(start - codec.sinks, g, rounding_mode="floor")
    k = torch.arange(n, device=work.device)
    write = (start + (k + 1) * g <= end) & (first + k < ng)
    for store, fresh in zip(st[:4], enc, strict=True):
        write_prefix(store, first, fresh, write)
    if memo is not None:
        rows = codec.decode(enc, memo.dtype, st.mean).view(b, h, n, g, d)
        write_prefix(memo[:, :, codec.sinks:].view(b, h, ng, g, d), first, rows, write)

def append_reference(state: list[torch.Tensor], new: torch.Tensor, spec: str, memo: torch.Tensor | None = None) -> None:
    """Append ``new (B, H, T, D)`` to a stream (``state`` as in ``ops/state.py``, mutated in place).

    ``memo`` as in the module docstring. Overflow (``length + T`` past the capacity, which the cache checks before
    eager calls but a compiled step cannot): nothing is written past the capacity; ``length`` still advances, the
    device-side record that tokens were dropped (``CodecStream`` raises on it when it next reads the length).
    """
    codec, st = check_append_args(state, new, spec, memo)
    t, dev = new.shape[2], new.device
    end = st.length + t
    if codec.sinks:
        _write_sinks(codec, st, new)
    if codec.center:
        _set_mean(st, codec, new)
    start = st.start.clone()
    rows = torch.arange(codec.tail_capacity + t, device=dev)
    token = start + rows - st.length
    is_new = (token >= 0) & (token < t)
    old = torch.cat([st.tail, st.tail.new_zeros(*st.tail.shape[:2], t, st.tail.shape[3])], dim=2)
    work = torch.where(is_new.view(1, 1, -1, 1), new.index_select(2, token.clamp(0, t - 1)), old)
    if memo is not None:
        position = st.length + torch.arange(t, device=dev)
        write_prefix(memo, st.length, new, position < memo.shape[2])
    new_start = advance(codec, start, end)
    _write_groups(codec, st, work, start, new_start, memo)
    shift = new_start - start + torch.arange(codec.tail_capacity, device=dev)
    tail = work.index_select(2, shift.clamp(max=work.shape[2] - 1))
    st.tail.copy_(torch.where((new_start + torch.arange(codec.tail_capacity, device=dev) < end).view(1, 1, -1, 1),
                              tail, torch.zeros((), dtype=tail.dtype, device=dev)))
    st.start.copy_(new_start)
    st.length.add_(t)


@torch.library.custom_op("flashcodec::append", mutates_args=("state", "memo"))
def append(state: list[torch.Tensor], new: torch.Tensor, spec: str, memo: torch.Tensor | None = None) -> None:
    """The ``flashcodec::append`` op; its default kernel is :func:`append_reference` (the spec)."""
    append_reference(state, new, spec, memo)


@append.register_fake
def _(state, new, spec, memo=None):
    return None
