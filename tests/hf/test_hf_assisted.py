"""Assisted and prompt-lookup decoding with every preset (issue 18.1): per-token codecs roll back exactly at any
depth, so ``is_croppable`` holds and transformers' speculative decoding runs; ``lossless`` gives the plain model's
tokens; codec sliding rings record their past while a draft is verified. Block codecs are refused clearly."""

from __future__ import annotations

import functools
import inspect
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from conftest import VOCAB, char_tokenizer, fresh_tiny_model, output_cache, tiny_config, tiny_prompt  # noqa: E402

import flashcodec_fx as fx  # noqa: E402

NEW = 20
PROMPT = 40  # past every preset's sinks and most windows: drafts are verified against archived codes
MODES = ("self", "other", "both", "lookup")  # assistant = main model; plain assistant; assistant with the codec too
# fp32: every mode; bf16: the assistant with the codec and prompt lookup (the same crops as the other two)
CASES = [("float32", mode) for mode in MODES] + [("bfloat16", "both"), ("bfloat16", "lookup")]


@functools.cache
def _models(dtype: str):
    return fresh_tiny_model("llama", seed=0).to(getattr(torch, dtype)), \
        fresh_tiny_model("llama", seed=5).to(getattr(torch, dtype))


def _generate(model, ids, **kwargs):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*generation_config.*")
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, **kwargs)


def _assisted(main, assistant, preset: str, mode: str, ids):
    kwargs = {"self": dict(assistant_model=main), "other": dict(assistant_model=assistant),
              "both": dict(assistant_model=assistant), "lookup": dict(prompt_lookup_num_tokens=3)}[mode]
    fx.apply_flash_codec(main, preset=preset)
    if mode == "both":
        fx.apply_flash_codec(assistant, preset=preset)
    try:
        return _generate(main, ids, **kwargs)
    finally:
        fx.remove_flash_codec(main)
        if mode == "both":
            fx.remove_flash_codec(assistant)


@pytest.mark.parametrize("dtype,mode", CASES)
@pytest.mark.parametrize("preset", list(fx.PRESETS))
def test_speculative_decoding_runs_with_every_preset(preset, dtype, mode):
    main, assistant = _models(dtype)
    ids = tiny_prompt(1, PROMPT)
    out = _assisted(main, assistant, preset, mode, ids)
    cache = output_cache(out)
    assert isinstance(cache, fx.FlashCodecCache) and cache.is_croppable
    assert out.sequences.shape[1] == PROMPT + NEW
    assert cache.get_seq_length() == PROMPT + NEW - 1  # the last token is never fed back
    if preset == "lossless":
        assert torch.equal(out.sequences, _generate(main, ids).sequences)


@pytest.mark.parametrize("preset", ["lossless", "int8", "3bit"])
def test_sliding_rings_record_their_past_while_drafts_are_verified(preset):
    main = fresh_tiny_model("gemma3", seed=0)
    ids = tiny_prompt(1, PROMPT)  # sliding window 12: the rings drop groups between verifications
    for kwargs in (dict(assistant_model=fresh_tiny_model("gemma3", seed=5)), dict(prompt_lookup_num_tokens=3)):
        fx.apply_flash_codec(main, preset=preset)
        try:
            out = _generate(main, ids, **kwargs)
        finally:
            fx.remove_flash_codec(main)
        assert output_cache(out).get_seq_length() == PROMPT + NEW - 1
        if preset == "lossless":
            assert torch.equal(out.sequences, _generate(main, ids).sequences)


@pytest.mark.parametrize("preset", ["lossless", "3bit"])
def test_universal_assisted_decoding_with_another_tokenizer(preset):
    """The assistant tokenizes differently: transformers re-tokenizes the text between the models and crops the
    assistant's cache wherever the retokenization diverges (any depth)."""
    from transformers import LlamaForCausalLM

    main = fresh_tiny_model("llama", seed=0)
    config = tiny_config("llama")
    config.vocab_size = VOCAB - 56
    torch.manual_seed(5)
    assistant = LlamaForCausalLM(config).eval()
    ids = tiny_prompt(1, PROMPT)
    kwargs = dict(assistant_model=assistant, tokenizer=char_tokenizer(), assistant_tokenizer=char_tokenizer(VOCAB - 56))
    fx.apply_flash_codec(main, preset=preset)
    fx.apply_flash_codec(assistant, preset=preset)
    try:
        out = _generate(main, ids, **kwargs)
    finally:
        fx.remove_flash_codec(main)
        fx.remove_flash_codec(assistant)
    assert output_cache(out).get_seq_length() == PROMPT + NEW - 1
    if preset == "lossless":
        assert torch.equal(out.sequences, _generate(main, ids).sequences)


def _refuses_uncroppable_caches() -> bool:
    """Whether this transformers checks ``is_croppable`` before assisted decoding (5.2x; 5.17 crops unchecked)."""
    from transformers.generation.utils import GenerationMixin

    return "is_croppable" in inspect.getsource(GenerationMixin._assisted_decoding)


@pytest.mark.skipif(not _refuses_uncroppable_caches(), reason="this transformers does not check is_croppable up front "
                    "(a crop that would reopen a group still raises: test_block_codec_crops_name_their_depth)")
def test_transformers_refuses_block_codecs_up_front():
    """jpeg r=8 int8 archives groups of 8 tokens: a rejected draft could reopen one, so transformers refuses it."""
    main = fresh_tiny_model("llama", seed=0)
    ids = tiny_prompt(1, PROMPT)
    fx.apply_flash_codec(main, mode="jpeg", block_size=8, quant_bits=8)
    try:
        with pytest.raises(ValueError, match="cache that can be cropped"):
            _generate(main, ids, prompt_lookup_num_tokens=3)
    finally:
        fx.remove_flash_codec(main)


def test_block_codec_crops_name_their_depth():
    """A block codec is not croppable; a crop that would reopen a group names its depth and changes nothing."""
    main = fresh_tiny_model("llama", seed=0)
    cache = fx.FlashCodecCache.from_config(main.config, mode="jpeg", block_size=8, quant_bits=8)
    assert not cache.is_croppable
    k = torch.randn(1, 2, PROMPT, 16)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match=r"a crop of 3 tokens \(to 37\) would reopen archived tokens 32\.\.36"):
        cache.crop(-3)
    assert cache.get_seq_length() == PROMPT
