"""flashcodec_fx.evaluate.storage: bytes kept, values cached and bits per value on real caches of tiny models."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from conftest import cache_kwargs, fresh_tiny_model, tiny_config, tiny_prompt  # noqa: E402

from flashcodec_fx.evaluate import RAW, Tier, bits_per_value, cache_bytes, cached_values, make_cache  # noqa: E402


def _filled(model, tier, length):
    cache = make_cache(model, tier)
    with torch.no_grad():
        model(input_ids=tiny_prompt(2, length), use_cache=True, **cache_kwargs(cache))
    return cache


@pytest.mark.parametrize("dtype, bits", [(torch.float32, 32.0), (torch.bfloat16, 16.0)])
def test_raw_cache_is_its_dtype_width(dtype, bits):
    model = fresh_tiny_model("llama").to(dtype)
    cache = _filled(model, RAW, 20)
    config = tiny_config("llama")
    expected = 2 * config.num_hidden_layers * 2 * config.num_key_value_heads * 20 * config.head_dim
    assert cached_values(cache) == expected
    assert cache_bytes(cache) == {"kv": expected * dtype.itemsize, "held": expected * dtype.itemsize}
    assert bits_per_value(cache_bytes(cache)["kv"], cached_values(cache)) == bits


def test_sliding_layers_count_only_their_window():
    model = fresh_tiny_model("gemma3")
    config = tiny_config("gemma3")
    cache = _filled(model, RAW, 20)
    per_token = 2 * 2 * config.num_key_value_heads * config.head_dim  # batch 2, keys + values
    kept = sum(20 if kind == "full_attention" else config.sliding_window - 1 for kind in config.layer_types)
    assert cached_values(cache) == per_token * kept


def test_codec_cache_bytes_come_from_storage_breakdown():
    model = fresh_tiny_model("llama")
    cache = _filled(model, Tier("int8", {"mode": "jpeg", "block_size": 8, "keep_freqs": 8, "quant_bits": 8}), 20)
    parts = cache.storage_breakdown()
    assert cache_bytes(cache) == {"kv": parts["stored"] + parts.get("native", 0), "held": parts["total"]}
    assert parts["stored"] == cache.layers[0].stored_bits() // 8 + cache.layers[1].stored_bits() // 8
    assert cache_bytes(cache)["kv"] < cache_bytes(_filled(model, RAW, 20))["kv"]


def test_bits_per_value_rejects_an_empty_cache():
    with pytest.raises(ValueError, match="values must be > 0"):
        bits_per_value(10, 0)
