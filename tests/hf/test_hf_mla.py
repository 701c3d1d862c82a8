"""Multi-head latent attention (DeepSeek-V3 style, issue 40): the latent row ``[c ; k_rot]`` is stored once per token
by every preset with the defaults, decode attends on it in the absorbed form (no per-head K/V of the history), and
``lossless`` gives the model's own tokens."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import cache_kwargs, output_cache  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.hf.mla_layer import FlashCodecMLALayer  # noqa: E402

RANK, ROPE = 32, 8
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=RANK, q_lora_rank=None, qk_rope_head_dim=ROPE,
              qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
              first_k_dense_replace=1, pad_token_id=0)


@pytest.fixture(scope="module")
def deepseek():
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**CONFIG)
    return transformers.DeepseekV3ForCausalLM(config).eval()


def _batch():
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :16] = 0
    ids[1, :16] = 0
    return ids, mask


def _generate(model, **options):
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    if not options:
        return model.generate(ids, **kwargs)
    fx.apply_flash_codec(model, **options)
    try:
        return model.generate(ids, **kwargs)
    finally:
        fx.remove_flash_codec(model)


def test_lossless_is_token_exact_in_a_padded_batch_and_in_beam_search(deepseek):
    ids, mask = _batch()
    for extra in ({}, {"num_beams": 2}):
        reference = deepseek.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                                      **extra)
        fx.apply_flash_codec(deepseek, preset="lossless")
        try:
            out = deepseek.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                                    **extra)
        finally:
            fx.remove_flash_codec(deepseek)
        assert torch.equal(out, reference), extra


@pytest.mark.parametrize("preset", ["int8", "4bit", "3bit", "2bit"])
def test_every_preset_stores_the_latent_row_with_the_defaults(deepseek, preset):
    out = _generate(deepseek, preset=preset, strict=True)  # strict: every decode step on the stored rows
    layers = output_cache(out).layers
    assert all(isinstance(layer, FlashCodecMLALayer) for layer in layers)
    assert all(layer.keys_stream.tail.shape[-1] == RANK + ROPE and layer.streams == (layer.keys_stream,)
               for layer in layers)
    assert output_cache(out).bits_per_value() < 16


def test_absorbed_attention_equals_the_model_attending_on_the_decoded_latents(deepseek):
    """The same stored codes read two ways: the absorbed form on the stored rows (the default), and the model's own
    attention over per-head K/V expanded from the decoded latents (``materialization_free=False``, no memo)."""
    same_rows = {"preset": "4bit", "raw_dtype": "stream"}
    absorbed = _generate(deepseek, **same_rows)
    expanded = _generate(deepseek, materialization_free=False, memoize=False, **same_rows)
    assert torch.equal(absorbed.sequences, expanded.sequences)
    torch.testing.assert_close(torch.stack(absorbed.logits), torch.stack(expanded.logits), rtol=1e-4, atol=1e-4)


def test_decode_steps_never_expand_the_history(deepseek):
    """The module expands what the cache update returns: on decode steps, only the step's own token."""
    expanded = []
    attention = [m for m in deepseek.modules() if hasattr(m, "expand_kv")]
    originals = [m.expand_kv for m in attention]
    for module, original in zip(attention, originals, strict=True):
        def spy(kv_nope, k_rot, original=original):
            expanded.append(kv_nope.shape[2])
            return original(kv_nope, k_rot)
        module.expand_kv = spy
    try:
        _generate(deepseek, preset="4bit", strict=True)
    finally:
        for module in attention:
            del module.expand_kv
    assert expanded[:len(attention)] == [48] * len(attention)  # the prompt, exact
    assert set(expanded[len(attention):]) == {1}


def test_an_mla_cache_saves_loads_and_crops(deepseek, tmp_path):
    fx.apply_codec_attention(deepseek)
    try:
        cache = fx.FlashCodecCache.from_config(deepseek.config, preset="4bit")
        ids = _batch()[0][:1]
        with torch.no_grad():
            deepseek(ids, **cache_kwargs(cache), use_cache=True)
        cache.save(tmp_path / "mla.safetensors", model_or_config=deepseek)
        loaded = fx.FlashCodecCache.load(tmp_path / "mla.safetensors", deepseek)
        step = torch.tensor([[7]])
        with torch.no_grad():
            want = deepseek(step, **cache_kwargs(cache), use_cache=True).logits
            got = deepseek(step, **cache_kwargs(loaded), use_cache=True).logits
        assert torch.equal(want, got)
        loaded.crop(-1)
        assert loaded.get_seq_length() == 48 and loaded.layers[0].keys.shape == (1, 1, 48, RANK)
        assert loaded.layers[0].values.shape == (1, 1, 48, ROPE)
    finally:
        fx.remove_codec_attention(deepseek)
