"""The page format: every byte of a page accounted for, the codec's own fields, bits per value as stored."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from flashcodec_fx.codecs import make_codec
from flashcodec_fx.presets import SCALAR_PRESETS, preset_codecs
from flashcodec_fx.vllm import page
from flashcodec_fx.vllm.config import VLLM_PRESETS
from flashcodec_fx.vllm.page import (
    PAGE_FIELDS,
    RAW,
    PageFormat,
    history_rows,
    page_format,
    paged_codec,
    store_plan,
)


@pytest.mark.parametrize("name", VLLM_PRESETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slot_holds_the_presets_per_token_codes(name, dtype):
    """A code slot is the codec's stored group (codes + fp16 scales and zero points) of K and of V, padded to even;
    the rotation and quantizer are the preset's, keys centered where the preset centers them (on a page mean), the
    residual policy the page's."""
    fmt = page_format(name, 7, 64, dtype)
    key, value = preset_codecs(name, 7)
    assert fmt.key.quantizer == key.quantizer and fmt.value.quantizer == value.quantizer
    assert fmt.key.rotate == key.rotate == 7
    assert fmt.center == fmt.key.center == key.center and not fmt.value.center
    assert fmt.key.sinks == fmt.key.window == fmt.value.sinks == fmt.value.window == 0
    used = fmt.key.group_bytes(64, dtype) + fmt.value.group_bytes(64, dtype)
    assert fmt.code_slot_bytes == used + used % 2
    assert fmt.anchors == key.sinks
    k, v = fmt.slots
    fields = sorted([(k.scale_offset, 2 * k.scales), (k.zero_offset, 2 * k.zeros), (v.scale_offset, 2 * v.scales),
                     (v.zero_offset, 2 * v.zeros), (k.code_offset, k.code_bytes), (v.code_offset, v.code_bytes)])
    end = 0
    for offset, size in fields:  # back to back, no overlap, no gap
        assert offset == end
        end += size
    assert end == used


@pytest.mark.parametrize("block_size", [16, 32, 128, 256])
@pytest.mark.parametrize("name", [*VLLM_PRESETS, RAW])
def test_page_bytes_and_bits(name, block_size):
    fmt = page_format(name, 0, 64, torch.bfloat16)
    raw = fmt.raw_rows(block_size)
    assert fmt.page_bytes(block_size) == raw * 256 + (block_size - raw) * fmt.code_slot_bytes
    c = fmt.state_content_bytes(block_size)
    assert c == -(-fmt.page_bytes(block_size) // block_size)  # the fewest (block sizes divisible by 4: aligned)
    assert fmt.bits_per_value(block_size) == pytest.approx(8 * c / 128)


def test_bits_per_value_at_block_128():
    """D = 64, bf16, vLLM's CPU default block size: int8 8.25 (no raw rows); 4 raw rows per 128-token page cost
    4 * 16 / 128 = 0.5 bit on top of the codes, less the padding of the last byte."""
    bits = {name: page_format(name, 0, 64, torch.bfloat16).bits_per_value(128) for name in (*VLLM_PRESETS, RAW)}
    scalar = {"int8": 8.25, "4bit": 4.1875, "3bit": 3.1875, "2.5bit": 2.6875, "2bit": 2.25}
    assert bits == {**scalar, **{f"{name}-tcq": bits[name] for name in SCALAR_PRESETS}, RAW: 16.0}


@pytest.mark.parametrize("name", SCALAR_PRESETS)
def test_trellis_twin_pages_are_the_scalar_pages(name):
    """A trellis twin's page is its scalar preset's byte for byte (the same fields at the same offsets: b * D / 8
    bytes of codes and one fp16 scale per token and head); only the levels differ."""
    scalar, twin = (page_format(n, 3, 64, torch.bfloat16) for n in (name, f"{name}-tcq"))
    assert twin.meta() == scalar.meta() and twin.state_content_bytes(128) == scalar.state_content_bytes(128)
    for s, t in zip(scalar.slots, twin.slots, strict=True):
        assert t.codec.quantizer.levels == ("tcq",) and s.codec.quantizer.levels == ("lloyd",)
        assert (t.scales, t.zeros, t.code_bytes) == (s.scales, s.zeros, s.code_bytes)


def test_raw_format_and_anchor_override():
    raw = page_format(RAW, 3, 64, torch.float16)
    assert raw.raw and raw.raw_rows(32) == 32 and raw.state_content_bytes(32) == 256
    none = page_format("3bit", 3, 64, torch.bfloat16, anchors=0)
    assert none.raw_rows(128) == 0 and none.bits_per_value(128) == 2.75  # the bare codes, TurboQuant's K3V2 size
    assert not none.center  # no raw rows, no page mean


def test_errors():
    with pytest.raises(ValueError, match="multiple of 8"):
        page_format("3bit", 0, 60, torch.bfloat16)
    with pytest.raises(ValueError, match="preset must be one of"):
        page_format("5bit", 0, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="anchors must be an int >= 0"):
        page_format("4bit", 0, 64, torch.bfloat16, anchors=-1)
    with pytest.raises(ValueError, match="dtype must be"):
        page_format("4bit", 0, 64, torch.int8)
    with pytest.raises(ValueError, match="per-token codes"):
        paged_codec(make_codec("png", block_size=8), "lossless", False)
    with pytest.raises(ValueError, match="per-token codes"):
        paged_codec(make_codec("jpeg", block_size=1, quant_bits=4, scale_axis="channel", group=16), "x", False)
    fmt = page_format("4bit", 0, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="cannot hold format"):
        fmt.check_page(128, fmt.state_content_bytes(128) - 1)
    with pytest.raises(ValueError, match="both be set"):
        PageFormat("x", fmt.key, None, 0, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="centered keys need raw rows"):
        PageFormat("x", fmt.key, fmt.value, 0, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="values are not centered"):
        PageFormat("x", fmt.key, fmt.key, 4, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="phase must be one of"):
        store_plan(fmt, 16, torch.zeros(1), torch.zeros(1, 1), torch.ones(1), torch.tensor([0, 1]), "later")


@pytest.mark.parametrize("name", [*VLLM_PRESETS, RAW])
def test_meta_is_the_fields_by_name(name):
    """The kernels' fields, in PAGE_FIELDS order: the raw rows, the flags, the slot's bytes and field offsets."""
    fmt = page_format(name, 0, 64, torch.float16)
    meta = fmt.meta()
    assert tuple(meta) == PAGE_FIELDS
    assert meta["anchors"] == fmt.anchors and meta["raw"] == fmt.raw and meta["center"] == fmt.center
    if not fmt.raw:
        k, v = fmt.slots
        assert (meta["slot"], meta["k_code"], meta["v_scale"]) == (fmt.code_slot_bytes, k.code_offset, v.scale_offset)


def one_request(length: int, q_len: int, block_size: int, padding: int = 0) -> tuple:
    """``(slot_mapping, block_table, seq_lens, query_start_loc)`` of one request's call: positions ``length - q_len
    .. length - 1`` on pages 10, 11, ... of a table, then ``padding`` slots -1."""
    pos = torch.arange(length - q_len, length)
    table = torch.arange(10, 10 + -(-length // block_size), dtype=torch.int32)[None]
    slots = torch.cat([table[0, pos // block_size].long() * block_size + pos % block_size,
                       torch.full((padding,), -1)])
    return slots, table, torch.tensor([length], dtype=torch.int32), torch.tensor([0, q_len], dtype=torch.int32)


def test_store_plan_of_a_call():
    """A call of positions 5..21 (pages of 8, A = 2): the first page's sinks are done, its codes at offset - 2; later
    pages code offsets 0..5 and keep 6, 7 raw as they come (store phase); page 2 stays incomplete, so its newest two
    of the call take their ring rows after attention (ring phase), centered keys on the page before's raw rows."""
    fmt = page_format("3bit", 0, 16, torch.float32, anchors=2)
    args = one_request(22, 17, 8, padding=2)
    store = store_plan(fmt, 8, *args)
    ring = store_plan(fmt, 8, *args, "ring")
    pos = list(range(5, 22))
    offset = [p % 8 for p in pos]
    want_slot = [o - 2 if p < 8 else (o if o < 6 else -1) for p, o in zip(pos, offset, strict=True)] + [-1, -1]
    want_raw = [o % 2 if p >= 8 and o >= 6 else -1 for p, o in zip(pos, offset, strict=True)] + [-1, -1]
    want_ring = [p % 2 if p in (20, 21) else -1 for p in pos] + [-1, -1]
    want_mean = [10 if p < 8 else (10 if p < 16 and p % 8 < 6 else (11 if p >= 16 else -1)) for p in pos] + [-1, -1]
    assert store.code_slot.tolist() == want_slot and store.raw_row.tolist() == want_raw
    assert ring.raw_row.tolist() == want_ring and ring.code_slot.tolist() == [-1] * 19
    assert store.mean_block.tolist() == want_mean


def test_history_rows_read_the_ring_of_an_incomplete_page():
    """Pages of 8, A = 2, 21 positions read by a call storing up to 23 (page 2 incomplete: its newest two of the
    history, 19 and 20, in ring rows 1 and 0), and by one storing up to 24 (page 2 complete: 22, 23 hold the ring,
    the history's newest are read from their code slots)."""
    fmt = page_format("3bit", 0, 16, torch.float32, anchors=2)
    rows = history_rows(fmt, 8, 21, 23)
    assert rows[0].tolist() == list(range(8))  # sinks 0, 1 then slots 0..5 (rows 2..7)
    assert rows[1].tolist() == [2, 3, 4, 5, 6, 7, 0, 1]  # slots 0..5, then the final ring rows 0, 1
    assert rows[2].tolist() == [2, 3, 4, 1, 0, -1, -1, -1]  # offsets 0..2 from slots, 3 and 4 from the ring
    assert history_rows(fmt, 8, 21, 24)[2].tolist() == [2, 3, 4, 5, 6, -1, -1, -1]  # all from slots


def test_the_cpp_kernels_name_the_same_fields():
    """cpu/page.h's PageField enum is PAGE_FIELDS in order (kAnchors, kKScale, ...), its static_assert the count."""
    header = (Path(page.__file__).parent / "cpu" / "page.h").read_text()
    enum = re.search(r"enum PageField : int \{([^}]*)\}", header).group(1)
    names = [name.strip() for name in enum.split(",")]
    assert names[-1] == "kPageFields"
    assert names[:-1] == ["k" + "".join(part.capitalize() for part in f.split("_")) for f in PAGE_FIELDS]
    assert f"static_assert(kPageFields == {len(PAGE_FIELDS)}," in header
