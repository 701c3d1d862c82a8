"""Configs whose attention head dim varies by layer (transformers' heterogeneous ``per_layer_config``: Gemma 4's
sliding layers take ``head_dim``, its full layers ``global_head_dim``): each codec layer is built for its own layer's
head dim (issue 40), where reading the global ``config.head_dim`` raises ``AmbiguousGlobalPerLayerAttributeError``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4TextConfig"):
    pytest.skip("this transformers has no Gemma 4", allow_module_level=True)

from tiny_models import cache_of, codec_greedy, greedy, padded_batch, same_logits, tiny_auto_model  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.hf.sliding_layer import FlashCodecSlidingLayer  # noqa: E402

GEMMA4 = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
              layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=128,
              hidden_size_per_layer_input=16)


def test_each_codec_layer_takes_its_own_layers_head_dim():
    config = transformers.Gemma4TextConfig(**GEMMA4)
    assert [layer.head_dim for layer in config.per_layer_config] == [16, 32]
    cache = fx.FlashCodecCache.from_config(config, preset="4bit")
    assert cache.codec_layers == [0, 1] and isinstance(cache.layers[0], FlashCodecSlidingLayer)
    narrow = transformers.Gemma4TextConfig(**{**GEMMA4, "global_head_dim": 12})  # 1-bit codes: a multiple of 8
    with pytest.raises(ValueError, match="layer 1 .*multiple of 8.*got 12"):
        fx.FlashCodecCache.from_config(narrow, preset="int8", quant_bits=1)


def test_lossless_padded_batch_is_exact_and_lossy_runs_on_the_stored_form():
    model = tiny_auto_model("gemma4_text", **GEMMA4)
    ids, mask = padded_batch()
    exact = codec_greedy(model, ids, mask, preset="lossless")  # the ring's window: sdpa over fewer keys, same tokens
    assert same_logits(exact, greedy(model, ids, mask), atol=1e-5)
    out = codec_greedy(model, ids, mask, preset="4bit", strict=True)
    cache = cache_of(out)
    assert [layer.keys_stream.tail.shape[-1] for layer in cache.layers] == [16, 32]
    assert cache.bits_per_value() < 16


@pytest.mark.skipif("dots3_note_text" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING,
                    reason="this transformers has no dots.llm3")
def test_an_mla_sliding_layer_is_a_ring_of_latent_rows():
    """dots.llm3: MLA on every layer, sliding-window layers among them (their head dim differs per layer): their
    latent rows live in a ring (FlashCodecSlidingMLALayer), attended on in the absorbed form."""
    from flashcodec_fx.evaluate.architectures import build_model
    from flashcodec_fx.hf.mla_layer import FlashCodecSlidingMLALayer

    model = build_model("dots3_note_text")
    ids, mask = padded_batch(length=40, pad=16)  # past the window of 8
    exact = codec_greedy(model, ids, mask, preset="lossless")
    assert same_logits(exact, greedy(model, ids, mask), atol=1e-5)
    assert isinstance(cache_of(exact).layers[2], FlashCodecSlidingMLALayer)
    stored = codec_greedy(model, ids, mask, preset="int8", strict=True, raw_dtype="stream")
    ring = cache_of(stored).layers[2]
    assert ring.dropped > 0 and ring.keys_stream.get_seq_length() <= 16  # the window's rows, and the next group's
    view = codec_greedy(model, ids, mask, preset="int8", materialization_free=False, memoize=False, raw_dtype="stream")
    assert torch.equal(stored.sequences, view.sequences)
    torch.testing.assert_close(torch.stack(stored.logits), torch.stack(view.logits), rtol=1e-4, atol=1e-4)
