"""A :class:`~flashcodec_fx.cache.CodecStream` as named tensors and a JSON-able description, and back (bitwise).

Exported: the filled archive groups of ``data`` / ``scale`` / ``zero`` / ``index`` (the unused capacity is not
stored), ``mean``, ``sink``, ``tail``, ``length``, ``start``, ``norm`` (the fields of ``ops/state.py``; a file without
``norm``, written before it existed, loads into a codec without ``normalize``), and the host side (codec spec, layout,
lengths, allocated groups, the stream dtype). The spec is the one the stream stores with (``raw=bfloat16`` for the
bf16 raw rows of an fp32 stream); a file written before raw rows could be narrower holds its raw rows in the stream
dtype and loads as it was stored (the stream keeps that spec until it is reset). A lossless png archive is exported
as the tokens it encodes (``tokens``, in the stream dtype) where encoding them gives back the archive bitwise
(checked at export): half the bytes of its fp32 deltas, and what the lossless coders code best; import encodes them
again. A stream holding its tokens raw (its raw prefix, :mod:`flashcodec_fx.raw_prefix`) is exported as those tokens
(``raw``) and the positions of its first call past the sinks: imported, it holds them raw again and converts at the
same length. A memo is not stored: an imported stream that keeps one decodes it again. Import validates everything
against the stream's codec before it changes anything.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import ops
from ..cache import CodecStream
from ..codecs import Codec, PNGCodec, codec_from_spec
from ..codecs.channel_norm import NORM_DTYPE
from ..ops.state import StreamState, check_state
from ..raw_prefix import prefix_length
from .lossless import dtype_name

ARCHIVE_FIELDS = StreamState._fields[:4]


class Prepared(NamedTuple):
    """A checked state from a file and the spec it was stored with (:func:`prepare_state`)."""

    state: StreamState
    spec: str


def export_stream(stream: CodecStream) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, description)`` of ``stream`` (an empty dict and ``{"initialized": False}`` before its first
    append). Tensors are the state's own (no copy); the description is plain JSON."""
    length = stream.get_seq_length()  # refreshes the host mirror after compiled appends
    described = {"spec": stream.spec, "layout": stream.layout, "initialized": stream.is_initialized}
    if not stream.is_initialized:
        return {}, described
    held = stream.held_raw()
    if held is not None:
        tokens, first_call = held
        described.update(archive="raw", length=length, first_call=None if first_call is None else list(first_call),
                         dtype=dtype_name(tokens.dtype), shape=list(tokens.shape[:2]) + [int(tokens.shape[3])])
        return {"raw": tokens}, described
    st, filled = stream.state, stream.filled_groups
    tensors = {name: getattr(st, name)[:, :, :filled] for name in ARCHIVE_FIELDS}
    tensors.update({name: getattr(st, name) for name in StreamState._fields[4:]})
    tokens = _archived_tokens(stream, filled)
    if tokens is not None:  # the archive as the tokens it rebuilds from, bitwise (lossless png: half the bytes)
        del tensors["data"]
        tensors["tokens"] = tokens
    described.update(archive="tokens" if tokens is not None else "state")
    described.update(length=length, start=int(stream._host_start), filled_groups=filled,
                     allocated_groups=int(st.data.shape[2]), dtype=dtype_name(stream.dtype),
                     shape=list(st.tail.shape[:2]) + [int(st.tail.shape[3])])
    return tensors, described


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _archived_tokens(stream: CodecStream, filled: int) -> torch.Tensor | None:
    """``(B, H, filled * G, D)``: the archived tokens in the stream dtype, when encoding them gives back this archive
    bitwise (lossless png: checked here), else None. Stored in place of the fp32 deltas, they take half the bytes."""
    codec, st = stream.codec, stream.state
    if not isinstance(codec, PNGCodec) or codec.pruned or filled == 0:
        return None
    tokens = stream.read()[:, :, codec.sinks: codec.sinks + filled * codec.group].contiguous()
    return tokens if _same_bits(codec.encode(tokens).data, st.data[:, :, :filled]) else None


def _check_description(name: str, stream: CodecStream, described: dict[str, Any]) -> Codec:
    """Check a file's stream against ``stream``; returns the codec it was stored with: the stream's own codec, as
    given or as a stream resolves it for its dtype (``Codec.resolved``: ``raw=bfloat16`` for an fp32 stream)."""
    spec, codec = described.get("spec"), stream.codec
    if spec not in (stream.spec, codec.spec, codec.resolved(torch.float32).spec):
        raise ValueError(f"{name}: the file holds codec {spec!r}, this cache layer has {stream.spec!r}")
    if described.get("layout") != stream.layout:
        raise ValueError(f"{name}: the file holds layout {described.get('layout')!r}, this cache has "
                         f"{stream.layout!r}")
    return codec_from_spec(spec)


def _held_raw(name: str, stream: CodecStream, tensors: dict[str, torch.Tensor], described: dict[str, Any],
              device: torch.device) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """``(tokens, first_call)`` of an export holding its tokens raw, on ``device``, checked against the stream."""
    tokens, first_call = tensors.get("raw"), described.get("first_call")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 4 or not tokens.is_floating_point():
        raise ValueError(f"{name}: tokens held raw need a floating (B, H, n, D) 'raw' tensor")
    n, sinks = tokens.shape[2], stream.codec.sinks
    stream.codec.check_head_dim(tokens.shape[3])
    until = 0 if stream.layout != "dynamic" else prefix_length(stream.codec, tokens.shape[3], tokens.dtype)
    if n != described.get("length") or n >= until:
        raise ValueError(f"{name}: {n} tokens held raw (header: {described.get('length')}); this stream holds "
                         f"fewer than {until} raw")
    if first_call is not None:
        if not (isinstance(first_call, list) and len(first_call) == 2 and all(type(p) is int for p in first_call)
                and first_call[0] <= min(n, sinks) and sinks < first_call[1] < until):
            raise ValueError(f"{name}: first_call must be [start, end] of a call past the {sinks} sinks, got "
                             f"{first_call!r}")
        first_call = (first_call[0], first_call[1])
    elif n > sinks:
        raise ValueError(f"{name}: {n} tokens held raw past the {sinks} sinks need their first_call")
    return tokens.to(device), first_call


def prepare_state(name: str, stream: CodecStream, tensors: dict[str, torch.Tensor], described: dict[str, Any],
                  device: torch.device) -> Prepared | tuple[torch.Tensor, tuple[int, int] | None] | None:
    """The state ``stream`` gets from an export (on ``device``, the archive at its saved capacity, or the static
    layout's) with the spec it was stored with, checked against the stream's codec; the stream is not touched. None
    for an uninitialized export; ``(tokens, first_call)`` for one holding its tokens raw (:meth:`CodecStream.held_raw`)."""
    codec = _check_description(name, stream, described)
    if not described["initialized"]:
        return None
    if described.get("archive") == "raw":
        return _held_raw(name, stream, tensors, described, device)
    filled = int(described["filled_groups"])
    if described.get("archive") == "tokens":
        if "tokens" not in tensors or not isinstance(codec, PNGCodec):
            raise ValueError(f"{name}: an archive stored as tokens needs a 'tokens' tensor and a png codec")
        tensors = {**tensors, "data": codec.encode(tensors["tokens"].to(device)).data}
    if "norm" not in tensors and not codec.normalize and "tail" in tensors:  # written before the field existed
        tensors = {**tensors, "norm": torch.zeros(*tensors["tail"].shape[:2], 0, dtype=NORM_DTYPE)}
    missing = sorted(set(StreamState._fields) - set(tensors))
    if missing:
        raise ValueError(f"{name}: tensors {missing} missing from the file")
    groups = stream._groups_for(stream.positions) if stream.layout == "static" else int(described["allocated_groups"])
    if not 0 <= filled <= groups:
        raise ValueError(f"{name}: {filled} filled archive groups do not fit the {groups} this stream allocates")
    archive = []
    for field in ARCHIVE_FIELDS:
        saved = tensors[field]
        if saved.dim() < 3 or saved.shape[2] != filled:
            raise ValueError(f"{name}.{field}: shape {tuple(saved.shape)} does not hold {filled} archive groups")
        full = torch.zeros((*saved.shape[:2], groups, *saved.shape[3:]), dtype=saved.dtype, device=device)
        full[:, :, :filled].copy_(saved)
        archive.append(full)
    state = StreamState(*archive, *(tensors[f].to(device) for f in StreamState._fields[4:]))
    state = check_state(name, codec, state)
    length, start = int(described["length"]), int(described["start"])
    if int(state.length) != length or int(state.start) != start:
        raise ValueError(f"{name}: the device lengths ({int(state.length)}, {int(state.start)}) disagree with the "
                         f"header ({length}, {start})")
    if stream.layout == "static" and length > stream.max_length:
        raise ValueError(f"{name}: {length} tokens do not fit max_length={stream.max_length}")
    return Prepared(state, codec.spec)


def install_state(stream: CodecStream, prepared: Prepared | tuple[torch.Tensor, tuple[int, int] | None] | None) -> None:
    """Put a :func:`prepare_state` result into ``stream`` (host mirrors from the device lengths; the stream stores with
    the file's spec from now on; a memo decoded again when the stream keeps one)."""
    stream.reset()
    if prepared is None:
        return
    if not isinstance(prepared, Prepared):
        stream.hold_raw(*prepared)
        return
    state = prepared.state
    ops.warm(stream.codec, state.tail.shape[3], state.tail.device)
    stream.spec = prepared.spec
    stream.state = state
    stream._host_length, stream._host_start, stream._stale = int(state.length), int(state.start), False
    stream._mark_static_shapes()
    if stream.memoize:
        stream.memo = torch.ops.flashcodec.read(list(state), stream.spec)
