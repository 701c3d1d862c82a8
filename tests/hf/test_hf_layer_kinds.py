"""Layer kinds beyond full and sliding attention (issue 40): hybrid Mamba + attention layers (Falcon-H1), chunked
attention (Llama 4), a model that builds its own cache (MiniMax), and models where nothing can be compressed (Mamba):
codec layers where attention K/V exist, ``lossless`` token-exact in a left-padded batch, and a ``NoCodecLayers``
warning (``strict=True``: an error) wherever nothing would be compressed."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import cache_kwargs  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.hf.flash_codec_cache import NoCodecLayers  # noqa: E402
from flashcodec_fx.hf.hybrid_layer import FlashCodecHybridLayer  # noqa: E402
from flashcodec_fx.hf.sliding_layer import FlashCodecSlidingLayer  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, pad_token_id=0)
CONFIGS = {
    "falcon_h1": dict(SMALL, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=32, mamba_d_ssm=128),
    "llama4_text": dict(SMALL, attention_chunk_size=8, no_rope_layers=[1, 0], num_local_experts=2,
                        intermediate_size_mlp=128),
    "minimax": dict(SMALL, block_size=16, num_local_experts=2, num_experts_per_tok=1),
}
CODEC_LAYERS = {  # the codec layer kinds each tiny model gets, by layer index
    "falcon_h1": {0: FlashCodecHybridLayer, 1: FlashCodecHybridLayer},
    "llama4_text": {0: FlashCodecSlidingLayer, 1: fx.FlashCodecLayer},  # chunked: a ring of the chunk; then full
    "minimax": {0: fx.FlashCodecLayer},  # layer 1 is lightning (linear) attention, in MiniMax's own linear_cache
}


def _model(model_type: str):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **CONFIGS[model_type])
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    ids[1, :20] = 0
    return ids, mask


def _generate(model, ids, mask):
    return model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_lossless_padded_batch_is_token_exact_with_codec_layers(model_type):
    model = _model(model_type)
    ids, mask = _padded_batch()
    reference = _generate(model, ids, mask).sequences
    fx.apply_flash_codec(model, preset="lossless")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", NoCodecLayers)
            out = _generate(model, ids, mask)
    finally:
        fx.remove_flash_codec(model)
    assert torch.equal(out.sequences, reference)
    cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
    kinds = CODEC_LAYERS[model_type]
    assert isinstance(cache, fx.FlashCodecCache) and cache.codec_layers == sorted(kinds)
    assert {i: type(cache.layers[i]) for i in kinds} == kinds
    assert 0 < cache.bits_per_value() <= 32


def test_a_lossy_hybrid_layer_compresses_and_keeps_its_linear_states():
    model = _model("falcon_h1")
    ids, mask = _padded_batch()
    fx.apply_flash_codec(model, preset="4bit", strict=True)  # strict: attention on the stored form, no fallback
    try:
        out = _generate(model, ids, mask)
    finally:
        fx.remove_flash_codec(model)
    cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
    assert cache.bits_per_value() < 16 and cache.storage_breakdown()["archive_used"] > 0  # codes, not raw rows
    layer = cache.layers[0]
    assert layer.get_seq_length() == 40 + 12 - 1
    parts = cache.storage_breakdown(per_layer=True)[0]
    assert parts["native"] == sum(t.nbytes for t in [*layer.conv_states.values(), *layer.recurrent_states.values()])


def test_nothing_to_compress_is_said_at_apply_time_and_strict_refuses():
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, state_size=8)
    model = transformers.MambaForCausalLM(config).eval()
    with pytest.warns(NoCodecLayers, match="compresses nothing.*2 linear_attention"):
        fx.apply_flash_codec(model, preset="4bit")
    fx.remove_flash_codec(model)
    with pytest.raises(ValueError, match="compresses nothing.*strict=True"):
        fx.apply_flash_codec(model, preset="4bit", strict=True)
    assert not hasattr(model, "_flashcodec_patch")  # refused: nothing changed
    with pytest.warns(NoCodecLayers):
        cache = fx.FlashCodecCache.from_config(config)
    for method in (cache.bits_per_value, cache.storage_breakdown, cache.storage_bytes):
        with pytest.raises(ValueError, match="compresses nothing"):
            method()


def test_a_saved_hybrid_cache_continues_exactly(tmp_path):
    """A hybrid cache saved after the prompt and loaded keeps both halves: the next tokens equal the original's."""
    model = _model("falcon_h1")
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    fx.apply_codec_attention(model)
    try:
        cache = fx.FlashCodecCache.from_config(model.config, preset="4bit")
        with torch.no_grad():
            model(ids, **cache_kwargs(cache), use_cache=True)
        cache.save(tmp_path / "hybrid.safetensors", model_or_config=model)
        loaded = fx.FlashCodecCache.load(tmp_path / "hybrid.safetensors", model)
        step = torch.tensor([[5]])
        with torch.no_grad():
            want = model(step, **cache_kwargs(cache), use_cache=True).logits
            got = model(step, **cache_kwargs(loaded), use_cache=True).logits
    finally:
        fx.remove_codec_attention(model)
    assert torch.equal(want, got)
    assert loaded.layers[0].get_seq_length() == 31 and loaded.layers[0].has_previous_state[0]
