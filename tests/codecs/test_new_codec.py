"""A new codec is one file plus its registry entry (issue 17): ``tests/toy_codec.py`` registers ``half`` and it runs
through the reference ops (opcheck included), the engine cache and the transformers cache with nothing else changed
(the compile pass: tests/passes/test_new_codec_compiled.py)."""

from __future__ import annotations

import pytest
import torch
import toy_codec

import flashcodec_fx as fx
from flashcodec_fx.codecs import CODECS, codec_from_spec, codec_options, make_codec
from flashcodec_fx.ops.state import fast_kernels_serve


def test_registered_by_name_with_its_options():
    codec = make_codec("half", sinks=2, window=3)
    assert CODECS["half"] is toy_codec.HalfCodec and codec_options("half") == {"sinks": 0, "window": 0}
    assert codec.spec == "half;sinks=2;window=3" and codec_from_spec(codec.spec) == codec
    assert not fast_kernels_serve(codec.spec)  # the C++ / Triton kernels leave it to the reference
    with pytest.raises(ValueError, match="unknown option"):
        make_codec("half", quant_bits=8)


def test_engine_cache_attends_on_its_stored_form():
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(2))
    q = torch.randn(1, 4, 1, 16, generator=gen)
    cache = fx.CodecKVCache(make_codec("half", sinks=2, window=3))
    cache.append(k, v)
    keys, values = cache.read()
    assert torch.equal(keys[:, :, 2:-3], k[:, :, 2:-3].half().float()) and torch.equal(keys[:, :, -3:], k[:, :, -3:])
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    torch.testing.assert_close(cache.attention(q), want, rtol=1e-5, atol=1e-5)


def test_opcheck_on_its_ops():
    codec = make_codec("half", window=2)
    cache = fx.CodecKVCache(codec)
    x = torch.randn(1, 2, 9, 16)
    cache.append(x, x)
    state = list(cache.keys.state)
    torch.library.opcheck(torch.ops.flashcodec.read.default, (state, codec.spec, None))
    torch.library.opcheck(torch.ops.flashcodec.codec_attention.default,
                          (torch.randn(1, 4, 1, 16), state, list(cache.values.state), codec.spec, codec.spec))


def test_transformers_cache_and_generate():
    pytest.importorskip("transformers")
    from conftest import fresh_tiny_model, tiny_prompt

    model = fresh_tiny_model("llama")
    fx.apply_flash_codec(model, mode="half", window=4, strict=True)
    try:
        out = model.generate(tiny_prompt(1, 20), max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    finally:
        fx.remove_flash_codec(model)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    assert cache.layers[0].keys_stream.codec.name == "half" and cache.get_seq_length() == 27
    assert cache.bits_per_value() < 32  # fp16 codes of an fp32 model
