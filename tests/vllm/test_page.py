"""The page format: every byte of a page accounted for, the codec's own fields, bits per value as stored."""

from __future__ import annotations

import pytest
import torch

from flashcodec_fx.codecs import make_codec
from flashcodec_fx.presets import preset_codecs
from flashcodec_fx.vllm.config import VLLM_PRESETS
from flashcodec_fx.vllm.page import RAW, PageFormat, page_format, paged_codec


@pytest.mark.parametrize("name", VLLM_PRESETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slot_holds_the_presets_per_token_codes(name, dtype):
    """A code slot is the codec's stored group (codes + fp16 scales and zero points) of K and of V, padded to even;
    the rotation and quantizer are the preset's, centering and the residual policy are the page's."""
    fmt = page_format(name, 7, 64, dtype)
    key, value = preset_codecs(name, 7)
    assert fmt.key.quantizer == key.quantizer and fmt.value.quantizer == value.quantizer
    assert fmt.key.rotate == key.rotate == 7
    assert not fmt.key.center and fmt.key.sinks == fmt.key.window == 0
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
    assert bits == {"int8": 8.25, "4bit": 4.1875, "3bit": 3.1875, "2.5bit": 2.6875, "2bit": 2.25, RAW: 16.0}


def test_raw_format_and_anchor_override():
    raw = page_format(RAW, 3, 64, torch.float16)
    assert raw.raw and raw.raw_rows(32) == 32 and raw.state_content_bytes(32) == 256
    none = page_format("3bit", 3, 64, torch.bfloat16, anchors=0)
    assert none.raw_rows(128) == 0 and none.bits_per_value(128) == 2.75  # the bare codes, TurboQuant's K3V2 size


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
        paged_codec(make_codec("png", block_size=8), "lossless")
    with pytest.raises(ValueError, match="per-token codes"):
        paged_codec(make_codec("jpeg", block_size=1, quant_bits=4, scale_axis="channel", group=16), "x")
    fmt = page_format("4bit", 0, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="cannot hold format"):
        fmt.check_page(128, fmt.state_content_bytes(128) - 1)
    with pytest.raises(ValueError, match="both be set"):
        PageFormat("x", fmt.key, None, 0, 64, torch.bfloat16)
