"""`CodecStream` / `CodecKVCache`: the storage engine for one attention layer's K and V streams (no transformers
import).

A stream keeps the state of ``ops/state.py`` (archive groups, fp16 scales, raw sinks and tail, the per-channel mean
and channel exponents, a 0-dim device length) and, optionally, a memo: the decoded view attention reads, updated
once per archived group.

Layouts:
- ``dynamic``: the first tokens are held raw, one ``(B, H, n, D)`` tensor as a DynamicCache holds them, until the
  codec's state fits in the same bytes (:mod:`flashcodec_fx.raw_prefix`: a few dozen tokens for the lossy presets,
  64 for ``lossless``); then the state is allocated for that length and the tokens are appended into it (bitwise the
  state the same calls build without the prefix). The archive grows by 1/16 (at least 64 positions; a codec storing
  raw: 1/16) on overflow, never past what an uncompressed cache of the same length would hold while the codec
  compresses (:meth:`CodecStream.raw_budget_groups`); a host-side length mirror drives growth.
- ``static``: preallocated for ``max_length`` tokens; ``append`` never branches on tensor values on the host,
  so a decode step compiles to one graph and can be captured in a CUDA graph.

One concept per module: ``stream.py`` (:class:`CodecStream`: append, read, the memo, the host mirrors), ``growth.py``
(the raw prefix, allocation, growth), ``crop.py`` (crops, rollbacks, a ring's front), ``moves.py`` (device moves,
batch selection), ``accounting.py`` (bytes and bits held), ``kv_cache.py`` (:class:`CodecKVCache`, both streams of a
layer, and :func:`codec_decode_attention`).
"""

from __future__ import annotations

from ..codecs import Encoded
from .crop import CROP_MODES
from .kv_cache import CodecKVCache, codec_decode_attention
from .stream import LAYOUTS, CodecOverflowError, CodecStream

__all__ = ["CROP_MODES", "LAYOUTS", "CodecKVCache", "CodecOverflowError", "CodecStream", "Encoded",
           "codec_decode_attention"]
