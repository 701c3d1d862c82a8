"""Materialization-free eager decoding through the "kvcodec" attention implementation."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from conftest import cache_kwargs, fresh_tiny_model, output_cache, tiny_prompt  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.hf import attention as codec_attention  # noqa: E402

NEW = 10


def _generate(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, **kwargs)


@pytest.fixture
def decode_calls(monkeypatch):
    """Counts the coefficient-domain attention calls made by the attention function."""
    calls = []
    real = codec_attention.stored_form_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(codec_attention, "stored_form_attention", counting)
    return calls


@pytest.mark.parametrize(("family", "options"), [
    # lossy: a window of one token keeps each step's own token raw in the view too (the stored-form path reads the
    # call's tokens exactly; the memoized view reads them as stored), so both paths attend on the same values
    ("llama", dict(mode="png")), ("gemma3", dict(mode="png")), ("llama", dict(keep_freqs=4, window=1)),
    ("qwen3", dict(mode="png", layout="static", max_cache_len=12 + NEW)),
], ids=["llama-png", "gemma3-png", "llama-jpeg4", "qwen3-png-static"])
def test_materialization_free_tokens_equal_the_materialized_path(family, options, decode_calls):
    model = fresh_tiny_model(family)
    ids = tiny_prompt(1, 12)
    kw = dict(output_logits=True)
    view = fx.FlashCodecCache.from_config(model.config, materialization_free=False, **options)
    materialized = _generate(model, ids, **cache_kwargs(view), **kw)
    fx.apply_flash_codec(model, materialization_free=True, **options)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", fx.MaterializationFreeFallback)
            out = _generate(model, ids, **kw)
    finally:
        fx.remove_flash_codec(model)
    assert torch.equal(out.sequences, materialized.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(materialized.logits), rtol=0, atol=1e-4)
    cache = output_cache(out)
    assert len(decode_calls) == (NEW - 1) * len(cache.codec_layers)  # every decode step of every codec layer
    assert all(shape[2] == 1 for shape in decode_calls)
    assert cache.storage_breakdown()["memo"] == 0  # no decoded view is kept


def test_without_the_attention_function_it_falls_back_or_raises():
    model = fresh_tiny_model("llama")
    ids = tiny_prompt(1, 12)
    reference = _generate(model, ids).sequences
    cache = fx.FlashCodecCache.from_config(model.config, mode="png", materialization_free=True)
    with pytest.warns(fx.MaterializationFreeFallback, match="apply_codec_attention"):
        out = _generate(model, ids, **cache_kwargs(cache))
    assert torch.equal(out.sequences, reference)
    strict = fx.FlashCodecCache.from_config(model.config, mode="png", materialization_free=True, strict=True)
    with pytest.raises(RuntimeError, match="apply_codec_attention"):
        _generate(model, ids, **cache_kwargs(strict))


def test_unsupported_decode_steps_fall_back_or_raise_under_strict():
    model = fresh_tiny_model("llama", attn_implementation="eager")
    ids = tiny_prompt(1, 12)
    kw = dict(output_attentions=True)
    reference = _generate(model, ids, **kw).sequences
    fx.apply_codec_attention(model)
    assert model.config._attn_implementation == "kvcodec_eager"  # over the model's eager implementation
    try:
        cache = fx.FlashCodecCache.from_config(model.config, mode="png", materialization_free=True)
        with pytest.warns(fx.MaterializationFreeFallback, match="output_attentions"):
            out = _generate(model, ids, **cache_kwargs(cache), **kw)
        assert torch.equal(out.sequences, reference)
        strict = fx.FlashCodecCache.from_config(model.config, mode="png", materialization_free=True, strict=True)
        with pytest.raises(NotImplementedError, match="output_attentions"):
            _generate(model, ids, **cache_kwargs(strict), **kw)
    finally:
        fx.remove_codec_attention(model)
    assert model.config._attn_implementation == "eager"


def test_apply_codec_attention_needs_sdpa_or_eager():
    model = fresh_tiny_model("llama")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation"):
        fx.apply_codec_attention(model)


def test_decorator_with_materialization_free(decode_calls):
    base = fresh_tiny_model("qwen3")
    ids = tiny_prompt(1, 12)
    reference = _generate(base, ids).sequences
    cls = fx.compress_kv(mode="png", materialization_free=True)(type("CodecQwen3", (type(base),), {}))
    model = cls(base.config).eval()
    model.load_state_dict(base.state_dict())
    out = _generate(model, ids)
    assert torch.equal(out.sequences, reference) and model.config._attn_implementation == "kvcodec"
    assert len(decode_calls) == (NEW - 1) * 2
    fx.remove_codec_attention(model)
    fx.remove_flash_codec(cls)
