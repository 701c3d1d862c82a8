"""The page format: how one layer's K and V of every (token, KV head) sit in a vLLM KV-cache page.

vLLM gives each layer a uint8 cache ``(num_blocks, H_kv, block_size, C)`` (``C`` = the spec's
``state_content_bytes``); the ``block_size * C`` bytes of one (block, head) are laid out here:

- ``anchors`` (``A``) raw rows first, K then V in the model's dtype,
- then ``block_size - A`` *code slots*: fp16 K scale(s) and zero point(s), the same for V, then the packed K codes
  and V codes (``codecs/pack.py``), every field as the preset's per-token codec stores it (``Quantizer.quantize``),
- then zero padding up to ``block_size * C``.

Which token sits where depends on the page's index ``i`` in its sequence (a token's position // ``block_size``; the
store is told the positions, a reader walks the block table in order):

- **the first page** (``i = 0``) keeps its first ``A`` tokens raw (the sequence's attention sinks, raw in every
  lossy preset); code slot ``s`` holds offset ``A + s``;
- **every later page** keeps its *newest* tokens raw: code slot ``s`` holds offset ``s`` (``s < block_size - A``),
  and raw row ``o % A`` holds offset ``o`` for the page's newest ``A`` tokens (a ring: while the page fills it holds
  the sequence's newest tokens, raw; once it is complete, its last ``A`` tokens, which have no code slot). So the
  ``A`` to ``2A - 1`` newest tokens before a call are read raw, as the presets' raw windows would give them.

Keys are coded *centered* (``PageFormat.center``, the presets' keys): minus the mean of the raw key rows of the page
before (the first page: its own sinks), which are complete when a page's first token is coded. The mean is side
information that costs no byte: a reader has those rows anyway. Values are not centered (as in the presets).

Codes are the preset's per-token codecs (``presets.preset_codecs``: random-sign Walsh-Hadamard rotation seeded by
the layer index, Lloyd-Max or mid-rise levels, or trellis codes for the ``-tcq`` twins (``codecs/trellis.py``: the
same ``b * D / 8`` bytes per row, so a twin's page is its scalar preset's byte for byte), one fp16 scale per token
and head, the least-squares scale search).
What a page does not keep of the preset (docs/vllm.md measures each): per-sequence channel exponents (``normalize``;
measured from four raw rows they cost quality instead), the preset's own window lengths (the ring is ``A`` tokens) and
its prompt mean (the page before's is used). A *raw* format (``skip`` layers) stores every token raw.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from ..codecs import Codec, JPEGCodec
from ..presets import preset_codecs

SCALE_BYTES = 2  # fp16 scales and zero points
RAW = "raw"  # the format name of layers stored raw (FLASHCODEC_VLLM_SKIP_LAYERS)
# A format's fields as the kernels read them, by name and in this order (:meth:`PageFormat.meta`): the C++ kernels'
# ``PageField`` enum (cpu/page.h) and the Triton kernels' ``P_*`` / ``S_*`` constants are checked against it
# (tests/vllm/test_page.py; a static_assert on the count in page.h).
PAGE_FIELDS = ("anchors", "raw", "center", "slot", "k_scale", "k_zero", "k_code", "v_scale", "v_zero", "v_code")


def paged_codec(codec: Codec, where: str, center: bool) -> JPEGCodec:
    """The per-token codec a page slot stores for preset stream ``codec``: its quantizer and rotation, ``center``
    (keys coded minus a page mean), not normalized, no sinks or window (the page holds those). ValueError for a codec
    that is not per-token codes."""
    q = codec.quantizer
    if not isinstance(codec, JPEGCodec) or codec.block_size != 1 or q is None or q.axis != "token":
        raise ValueError(f"{where}: a vLLM page slot holds per-token codes (jpeg, block_size=1, quant_bits set, "
                         f"scale_axis='token'); got {codec.spec}")
    return JPEGCodec(block_size=1, quant_bits=q.bits, levels=q.levels, scale_axis="token", scale_search=q.search,
                     rotate=codec.rotate, center=center)


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
        if self.center and self.anchors == 0:
            raise ValueError("centered keys need raw rows (anchors >= 1): the page mean is theirs")
        if self.value is not None and self.value.center:
            raise ValueError("values are not centered in a page (only keys, PageFormat.center)")

    def __hash__(self) -> int:
        """The fields' hash, computed once (a codec hashes its spec string; the kernels' launchers look formats up
        on every call)."""
        if "_hash" not in self.__dict__:
            object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))
        return self.__dict__["_hash"]

    def __getstate__(self) -> dict:
        """The fields only: the cached hash and properties are this process's (a dtype hashes by identity)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def center(self) -> bool:
        """Keys coded minus the mean of the page before's raw key rows (the first page: its own)."""
        return self.key is not None and self.key.center

    @property
    def raw(self) -> bool:
        """Every token stored raw (no codes)."""
        return self.key is None

    @functools.cached_property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @functools.cached_property
    def raw_row_bytes(self) -> int:
        """Bytes of one raw row: K then V, ``head_dim`` values each in the model's dtype."""
        return 2 * self.head_dim * self.element_size

    @functools.cached_property
    def slots(self) -> tuple[StreamSlot, StreamSlot]:
        """The K and V fields of a code slot: scales and zeros of K, then of V, then K codes, then V codes."""
        ks, kz, kb = _stream_fields(self.key, self.head_dim)
        vs, vz, vb = _stream_fields(self.value, self.head_dim)
        head = SCALE_BYTES * (ks + kz + vs + vz)
        k = StreamSlot(self.key, 0, SCALE_BYTES * ks, head, ks, kz, kb)
        v = StreamSlot(self.value, SCALE_BYTES * (ks + kz), SCALE_BYTES * (ks + kz + vs), head + kb, vs, vz, vb)
        return k, v

    @functools.cached_property
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

    def meta(self) -> dict[str, int]:
        """The fields the kernels read (:data:`PAGE_FIELDS`, in that order): raw rows asked for, every row raw,
        centered keys, code slot bytes, then the byte offsets of K's and V's scales, zero points and codes in a
        slot (zeros for a raw format)."""
        fields = dict.fromkeys(PAGE_FIELDS, 0)
        fields.update(anchors=self.anchors, raw=int(self.raw), center=int(self.center))
        if not self.raw:
            k, v = self.slots
            fields.update(slot=self.code_slot_bytes, k_scale=k.scale_offset, k_zero=k.zero_offset,
                          k_code=k.code_offset, v_scale=v.scale_offset, v_zero=v.zero_offset, v_code=v.code_offset)
        return fields

    def check_page(self, block_size: int, content_bytes: int) -> None:
        """ValueError unless a page of ``block_size`` slots of ``content_bytes`` holds this format."""
        if self.page_bytes(block_size) > block_size * content_bytes:
            raise ValueError(f"the KV cache's pages ({block_size} x {content_bytes} bytes) cannot hold format "
                             f"{self.name!r} ({self.page_bytes(block_size)} bytes at block_size={block_size})")


def page_format(name: str, layer_idx: int, head_dim: int, dtype: torch.dtype, anchors: int | None = None) -> PageFormat:
    """Layer ``layer_idx``'s format for preset ``name`` (or ``"raw"``): the preset's per-token codecs
    (``preset_codecs(name, layer_idx)``), ``anchors`` raw rows (default: the preset's sinks), keys centered when the
    preset centers them and there are raw rows."""
    if name == RAW:
        return PageFormat(RAW, None, None, 0, head_dim, dtype)
    key, value = preset_codecs(name, layer_idx)
    where = f"preset {name!r}"
    anchors = max(key.sinks, value.sinks) if anchors is None else anchors
    center = key.center and isinstance(anchors, int) and anchors > 0
    return PageFormat(name, paged_codec(key, where, center), paged_codec(value, where, False), anchors, head_dim,
                      dtype)


class StorePlan(NamedTuple):
    """Where each token of a call goes, ``(N,)`` int64 each (-1: nowhere): ``raw_row``, the raw row of its page it is
    copied to; ``code_slot``, the code slot it is coded into; ``mean_block``, the block whose raw key rows' mean its
    key is coded minus (the page before's; the first page's own)."""

    raw_row: torch.Tensor
    code_slot: torch.Tensor
    mean_block: torch.Tensor


PHASES = ("store", "ring")  # before attention (vLLM's do_kv_cache_update), after it (the end of forward)


def store_plan(fmt: PageFormat, block_size: int, slot_mapping: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, query_start_loc: torch.Tensor, phase: str = "store") -> StorePlan:
    """The :class:`StorePlan` of a call's tokens in ``phase`` (:data:`PHASES`). Token ``t`` of request ``r``
    (``query_start_loc[r] <= t < query_start_loc[r + 1]``) sits at position ``seq_lens[r] - q_len + t -
    query_start_loc[r]`` and goes to slot ``slot_mapping[t]`` (< 0: padding, stored nowhere; so are rows from
    ``query_start_loc[-1]`` on).

    ``store``: the first page's raw rows (sinks) and code slots; a later page's code slots, and its ring rows of
    offsets ``>= block_size - A`` where the call completes the page (they are final). ``ring``, after attention has
    read the history: a later page's ring rows of the request's newest ``A`` tokens of the call where the page stays
    incomplete. Attention therefore finds a ring holding the history's newest tokens, or a complete page's last
    ``A`` (``history_rows``). Torch ops on the inputs' device, no host synchronization.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    n, device = slot_mapping.shape[0], slot_mapping.device
    none = torch.full((n,), -1, dtype=torch.int64, device=device)
    if n == 0 or seq_lens.numel() == 0 or (fmt.raw and phase == "ring"):
        return StorePlan(none, none, none)
    t = torch.arange(n, device=device)
    starts, lens = query_start_loc.long(), seq_lens.long()
    req = torch.searchsorted(starts[1:], t, right=True).clamp_max(lens.numel() - 1)
    pos = lens[req] - (starts[req + 1] - starts[req]) + (t - starts[req])
    slots = slot_mapping.long()
    valid = (slots >= 0) & (t < starts[-1])
    offset, page = pos % block_size, pos // block_size
    keep = lambda x: torch.where(valid, x, none)  # noqa: E731
    if fmt.raw:
        return StorePlan(keep(offset), none, none)
    a = fmt.raw_rows(block_size)
    first, ring, last = page == 0, offset % max(a, 1), lens[req] - 1
    completed = pos - offset + block_size - 1 <= last  # the call reaches the page's end
    if phase == "ring":
        newest = (pos + a > last) & ~first & ~completed
        return StorePlan(keep(torch.where(newest, ring, none)), none, none)
    raw_row = torch.where(first, torch.where(offset < a, offset, none),
                          torch.where((offset >= block_size - a) & completed, ring, none))
    code_slot = torch.where(first, torch.where(offset >= a, offset - a, none),
                            torch.where(offset < block_size - a, offset, none))
    mean_block = none
    if fmt.center:
        before = block_table.long()[req, (page - 1).clamp_min(0)]
        mean_block = torch.where(code_slot >= 0, torch.where(first, slots // block_size, before), none)
    return StorePlan(keep(raw_row), keep(code_slot), keep(mean_block))


def history_rows(fmt: PageFormat, block_size: int, length: int, total: int) -> torch.Tensor:
    """``(pages, block_size)`` int64: where positions ``0 .. length - 1`` of a sequence are read from by a call that
    has stored (phase ``store``) the positions up to ``total``: ``j < A`` raw row ``j``, ``A + s`` code slot ``s``
    (entries past ``length``: -1). A page after the first reads from its ring the offsets it holds: its last ``A``
    when the page is complete (``total`` reaches its end), else the ``A`` newest before the call."""
    pages = -(-length // block_size)
    index = torch.arange(pages)[:, None]
    offset = torch.arange(block_size).expand(pages, block_size)
    held = (length - index * block_size).clamp_max(block_size)
    if fmt.raw:
        rows = offset
    else:
        a = fmt.raw_rows(block_size)
        complete = total - index * block_size >= block_size
        ring_from = torch.where(complete, block_size - a, held - a)
        rows = torch.where(index > 0, torch.where(offset >= ring_from, offset % max(a, 1), a + offset), offset)
    return torch.where(offset < held, rows, torch.full_like(rows, -1))
