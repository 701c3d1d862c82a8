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

The tokens enter in the raw rows' dtype (``ops/state.py``): an fp32 stream under a ``raw=bfloat16`` spec rounds them to
bf16 first (:func:`raw_tokens`), so everything it stores and encodes is the rounded token, however the tokens are
split into calls. A normalized stream (``normalize=True``) then sets its per-channel exponents (the same first append
as the mean) and appends the tokens divided by them (``normalize.py``).

``memo`` (optional, ``(B, H, capacity, D)`` stream dtype): the view attention reads, kept up to date after the append
(:func:`write_memo`): new tokens written as stored (in the raw rows' dtype) at their positions, newly archived groups as
their decoded values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...codecs import Codec, Encoded
from ..state import StreamState, advance, capacity, check_state, spec_codec, stream_dtype
from .normalize import from_stored, set_norm, to_stored


def completable_groups(new_tokens: int, group: int) -> int:
    """Upper bound on the archive groups that ``new_tokens`` appended at any length can complete: ``ceil(T / G)``."""
    return -(-new_tokens // group)


def check_append_args(state, new: torch.Tensor, spec: str, memo: torch.Tensor | None) -> tuple[Codec, StreamState]:
    """Validate ``flashcodec::append`` arguments (every kernel's launcher uses this); returns the codec and state."""
    codec = spec_codec("spec", spec)
    state = check_state("state", codec, state)
    b, h, _, d = state.tail.shape
    dtype = stream_dtype(codec, state.tail)
    if new.dim() != 4 or (new.shape[0], new.shape[1], new.shape[3]) != (b, h, d) or new.dtype != dtype:
        raise ValueError(f"new must be (B, H, T, D) = ({b}, {h}, T, {d}) in {dtype}, got {new.dtype} "
                         f"{tuple(new.shape)}")
    want = (b, h, capacity(codec, state), d)
    if memo is not None and (tuple(memo.shape) != want or memo.dtype != dtype):
        raise ValueError(f"memo must be {dtype} of shape {want}, got {memo.dtype} {tuple(memo.shape)}")
    return codec, state


def raw_tokens(st: StreamState, new: torch.Tensor) -> torch.Tensor:
    """``new`` as the stream takes it in: in its raw rows' dtype (rounded to bf16 under ``raw=bfloat16``; else
    ``new`` itself)."""
    return new.to(st.tail.dtype)


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


def _archived_groups(codec: Codec, st: StreamState, new_tokens: int, start: torch.Tensor,
                     end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, write)``: an append of ``new_tokens`` to an archive ending at ``start`` encodes
    ``completable_groups(T, G)`` groups from slot ``first``; ``write (n,)`` marks those complete by ``end`` that fit
    in the capacity (an overflowing append never writes past it)."""
    g, ng = codec.group, st.data.shape[2]
    first = torch.div(start - codec.sinks, g, rounding_mode="floor")
    k = torch.arange(completable_groups(new_tokens, g), device=st.tail.device)
    return first, (start + (k + 1) * g <= end) & (first + k < ng)


def _write_groups(codec: Codec, st: StreamState, work: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> None:
    """Encode the first groups of ``work`` (rows from position ``start``) and archive those that
    :func:`_archived_groups` writes."""
    first, write = _archived_groups(codec, st, work.shape[2] - codec.tail_capacity, start, end)
    enc = codec.encode(work[:, :, : write.shape[0] * codec.group], st.mean)
    for store, fresh in zip(st.archive(), enc, strict=True):
        write_prefix(store, first, fresh, write)


def write_memo(codec: Codec, st: StreamState, memo: torch.Tensor, new: torch.Tensor, length: torch.Tensor,
               start: torch.Tensor) -> None:
    """After appending ``new (B, H, T, D)`` (as taken in: :func:`raw_tokens`) to a stream that held ``length`` tokens
    and an archive ending at ``start`` (0-dim device tensors, before the append): write the new tokens into ``memo``
    at their positions, then the groups the append archived, decoded from the archive (times the channel factors
    when normalized)."""
    b, h, _, d = st.tail.shape
    g, ng, t = codec.group, st.data.shape[2], new.shape[2]
    write_prefix(memo, length, new.to(memo.dtype), length + torch.arange(t, device=new.device) < memo.shape[2])
    if ng == 0:
        return
    first, write = _archived_groups(codec, st, t, start, st.start)
    slots = (first + torch.arange(write.shape[0], device=new.device)).clamp(0, ng - 1)
    enc = Encoded(*(field.index_select(2, slots) for field in st.archive()))
    rows = from_stored(codec, st, codec.decode(enc, memo.dtype, st.mean)).view(b, h, write.shape[0], g, d)
    write_prefix(memo[:, :, codec.sinks:].view(b, h, ng, g, d), first, rows, write)


def append_stored(codec: Codec, st: StreamState, new: torch.Tensor, memo: torch.Tensor | None,
                  kernel: Callable[[torch.Tensor, torch.Tensor | None], None], host: bool = False) -> None:
    """Append ``new`` with ``kernel(stored_new, memo)``, a fast append over the stored domain whose new tokens, raw
    rows and memo share one dtype: ``new`` enters in the raw rows' dtype (:func:`raw_tokens`); a normalized stream
    sets its channel exponents and appends ``new / n`` (``normalize.py``); where the kernel cannot keep the memo
    (normalized, or a memo in another dtype than the raw rows: ``raw=bfloat16``), it runs without it and
    :func:`write_memo` follows. ``host``: the state lives in host memory (CPU), where the length is read without a
    device sync: only the append that sets the exponents measures them, and a stream whose exponents are all zero
    appends its tokens as given."""
    new = raw_tokens(st, new)
    if not codec.normalize and (memo is None or memo.dtype == new.dtype):
        kernel(new, memo)
        return
    length, start = st.length.clone(), st.start.clone()
    if codec.normalize and (not host or int(length) <= codec.sinks < int(length) + new.shape[2]):  # (measures())
        set_norm(codec, st, new)
    kernel(to_stored(codec, st, new, host), None)
    if memo is not None:
        write_memo(codec, st, memo, new, length, start)


def append_reference(state: list[torch.Tensor], new: torch.Tensor, spec: str, memo: torch.Tensor | None = None) -> None:
    """Append ``new (B, H, T, D)`` to a stream (``state`` as in ``ops/state.py``, mutated in place).

    ``memo`` as in the module docstring. Overflow (``length + T`` past the capacity, which the cache checks before
    eager calls but a compiled step cannot): nothing is written past the capacity; ``length`` still advances, the
    device-side record that tokens were dropped (``CodecStream`` raises on it when it next reads the length).
    """
    codec, st = check_append_args(state, new, spec, memo)
    new = raw_tokens(st, new)
    t, dev = new.shape[2], new.device
    given, length, start = new, st.length.clone(), st.start.clone()
    end = length + t
    if codec.normalize:
        set_norm(codec, st, new)
        new = to_stored(codec, st, new)
    if codec.sinks:
        _write_sinks(codec, st, new)
    if codec.center:
        _set_mean(st, codec, new)
    rows = torch.arange(codec.tail_capacity + t, device=dev)
    token = start + rows - st.length
    is_new = (token >= 0) & (token < t)
    old = torch.cat([st.tail, st.tail.new_zeros(*st.tail.shape[:2], t, st.tail.shape[3])], dim=2)
    work = torch.where(is_new.view(1, 1, -1, 1), new.index_select(2, token.clamp(0, t - 1)), old)
    new_start = advance(codec, start, end)
    _write_groups(codec, st, work, start, new_start)
    shift = new_start - start + torch.arange(codec.tail_capacity, device=dev)
    tail = work.index_select(2, shift.clamp(max=work.shape[2] - 1))
    st.tail.copy_(torch.where((new_start + torch.arange(codec.tail_capacity, device=dev) < end).view(1, 1, -1, 1),
                              tail, torch.zeros((), dtype=tail.dtype, device=dev)))
    st.start.copy_(new_start)
    st.length.add_(t)
    if memo is not None:
        write_memo(codec, st, memo, given, length, start)


@torch.library.custom_op("flashcodec::append", mutates_args=("state", "memo"))
def append(state: list[torch.Tensor], new: torch.Tensor, spec: str, memo: torch.Tensor | None) -> None:
    """The ``flashcodec::append`` op; its default kernel is :func:`append_reference` (the spec). ``memo`` (None:
    no memo) has no default in the schema: torch 2.11's version bump of mutated arguments indexes the call's own
    arguments, from which the dispatcher drops a trailing argument equal to its default."""
    append_reference(state, new, spec, memo)


@append.register_fake
def _(state, new, spec, memo):
    return None
