"""``raw_dtype``: how a codec stores its raw rows, and what a stream of each dtype resolves ``"auto"`` to."""

from __future__ import annotations

import pytest
import torch

from flashcodec_fx.codecs import make_codec
from flashcodec_fx.presets import PRESETS, SCALAR_PRESETS, TRELLIS_PRESETS, preset_codecs

LOSSY_WITH_RAW_ROWS = SCALAR_PRESETS + TRELLIS_PRESETS


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_auto_narrows_the_raw_rows_of_fp32_streams_of_lossy_presets_only(preset):
    """Lossy presets with raw sinks and windows store them in bf16 in an fp32 stream; ``int8`` has no raw rows that
    hold tokens (its fp32 tokens are encoded as given), ``lossless`` is raw by definition; 16-bit streams keep theirs."""
    for codec in preset_codecs(preset):
        narrowed = codec.resolved(torch.float32)
        if preset in LOSSY_WITH_RAW_ROWS:
            assert narrowed.raw_dtype == "bfloat16" and narrowed.spec == codec.spec + ";raw=bfloat16"
            assert narrowed.raw_rows_dtype(torch.float32) == torch.bfloat16
        else:
            assert narrowed is codec and codec.raw_rows_dtype(torch.float32) == torch.float32
        for dtype in (torch.bfloat16, torch.float16):
            assert codec.resolved(dtype) is codec and codec.raw_rows_dtype(dtype) == dtype


def test_stream_keeps_the_stream_dtype_and_bfloat16_is_for_fp32_streams():
    kept = make_codec("jpeg", block_size=1, quant_bits=3, sinks=4, window=8, raw_dtype="stream")
    assert kept.resolved(torch.float32) is kept and kept.raw_rows_dtype(torch.float32) == torch.float32
    narrow = make_codec("jpeg", block_size=1, quant_bits=3, sinks=4, raw_dtype="bfloat16")
    assert narrow.resolved(torch.float32) is narrow
    with pytest.raises(ValueError, match="raw_dtype='bfloat16' stores the raw rows of float32 streams"):
        narrow.resolved(torch.float16)


def test_block_codecs_and_codecs_without_raw_tokens_keep_the_stream_dtype_unless_asked():
    """A crop into a block codec's group writes its decoded rows into the raw tail (bf16 would round them); a
    per-token codec without sinks or window (``int8``) holds no raw token."""
    for codec in (make_codec("jpeg", block_size=8, quant_bits=4, sinks=2, window=4),
                  make_codec("jpeg", block_size=1, quant_bits=4)):
        assert codec.resolved(torch.float32) is codec
        asked = codec.with_raw_dtype("bfloat16")
        assert asked.resolved(torch.float32) is asked and asked.raw_rows_dtype(torch.float32) == torch.bfloat16


def test_unquantized_and_png_codecs_never_narrow():
    for codec in (make_codec("jpeg", block_size=4, sinks=2, window=4), make_codec("png", block_size=4, window=4)):
        assert codec.resolved(torch.float32) is codec
