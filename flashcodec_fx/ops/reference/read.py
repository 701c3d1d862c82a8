"""`flashcodec::read`: the view attention reads (sinks raw, archive decoded, tail raw, zeros past the length; a
normalized stream's rows times its channel factors).

This is the full-precision view that the compile pass removes: attention over it equals
``flashcodec::codec_attention`` over the stored state. With ``new`` (the ``T`` tokens of the current call), the last
``T`` positions hold those exact tokens (what the call's own queries read), whatever the archive stored for them.
The view is in the stream dtype (``ops/state.py``: fp32 under ``raw=bfloat16``, whose bf16 raw rows it widens).
"""

from __future__ import annotations

import torch

from ...codecs import Codec
from ..state import StreamState, capacity, check_state, spec_codec, stream_dtype
from .normalize import from_stored


def check_new(name: str, codec: Codec, state: StreamState, new: torch.Tensor | None) -> None:
    """``new``: None, or ``(B, H, T, D)`` tokens of the stream's dtype (:func:`~flashcodec_fx.ops.state.stream_dtype`)."""
    if new is None:
        return
    b, h, _, d = state.tail.shape
    dtype = stream_dtype(codec, state.tail)
    if new.dim() != 4 or (new.shape[0], new.shape[1], new.shape[3]) != (b, h, d) or new.dtype != dtype:
        raise ValueError(f"{name} must be (B, H, T, D) = ({b}, {h}, T, {d}) in {dtype}, got {new.dtype} "
                         f"{tuple(new.shape)}")


def check_read_args(state: list[torch.Tensor], spec: str, new: torch.Tensor | None) -> tuple[Codec, StreamState]:
    """Validate ``flashcodec::read`` arguments (every kernel's launcher uses this); returns the codec and state."""
    codec = spec_codec("spec", spec)
    st = check_state("state", codec, state)
    check_new("new", codec, st, new)
    return codec, st


def read_reference(state: list[torch.Tensor], spec: str, new: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, H, capacity, D)`` in the stream dtype: position ``p`` holds what attention reads there."""
    codec, st = check_read_args(state, spec, new)
    dev, length, dtype = st.tail.device, st.length, stream_dtype(codec, st.tail)
    archive = codec.decode(st.archive(), dtype, st.mean)
    view = torch.cat([st.sink.to(dtype), archive], dim=2)
    pos = torch.arange(capacity(codec, st), device=dev)
    start = st.start
    in_tail = (pos >= start) & (pos < length)
    tail_rows = st.tail.index_select(2, (pos - start).clamp(0, codec.tail_capacity - 1)).to(dtype)
    view = from_stored(codec, st, torch.where(in_tail[:, None], tail_rows, view))
    if new is not None:
        view = overlay_new(view, new, length)
    return torch.where((pos < length)[:, None], view, torch.zeros((), dtype=view.dtype, device=dev))


def overlay_new(view: torch.Tensor, new: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """``view (B, H, L, D)`` with positions ``length - T .. length - 1`` holding ``new (B, H, T, D)`` exactly (a new
    tensor; ``length`` a 0-dim device tensor: no host sync)."""
    t = new.shape[2]
    token = torch.arange(view.shape[2], device=view.device) - (length - t)
    fresh = new.index_select(2, token.clamp(0, t - 1))
    return torch.where(((token >= 0) & (token < t))[:, None], fresh, view)


@torch.library.custom_op("flashcodec::read", mutates_args=())
def read(state: list[torch.Tensor], spec: str, new: torch.Tensor | None = None) -> torch.Tensor:
    """The ``flashcodec::read`` op; its default kernel is :func:`read_reference` (the spec)."""
    return read_reference(state, spec, new)


@read.register_fake
def _(state, spec, new=None):
    codec = spec_codec("spec", spec)
    tail = StreamState(*state).tail
    b, h, _, d = tail.shape
    return tail.new_empty(b, h, capacity(codec, state), d, dtype=stream_dtype(codec, tail))
