"""The page format: how one layer's K and V of every (token, KV head) sit in a vLLM KV-cache page.

vLLM gives each layer a uint8 cache ``(num_blocks, H_kv, block_size, C)`` (``C`` = the spec's
``state_content_bytes``); the ``block_size * C`` bytes of one (block, head) are laid out here:

- ``anchors`` raw rows first: the block's first ``anchors`` tokens, K then V, in the model's dtype. In a sequence's
  first block they are its attention sinks (positions ``0 .. anchors - 1``, kept raw by every lossy preset); in the
  others they are a few raw tokens at every ``block_size``-th position. A page cannot know whether it is a first
  block (prefix caching shares pages, any page can start a sequence), so every page has them.
- then one *code slot* per other token: fp16 K scale(s) and zero point(s), the same for V, then the packed K codes
  and V codes (``codecs/pack.py``), every field as the preset's per-token codec stores it (``Quantizer.quantize``).
- then zero padding up to ``block_size * C``.

Codes are the preset's per-token codecs (``presets.preset_codecs``: random-sign Walsh-Hadamard rotation seeded by
the layer index, Lloyd-Max or mid-rise levels, one fp16 scale per token and head, the least-squares scale search)
with two changes a fixed page forces (docs/vllm.md measures both): keys are not centered and not normalized (a
per-sequence prompt mean or channel exponents have no page of their own), and there is no raw recent window (the
newest tokens are coded like the others; the call's own tokens are still read exactly). A *raw* format (``skip``
layers) stores every token raw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codecs import Codec, JPEGCodec
from ..presets import preset_codecs

SCALE_BYTES = 2  # fp16 scales and zero points
RAW = "raw"  # the format name of layers stored raw (FLASHCODEC_VLLM_SKIP_LAYERS)


def paged_codec(codec: Codec, where: str) -> JPEGCodec:
    """The per-token codec a page slot stores for preset stream ``codec``: its quantizer and rotation, not centered or
    normalized, no sinks or window (the page holds those, or not). ValueError for a codec that is not per-token codes."""
    q = codec.quantizer
    if not isinstance(codec, JPEGCodec) or codec.block_size != 1 or q is None or q.axis != "token":
        raise ValueError(f"{where}: a vLLM page slot holds per-token codes (jpeg, block_size=1, quant_bits set, "
                         f"scale_axis='token'); got {codec.spec}")
    return JPEGCodec(block_size=1, quant_bits=q.bits, levels=q.levels, scale_axis="token", scale_search=q.search,
                     rotate=codec.rotate)


@dataclass(frozen=True)
class StreamSlot:
    """One stream's fields in a code slot: byte offsets (from the slot's start) of its scales, zero points, codes."""

    codec: JPEGCodec
    scale_offset: int
    zero_offset: int
    code_offset: int
    scales: int  # fp16 scales per token (scale classes)
    zeros: int  # fp16 zero points per token
    code_bytes: int


def _stream_fields(codec: JPEGCodec, head_dim: int) -> tuple[int, int, int]:
    q = codec.quantizer
    return len(q.classes), q.zero_classes, q.row_bytes(head_dim)


@dataclass(frozen=True)
class PageFormat:
    """One layer's page format (see the module docstring). ``key`` / ``value``: per-token codecs (None for a raw
    format); ``anchors``: raw rows per page; ``head_dim``; ``dtype``: the model's (raw rows)."""

    name: str
    key: JPEGCodec | None
    value: JPEGCodec | None
    anchors: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self):
        if (self.key is None) != (self.value is None):
            raise ValueError("key and value codecs must both be set (codes) or both None (a raw format)")
        if isinstance(self.anchors, bool) or not isinstance(self.anchors, int) or self.anchors < 0:
            raise ValueError(f"anchors must be an int >= 0, got {self.anchors!r}")
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16 (the model's), got {self.dtype}")
        if self.key is not None and self.head_dim % 8:
            raise ValueError(f"a vLLM page slot's packed codes need a head_dim that is a multiple of 8 (the plugin's "
                             f"kernels load channels 8 at a time), got {self.head_dim}")

    @property
    def raw(self) -> bool:
        """Every token stored raw (no codes)."""
        return self.key is None

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def raw_row_bytes(self) -> int:
        """Bytes of one raw row: K then V, ``head_dim`` values each in the model's dtype."""
        return 2 * self.head_dim * self.element_size

    @property
    def slots(self) -> tuple[StreamSlot, StreamSlot]:
        """The K and V fields of a code slot: scales and zeros of K, then of V, then K codes, then V codes."""
        ks, kz, kb = _stream_fields(self.key, self.head_dim)
        vs, vz, vb = _stream_fields(self.value, self.head_dim)
        head = SCALE_BYTES * (ks + kz + vs + vz)
        k = StreamSlot(self.key, 0, SCALE_BYTES * ks, head, ks, kz, kb)
        v = StreamSlot(self.value, SCALE_BYTES * (ks + kz), SCALE_BYTES * (ks + kz + vs), head + kb, vs, vz, vb)
        return k, v

    @property
    def code_slot_bytes(self) -> int:
        """Bytes of one code slot (K and V of one token and head), rounded up to even (fp16 fields stay aligned)."""
        if self.raw:
            return self.raw_row_bytes
        k, v = self.slots
        end = v.code_offset + v.code_bytes
        return end + end % 2

    def raw_rows(self, block_size: int) -> int:
        """Raw rows of a page: ``anchors`` (every row for a raw format), at most ``block_size``."""
        return block_size if self.raw else min(self.anchors, block_size)

    def page_bytes(self, block_size: int) -> int:
        """Bytes one (block, head) page needs: raw rows, then code slots."""
        a = self.raw_rows(block_size)
        return a * self.raw_row_bytes + (block_size - a) * self.code_slot_bytes

    def state_content_bytes(self, block_size: int) -> int:
        """The spec's ``C``: the fewest bytes per (token, head) slot such that ``block_size * C`` holds a page and is
        a multiple of 4 (every page then starts 4-byte aligned: raw fp32 rows and fp16 fields stay aligned)."""
        c = math.ceil(self.page_bytes(block_size) / block_size)
        while block_size * c % 4:
            c += 1
        return c

    def bits_per_value(self, block_size: int) -> float:
        """Bits per cached value as stored: every byte of the page (raw rows, scales, codes, padding) over the
        ``2 * head_dim`` values of each of its ``block_size`` tokens."""
        return 8 * self.state_content_bytes(block_size) / (2 * self.head_dim)

    def check_page(self, block_size: int, content_bytes: int) -> None:
        """ValueError unless a page of ``block_size`` slots of ``content_bytes`` holds this format."""
        if self.page_bytes(block_size) > block_size * content_bytes:
            raise ValueError(f"the KV cache's pages ({block_size} x {content_bytes} bytes) cannot hold format "
                             f"{self.name!r} ({self.page_bytes(block_size)} bytes at block_size={block_size})")


def page_format(name: str, layer_idx: int, head_dim: int, dtype: torch.dtype, anchors: int | None = None) -> PageFormat:
    """Layer ``layer_idx``'s format for preset ``name`` (or ``"raw"``): the preset's per-token codecs
    (``preset_codecs(name, layer_idx)``), ``anchors`` raw rows (default: the preset's sinks)."""
    if name == RAW:
        return PageFormat(RAW, None, None, 0, head_dim, dtype)
    key, value = preset_codecs(name, layer_idx)
    where = f"preset {name!r}"
    fmt_key, fmt_value = paged_codec(key, where), paged_codec(value, where)
    return PageFormat(name, fmt_key, fmt_value, max(key.sinks, value.sinks) if anchors is None else anchors,
                      head_dim, dtype)
