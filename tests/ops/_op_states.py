"""Stream states built through the reference ops, shared by the op tests (no engine: the ops' own contract)."""

from __future__ import annotations

import random

import torch

from flashcodec_fx.codecs import Codec
from flashcodec_fx.ops import StreamState, empty_state
from flashcodec_fx.ops.state import stream_dtype

ops = torch.ops.flashcodec


def groups_for(codec: Codec, positions: int) -> int:
    """Archive groups a state needs to hold ``positions`` positions (capacity ``sinks + NG * G >= positions``)."""
    return -(-max(0, positions - codec.sinks) // codec.group)


def uncropped_start(codec: Codec, length: int) -> int:
    """Where the archive ends after ``length`` tokens appended to a fresh stream (no crop): after the sinks, every
    group that is complete and leaves at least the window raw."""
    return codec.sinks + max(0, length - codec.sinks - codec.window) // codec.group * codec.group


def new_state(codec: Codec, like: torch.Tensor, positions: int) -> StreamState:
    """An empty state for streams shaped like ``like (B, H, *, D)`` holding at least ``positions`` positions (the ops
    take it as their ``Tensor[]``)."""
    b, h, _, d = like.shape
    return empty_state(codec, b, h, groups_for(codec, positions), d, like.dtype, like.device)


def new_memo(codec: Codec, state: StreamState) -> torch.Tensor:
    """A zero memo (the view, in the stream dtype) for ``state``."""
    b, h, _, d = state.tail.shape
    return state.tail.new_zeros(b, h, codec.sinks + state.data.shape[2] * codec.group, d,
                                dtype=stream_dtype(codec, state.tail))


def fill(codec: Codec, x: torch.Tensor, sizes, positions: int | None = None, memo: bool = False):
    """Append ``x (B, H, L, D)`` chunk by chunk (``sizes`` summing to ``L``); returns ``(state, memo or None)``."""
    assert sum(sizes) == x.shape[2]
    state = new_state(codec, x, x.shape[2] if positions is None else positions)
    buf = new_memo(codec, state) if memo else None
    at = 0
    for n in sizes:
        ops.append(state, x[:, :, at: at + n], codec.spec, buf)
        at += n
    return state, buf


def chunks(total: int, seed: int, largest: int = 19, first: int | None = None) -> list[int]:
    """Random chunk sizes 1..``largest`` summing to ``total`` (``first``: a fixed first chunk, the prompt)."""
    rng = random.Random(seed)
    sizes = [] if first is None else [first]
    while sum(sizes) < total:
        sizes.append(min(rng.randint(1, largest), total - sum(sizes)))
    return sizes


def expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``(B, H_kv, L, D)`` -> ``(B, H_kv * groups, L, D)``: query head ``i`` reads kv head ``i // groups``."""
    return t.repeat_interleave(groups, dim=1)
