"""Outlier channels: the construction leaves the model's function unchanged and makes the channels large."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from conftest import cache_kwargs, fresh_tiny_model, tiny_prompt  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from flashcodec_fx.evaluate.outliers import add_outlier_channels  # noqa: E402


def _keys_values_logits(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=True, **cache_kwargs(cache)).logits
    return cache.layers[0].keys, cache.layers[0].values, logits


def test_outlier_channels_keep_the_function_and_grow_the_channels():
    model, ids = fresh_tiny_model("llama"), tiny_prompt(2, 20)
    k0, v0, before = _keys_values_logits(model, ids)
    add_outlier_channels(model, 16.0, key_channels=(1,), value_channels=(2,))
    k1, v1, after = _keys_values_logits(model, ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    d = k0.shape[-1]
    torch.testing.assert_close(k1[..., [1, 1 + d // 2]], 16 * k0[..., [1, 1 + d // 2]], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v1[..., 2], 16 * v0[..., 2], rtol=1e-4, atol=1e-4)
    others = [c for c in range(d) if c not in (1, 1 + d // 2)]
    torch.testing.assert_close(k1[..., others], k0[..., others], rtol=1e-4, atol=1e-5)


def test_outlier_channels_refuse_what_they_cannot_build():
    with pytest.raises(ValueError, match="factor must be a positive number"):
        add_outlier_channels(fresh_tiny_model("llama"), 0.0)
    with pytest.raises(ValueError, match="key_channels must lie in"):
        add_outlier_channels(fresh_tiny_model("llama"), 4.0, key_channels=(8,))
    with pytest.raises(ValueError, match="q_norm / k_norm"):
        add_outlier_channels(fresh_tiny_model("qwen3"), 4.0, key_channels=(1,), value_channels=(2,))
