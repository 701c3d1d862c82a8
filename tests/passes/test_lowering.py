"""The inlined (Inductor-fusable) codec attention equals the op's reference for every codec tier."""

from __future__ import annotations

import pytest
import torch

import flashcodec_fx as fc
from flashcodec_fx.passes.lowering import codec_attention_fused

CODECS = {
    "png": dict(mode="png", block_size=8),
    "png_pruned": dict(mode="png", block_size=8, keep_ratio=0.5),
    "jpeg": dict(mode="jpeg", block_size=8),
    "jpeg_k4_int8": dict(mode="jpeg", block_size=8, keep_freqs=4, quant_bits=8),
    "jpeg_int8_r16": dict(mode="jpeg", block_size=16, quant_bits=8),
}


def _args(name: str, length: int, dtype=torch.float32):
    torch.manual_seed(0)
    opts = dict(CODECS[name])
    codec = fc.make_codec(opts.pop("mode"), **opts)
    cache = fc.CodecKVCache(codec, layout="static", max_length=64, memoize=False)
    cache.append(torch.randn(2, 2, length, 16, dtype=dtype), torch.randn(2, 2, length, 16, dtype=dtype))
    ks, vs = cache.keys, cache.values
    return (*ks.state, ks.tail, *vs.state, vs.tail, ks.length, ks.spec, vs.spec)


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("length", [5, 37, 64])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_fused_equals_reference(name, length, mask_kind):
    args = _args(name, length)
    q = torch.randn(2, 6, 2, 16)
    mask = None
    if mask_kind:
        allowed = torch.rand(2, 1, 2, 64) > 0.3
        mask = allowed if mask_kind == "bool" else torch.randn(2, 1, 2, 64).masked_fill(~allowed, float("-inf"))
    want = torch.ops.flashcodec.codec_attention(q, *args, mask, 0.2)
    torch.testing.assert_close(codec_attention_fused(q, *args, mask, 0.2), want, rtol=1e-5, atol=1e-5)


def test_fused_keeps_query_dtype():
    args = _args("jpeg_int8_r16", 40, torch.bfloat16)
    q = torch.randn(2, 4, 1, 16, dtype=torch.bfloat16)
    got = codec_attention_fused(q, *args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, torch.ops.flashcodec.codec_attention(q, *args), rtol=2e-2, atol=2e-2)
