"""The raw prefix of a dynamic stream: its first tokens held as a DynamicCache holds them, until the codec fits.

A codec's state has rows whatever the length (raw sinks ``(B, H, sinks, D)``, the raw tail ``(B, H, window + G,
D)``, both in the raw rows' dtype, the fp32 mean ``(B, H, D)``, the uint8 channel exponents, two 0-dim int64 lengths,
at least one archive group), which below a few dozen tokens take more bytes than the tokens themselves. So a dynamic
stream (eager) holds its tokens as one ``(B, H, n, D)`` tensor in the stream dtype, nothing else, until
:func:`prefix_length`; then it converts once: the codec's state is allocated for that length and the held tokens are
appended into it as the calls of :func:`replay_calls`. The first call reaching past the sinks sets the mean and the
channel exponents (``ops/reference/append.py``), so it is replayed with its own length; how the other tokens are split
into calls does not change what an append stores (tested bitwise for every preset and tier). The state after
conversion is therefore bitwise the state the original calls build without the prefix.

While held raw, the tokens are read exactly (the view is the tokens, as for the raw tail), and the ops read them as
the state of :data:`RAW_CODEC` (:func:`raw_state`: the archive a view of the tokens, no copy).
"""

from __future__ import annotations

import itertools

import torch

from .codecs import Codec, make_codec
from .codecs.channel_norm import NORM_DTYPE

RAW_CODEC = make_codec("jpeg", block_size=1, quant_bits=None)  # stores raw: its archive is the tokens themselves
RAW_SPEC = RAW_CODEC.spec
MAX_PREFIX = 256  # tokens a prefix holds at most (its per-step re-allocation is bounded by it)
RAW_CODEC_PREFIX = 64  # a codec storing raw (lossless) converts here: its spare tail row is then <= 1/64 of its bytes
LENGTH_BYTES = 16  # the state's two 0-dim int64 lengths (length, start)
NORM_BYTES = torch.empty((), dtype=NORM_DTYPE).element_size()  # a channel's exponent (normalized codecs)


def groups_for(codec: Codec, positions: int) -> int:
    """The fewest archive groups of ``codec`` covering ``positions`` positions (the sinks hold the first ones)."""
    return -(-max(0, positions - codec.sinks) // codec.group)


def compresses(codec: Codec, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether an archive group of ``codec`` takes fewer bytes than its tokens raw in ``dtype``."""
    return codec.group_bytes(head_dim, dtype) < codec.group * head_dim * dtype.itemsize


def raw_budget_groups(codec: Codec, head_dim: int, dtype: torch.dtype, length: int) -> int:
    """Archive groups whose bytes, with the raw sink and tail rows (in the dtype they are stored in:
    :meth:`~flashcodec_fx.codecs.Codec.resolved`), the mean and the two 0-dim lengths, fit in what ``length`` raw
    tokens of ``head_dim`` channels in ``dtype`` take per ``(batch, head)`` row (negative when even the raw rows do
    not); the same for every batch size (the lengths counted in every row)."""
    return _budget(codec, head_dim, dtype, length)


def _budget(codec: Codec, head_dim: int, dtype: torch.dtype, length: int) -> int:
    item = dtype.itemsize
    row_item = codec.resolved(dtype).raw_rows_dtype(dtype).itemsize
    stats = (4 if codec.center else 0) + (NORM_BYTES if codec.normalize else 0)  # per channel: mean, exponent
    fixed = head_dim * ((codec.sinks + codec.tail_capacity) * row_item + stats) + LENGTH_BYTES
    return (head_dim * length * item - fixed) // codec.group_bytes(head_dim, dtype)


def prefix_length(codec: Codec, head_dim: int, dtype: torch.dtype) -> int:
    """The length at which a dynamic stream of ``codec`` stops holding its tokens raw: for a codec that compresses,
    the shortest whose first allocation (at least one group) fits :func:`raw_budget_groups`, at most
    :data:`MAX_PREFIX`; :data:`RAW_CODEC_PREFIX` for a codec that stores raw; 0 (no prefix) for one that holds more
    than raw at every length (png deltas, an unquantized DCT)."""
    if codec.stores_raw:
        return RAW_CODEC_PREFIX
    if not compresses(codec, head_dim, dtype):
        return 0
    fits = (n for n in range(1, MAX_PREFIX) if _budget(codec, head_dim, dtype, n) >= max(1, groups_for(codec, n)))
    return next(fits, MAX_PREFIX)


def first_call_after(first_call: tuple[int, int] | None, length: int, new: int, sinks: int) -> tuple[int, int] | None:
    """The positions of the first call reaching past the ``sinks`` (the one that sets the mean) once ``new`` tokens
    are appended at ``length``."""
    if first_call is None and length <= sinks < length + new:
        return length, length + new
    return first_call


def replay_calls(first_call: tuple[int, int] | None, held: int, new: int) -> list[tuple[int, int]]:
    """Position ranges a conversion appends, over the ``held`` tokens followed by the ``new`` tokens of the call that
    converts: the sink positions before the first call reaching past the sinks, that call (with its own length; it
    runs into the new call where a crop cut into it and new tokens took its place), the other held tokens, the new
    ones. ``first_call``: None while no call has reached past the sinks (the new call is then the first)."""
    lo, hi = (held, held + new) if first_call is None else first_call
    cuts = sorted({0, lo, hi, held + new} | ({held} if held >= hi else set()))
    return list(itertools.pairwise(cuts))


def raw_state(tokens: torch.Tensor) -> list[torch.Tensor]:
    """The state of :data:`RAW_CODEC` holding ``tokens (B, H, n, D)``, as the ops take it: the archive a view of the
    tokens (no copy), empty scales, sinks, mean and norm, one zero tail row, ``length = start = n`` (all archived)."""
    b, h, n, d = tokens.shape
    dev = tokens.device
    shapes = RAW_CODEC.archive_shapes(d, tokens.dtype)
    empty = [torch.zeros(b, h, n, *shape, dtype=dtype, device=dev) for field, (shape, dtype) in shapes.items()
             if field != "data"]
    return [tokens.unsqueeze(3), *empty, torch.zeros(b, h, 0, dtype=torch.float32, device=dev),
            tokens.new_zeros(b, h, 0, d), tokens.new_zeros(b, h, RAW_CODEC.tail_capacity, d),
            torch.full((), n, dtype=torch.int64, device=dev), torch.full((), n, dtype=torch.int64, device=dev),
            torch.zeros(b, h, 0, dtype=NORM_DTYPE, device=dev)]


__all__ = ["MAX_PREFIX", "RAW_CODEC", "RAW_CODEC_PREFIX", "RAW_SPEC", "compresses", "first_call_after",
           "prefix_length", "raw_budget_groups", "raw_state", "replay_calls"]
