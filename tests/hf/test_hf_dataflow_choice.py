"""Models the ``"kvcodec"`` attention cannot serve run with ``apply_flash_codec(model, preset=...)`` alone (issue 40):
a model whose attention modules do not call transformers' attention interface (GPT-Neo) attends on the decoded view,
chosen at apply time and announced once (``MaterializationFreeFallback``; ``strict=True`` raises there); a model whose
forward takes no cache (OpenAI GPT) compresses nothing, said with ``NoCodecLayers``; a model that stores a learned
prefix beside the prompt (CPM-Ant) keeps its padded batch exact."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from tiny_models import (  # noqa: E402
    apply_saying,
    cache_of,
    codec_greedy,
    flashcodec_warnings,
    greedy,
    padded_batch,
    same_logits,
    tiny_auto_model,
)

import flashcodec_fx as fx  # noqa: E402

CONFIGS = {
    "gpt_neo": dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                    attention_types=[[["global", "local"], 1]], window_size=8, max_position_embeddings=128),
    "openai-gpt": dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128),
    "cpmant": dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, dim_head=16,
                   dim_ff=128, prompt_length=4, init_std=0.02),
}


def _model(model_type: str):
    return tiny_auto_model(model_type, **CONFIGS[model_type])


def _names(caught) -> list[str]:
    return [type(w.message).__name__ for w in caught]


def test_a_model_without_the_attention_interface_attends_on_the_view_announced_at_apply_time():
    model = _model("gpt_neo")
    ids, mask = padded_batch()
    reference = greedy(model, ids, mask)
    apply_saying(model, "MaterializationFreeFallback", "decoded view", preset="lossless")
    assert model.config._attn_implementation == "eager"
    try:
        (out, again), caught = flashcodec_warnings(lambda: (greedy(model, ids, mask), greedy(model, ids, mask)))
    finally:
        fx.remove_flash_codec(model)
    assert caught == []  # said once, at apply time
    assert same_logits(out, reference) and same_logits(again, reference)
    cache = cache_of(out)
    assert cache.codec_layers == [0, 1] and not any(layer.materialization_free for layer in cache.layers)


def test_a_lossy_preset_on_the_view_compresses():
    model = _model("gpt_neo")
    ids, mask = padded_batch()
    with pytest.warns(fx.MaterializationFreeFallback):
        out = codec_greedy(model, ids, mask, preset="4bit")
    assert cache_of(out).bits_per_value() < 16


def test_strict_refuses_at_apply_time_and_changes_nothing():
    model = _model("gpt_neo")
    with pytest.raises(ValueError, match="does not support switching.*strict=True"):
        fx.apply_flash_codec(model, preset="4bit", strict=True)
    assert not hasattr(model, "_flashcodec_patch") and model.config._attn_implementation == "eager"


def test_compress_kv_announces_the_view_on_an_instances_first_generate_only():
    cls = fx.compress_kv(preset="int8")(type("TinyNeo", (transformers.GPTNeoForCausalLM,), {}))
    model = cls(_model("gpt_neo").config).eval()
    ids, mask = padded_batch()
    (first, second), caught = flashcodec_warnings(lambda: (greedy(model, ids, mask), greedy(model, ids, mask)))
    assert _names(caught) == ["MaterializationFreeFallback"]
    assert isinstance(cache_of(first), fx.FlashCodecCache) and isinstance(cache_of(second), fx.FlashCodecCache)


def test_a_model_that_takes_no_cache_says_it_compresses_nothing():
    model = _model("openai-gpt")
    ids, mask = padded_batch()
    reference = greedy(model, ids, mask)
    apply_saying(model, "NoCodecLayers", "takes no KV cache", preset="int8")
    try:
        assert same_logits(greedy(model, ids, mask), reference)
    finally:
        fx.remove_flash_codec(model)
    with pytest.raises(ValueError, match="takes no KV cache.*strict=True"):
        fx.apply_flash_codec(model, preset="int8", strict=True)


def test_a_stored_prefix_beside_the_prompt_keeps_the_padded_batch_exact():
    """CPM-Ant stores its learned prompt prefix before the prompt's tokens: the padding mask cannot be placed on its
    positions, so nothing is zeroed (zeroing by the mask's positions would hit the prefix)."""
    model = _model("cpmant")
    ids, mask = padded_batch()
    reference = greedy(model, ids, mask)
    with pytest.warns(fx.MaterializationFreeFallback):
        out = codec_greedy(model, ids, mask, preset="lossless")
    assert same_logits(out, reference)
