"""The stored state of one stream ``(B, H, S, D)``, as the ``torch.ops.flashcodec`` ops take it (a ``Tensor[]``).

=========  ===========================================  ===========================================================
field      shape                                        holds
=========  ===========================================  ===========================================================
data       ``(B, H, NG, *group)``                       archive groups (``codecs.Encoded.data``)
scale      ``(B, H, NG, *group)``                       fp16 scales (empty when unquantized)
zero       ``(B, H, NG, *group)``                       fp16 zero points (empty unless ``uniform`` levels)
index      ``(B, H, NG, *group)``                       uint8 kept-delta positions (pruned png; else empty)
mean       ``(B, H, D)`` fp32, or ``(B, H, 0)``         per-channel center (codecs with ``center=True``)
sink       ``(B, H, sinks, D)`` raw dtype               raw first tokens
tail       ``(B, H, window + G, D)`` raw dtype          raw tokens between the archive and the length
length     ``()`` int64                                 tokens stored, on the device
start      ``()`` int64                                 end of the archive: the position of tail row 0 (>= sinks)
norm       ``(B, H, D)`` uint8, or ``(B, H, 0)``          per-channel exponents ``e``: every stored row is the token
                                                        divided by ``2 ** e`` (codecs with ``normalize=True``)
=========  ===========================================  ===========================================================

The *raw dtype* is the codec's :meth:`~flashcodec_fx.codecs.Codec.raw_rows_dtype` of the stream dtype: the stream
dtype itself, or bf16 under a ``raw=bfloat16`` spec, whose stream is fp32 (:func:`stream_dtype`): its tokens enter
rounded to bf16 (``ops/reference/append.py``), while the queries, the call's own tokens, the memo, the view and
attention's output stay fp32.

``norm`` comes last so that the fields the kernels address keep their places: the kernels see only the stored
domain (tokens divided by ``2 ** e``); the ops' launchers scale what enters and leaves it
(``ops/reference/normalize.py``).

Positions (all on the device, never read on the host): sinks hold ``0 .. sinks - 1``; archive group ``n`` holds
``sinks + n * G ..``; the archive holds ``sinks .. start - 1``; tail row ``i`` holds position ``start + i`` for
``start + i < length``. An append archives the oldest tail group while the tail holds at least ``window + G`` tokens
(:func:`advance`), so the tail keeps the window raw; a crop that stays inside the tail moves only ``length`` (an exact
rollback). A stream's *capacity* in positions is ``sinks + NG * G``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..codecs import Codec, Encoded, JPEGCodec, PNGCodec, codec_from_spec
from ..codecs.channel_norm import NORM_DTYPE

KERNEL_CODECS = (JPEGCodec, PNGCodec)  # what the fast kernels (C++, Triton) know; other codecs run the reference
KERNEL_HEAD_DIM_MULTIPLE = 8  # the fast kernels pack and load channels 8 at a time


class StreamState(NamedTuple):
    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    index: torch.Tensor
    mean: torch.Tensor
    sink: torch.Tensor
    tail: torch.Tensor
    length: torch.Tensor
    start: torch.Tensor
    norm: torch.Tensor

    def archive(self) -> Encoded:
        """The archive's fields (``data``, ``scale``, ``zero``, ``index``) as the codec's :class:`Encoded`."""
        return Encoded(*(getattr(self, name) for name in Encoded._fields))


BATCHED_FIELDS = tuple(f for f in StreamState._fields if f not in ("length", "start"))  # (B, H, ...) tensors

def stream_dtype(codec: Codec, tail: torch.Tensor) -> torch.dtype:
    """The dtype of a stream whose raw rows are ``tail``: fp32 under ``raw=bfloat16``, else the tail's."""
    return torch.float32 if codec.raw_dtype == "bfloat16" else tail.dtype


def empty_state(codec: Codec, batch: int, heads: int, groups: int, head_dim: int, dtype: torch.dtype,
                device: torch.device | str | None) -> StreamState:
    """Zeroed state for ``groups`` archive groups of a stream of ``dtype`` (raw rows in ``codec.raw_rows_dtype``)."""
    codec.check_head_dim(head_dim)
    raw = codec.raw_rows_dtype(dtype)
    archive = codec.empty_archive((batch, heads), groups, head_dim, dtype, device)
    return StreamState(
        *archive,
        torch.zeros(batch, heads, head_dim if codec.center else 0, dtype=torch.float32, device=device),
        torch.zeros(batch, heads, codec.sinks, head_dim, dtype=raw, device=device),
        torch.zeros(batch, heads, codec.tail_capacity, head_dim, dtype=raw, device=device),
        torch.zeros((), dtype=torch.int64, device=device),
        torch.full((), codec.sinks, dtype=torch.int64, device=device),
        torch.zeros(batch, heads, head_dim if codec.normalize else 0, dtype=NORM_DTYPE, device=device),
    )


def capacity(codec: Codec, state) -> int:
    """Positions a state can hold: ``sinks + NG * G``."""
    return codec.sinks + StreamState(*state).data.shape[2] * codec.group


def advance(codec: Codec, start, end):
    """The archive's end after appending up to ``end`` tokens to an archive ending at ``start``: whole groups move
    from the tail into the archive while the tail would hold ``window + G`` tokens or more. Works on 0-dim tensors
    (the ops) and on host ints (the cache's mirror) alike."""
    behind = end - start - codec.window
    if isinstance(behind, torch.Tensor):
        return start + torch.div(behind.clamp_min(0), codec.group, rounding_mode="floor") * codec.group
    return start + max(0, behind) // codec.group * codec.group


@functools.lru_cache(maxsize=512)
def fast_kernels_serve(*specs: str, head_dim: int | None = None, trellis: bool = False) -> bool:
    """Whether the fast kernels know every codec of ``specs`` (:data:`KERNEL_CODECS`) and ``head_dim`` (a multiple of
    :data:`KERNEL_HEAD_DIM_MULTIPLE`); else the reference ops serve, which use only the
    :class:`~flashcodec_fx.codecs.Codec` interface and take any head_dim the codec stores (and reject a bad spec,
    naming the argument). Trellis codes (``levels="tcq"``) only where the caller's kernels decode them
    (``trellis``: the C++ and Triton kernels in every op)."""
    if head_dim is not None and head_dim % KERNEL_HEAD_DIM_MULTIPLE:
        return False
    try:
        codecs = [codec_from_spec(spec) for spec in specs]
    except (TypeError, ValueError):  # a bad spec: the reference op validates it and names the argument
        return False
    return all(type(c) in KERNEL_CODECS and (trellis or not uses_trellis(c)) for c in codecs)


def uses_trellis(codec: Codec) -> bool:
    """Whether ``codec`` stores trellis codes (``levels="tcq"``, ``codecs/trellis.py``)."""
    q = getattr(codec, "quantizer", None)
    return q is not None and "tcq" in q.levels


def spec_codec(name: str, spec: str) -> Codec:
    try:
        return codec_from_spec(spec)
    except (ValueError, TypeError) as err:
        raise type(err)(f"{name}: {err}") from None


def check_state(name: str, codec: Codec, state) -> StreamState:
    """Check one stream's state against its codec (shapes and dtypes as in the module docstring)."""
    if len(state) != len(StreamState._fields):
        raise ValueError(f"{name} must hold the {len(StreamState._fields)} tensors {StreamState._fields}, got "
                         f"{len(state)}")
    state = StreamState(*state)
    if state.tail.dim() != 4:
        raise ValueError(f"{name}.tail must be (B, H, window + G, D), got shape {tuple(state.tail.shape)}")
    b, h, _, d = state.tail.shape
    raw = state.tail.dtype
    if not raw.is_floating_point:
        raise TypeError(f"{name}.tail must be a floating tensor (the raw rows' dtype), got {raw}")
    if codec.raw_dtype == "bfloat16" and raw != torch.bfloat16:
        raise ValueError(f"{name}.tail must be bfloat16 under a raw=bfloat16 spec (the raw rows of an fp32 stream), "
                         f"got {raw}")
    dtype = stream_dtype(codec, state.tail)
    groups = state.data.shape[2] if state.data.dim() > 2 else -1
    shapes = codec.archive_shapes(d, dtype)
    for field, (shape, want_dtype) in shapes.items():
        t = getattr(state, field)
        want = (b, h, groups, *shape)
        if tuple(t.shape) != want or t.dtype != want_dtype:
            raise ValueError(f"{name}.{field} must be {want_dtype} of shape {want}, got {t.dtype} {tuple(t.shape)}")
    expect = {"mean": ((b, h, d if codec.center else 0), torch.float32),
              "sink": ((b, h, codec.sinks, d), raw), "tail": ((b, h, codec.tail_capacity, d), raw),
              "norm": ((b, h, d if codec.normalize else 0), NORM_DTYPE)}
    for field, (want, want_dtype) in expect.items():
        t = getattr(state, field)
        if tuple(t.shape) != want or t.dtype != want_dtype:
            raise ValueError(f"{name}.{field} must be {want_dtype} of shape {want}, got {t.dtype} {tuple(t.shape)}")
    for field in ("length", "start"):
        t = getattr(state, field)
        if t.dim() != 0 or t.dtype != torch.int64:
            raise ValueError(f"{name}.{field} must be a 0-dim int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    return state
