"""Assisted and prompt-lookup decoding with every preset (issue 18.1) and the seed's block tiers (issue 32): per-token
codecs roll back exactly at any depth, block codecs reopen an archived group a crop cuts into (the default
``crop="decode"``), so ``is_croppable`` holds and transformers' speculative decoding runs; ``lossless`` and png give
the plain model's tokens; codec sliding rings record their past while a draft is verified. ``crop="exact"`` block
codecs are refused clearly. The block-tier tests follow transformers' own generation tests (assisted decoding with the
model as its own assistant and with another, prompt lookup, greedy equal to plain greedy, sampling, max_length), and
check the cache's length after every crop."""

from __future__ import annotations

import copy
import functools
import inspect
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from conftest import (  # noqa: E402
    VOCAB,
    cache_kwargs,
    char_tokenizer,
    fresh_tiny_model,
    output_cache,
    tiny_config,
    tiny_prompt,
)

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.hf.options import crop_count  # noqa: E402

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


RING_TIERS = {"lossless": dict(preset="lossless"), "int8": dict(preset="int8"), "3bit": dict(preset="3bit"),
              "png": dict(mode="png"), "jpeg": dict(mode="jpeg")}  # the last two: rings of 8-token groups


@pytest.mark.parametrize("tier", list(RING_TIERS))
def test_sliding_rings_record_their_past_while_drafts_are_verified(tier, monkeypatch):
    crops = _watch_crops(monkeypatch)
    main = fresh_tiny_model("gemma3", seed=0)
    ids = tiny_prompt(1, PROMPT)  # sliding window 12: the rings drop groups between verifications
    for kwargs in (dict(assistant_model=fresh_tiny_model("gemma3", seed=5)), dict(prompt_lookup_num_tokens=3)):
        fx.apply_flash_codec(main, **RING_TIERS[tier])
        try:
            out = _generate(main, ids, **kwargs)
        finally:
            fx.remove_flash_codec(main)
        assert output_cache(out).get_seq_length() == PROMPT + NEW - 1
        if tier in ("lossless", "png"):
            assert torch.equal(out.sequences, _generate(main, ids).sequences)
    assert crops["count"] > 0


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
                    "(a crop that would reopen a group still raises: test_exact_block_codec_crops_name_their_depth)")
def test_transformers_refuses_exact_crop_block_codecs_up_front():
    """jpeg r=8 int8 with crop="exact" archives groups of 8 tokens that a rejected draft could reopen, which that mode
    refuses: transformers refuses the cache before generating."""
    main = fresh_tiny_model("llama", seed=0)
    ids = tiny_prompt(1, PROMPT)
    fx.apply_flash_codec(main, mode="jpeg", block_size=8, quant_bits=8, crop="exact")
    try:
        with pytest.raises(ValueError, match="cache that can be cropped"):
            _generate(main, ids, prompt_lookup_num_tokens=3)
    finally:
        fx.remove_flash_codec(main)


def test_exact_block_codec_crops_name_their_depth():
    """With crop="exact" a block codec is not croppable; a crop that would reopen a group names its depth and changes
    nothing. The default reopens it."""
    main = fresh_tiny_model("llama", seed=0)
    cache = fx.FlashCodecCache.from_config(main.config, mode="jpeg", block_size=8, quant_bits=8, crop="exact")
    assert not cache.is_croppable
    k = torch.randn(1, 2, PROMPT, 16)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match=r"a crop of 3 tokens \(to 37\) would reopen archived tokens 32\.\.36"):
        cache.crop(-3)
    assert cache.get_seq_length() == PROMPT
    reopening = fx.FlashCodecCache.from_config(main.config, mode="jpeg", block_size=8, quant_bits=8)
    reopening.update(k, k, 0)
    assert reopening.is_croppable
    reopening.crop(-3)
    assert reopening.get_seq_length() == PROMPT - 3


# ------------------------------------------------------------------------------ the seed's block tiers (issue 32)

SEED_TIERS = {"png": dict(mode="png"), "jpeg": dict(mode="jpeg"),  # lossless png; jpeg r=8 int8
              "jpeg-k2": dict(mode="jpeg", keep_freqs=2, quant_bits=None)}  # 2 of 8 DCT coefficients, unquantized


def _watch_crops(monkeypatch) -> dict:
    """Check every ``FlashCodecCache.crop`` (the main model's and a codec assistant's): afterwards every layer holds the
    length the crop asked for, both streams of a codec layer agree with it (the device length too), and a codec layer
    is still croppable. Returns the counts: ``count`` crops that dropped tokens, ``archive`` of them cut into an
    archived group (reopening it, or ending at its start)."""
    counts = {"count": 0, "archive": 0}
    crop = fx.FlashCodecCache.crop

    def checked(self, tokens_to_remove):
        n, before = crop_count(tokens_to_remove), self.get_seq_length()
        keep = max(0, before + n) if n <= 0 else min(n, before)
        codec = [self.layers[i] for i in self.codec_layers]
        archived = [(layer.keys_stream.archived_tokens, layer.values_stream.archived_tokens) for layer in codec]
        crop(self, tokens_to_remove)
        assert all(layer.get_seq_length() == keep for layer in self.layers)
        for layer in codec:
            assert layer.is_croppable
            streams = (layer.keys_stream, layer.values_stream)
            for stream in streams:
                if stream.state is not None:
                    assert int(stream.length) == stream.get_seq_length() == keep - getattr(layer, "dropped", 0)
        counts["count"] += keep < before
        counts["archive"] += any((layer.keys_stream.archived_tokens, layer.values_stream.archived_tokens) != was
                                 for layer, was in zip(codec, archived, strict=True))

    monkeypatch.setattr(fx.FlashCodecCache, "crop", checked)
    return counts


def _assisted_kwargs(mode: str, assistant) -> dict:
    return {"self": dict(assistant_model=None), "other": dict(assistant_model=assistant),
            "both": dict(assistant_model=assistant), "lookup": dict(prompt_lookup_num_tokens=3)}[mode]


def _run(main, assistant, options: dict, mode: str, ids, **kwargs):
    """``generate`` with the codec of ``options`` on the main model (and on the assistant for ``"both"``)."""
    spec = _assisted_kwargs(mode, assistant)
    if mode == "self":
        spec["assistant_model"] = main
    fx.apply_flash_codec(main, **options)
    if mode == "both":
        fx.apply_flash_codec(assistant, **options)
    try:
        return _generate(main, ids, **spec, **kwargs)
    finally:
        fx.remove_flash_codec(main)
        if mode == "both":
            fx.remove_flash_codec(assistant)


@pytest.mark.parametrize("dtype,mode", CASES)
@pytest.mark.parametrize("tier", list(SEED_TIERS))
def test_the_seeds_block_tiers_run_speculative_decoding(tier, dtype, mode, monkeypatch):
    """The seed's png and jpeg tiers (8-token groups) are croppable; a rejected draft that cuts into an archived group
    reopens it. png in fp32 gives the plain model's tokens (assisted or not: its reads are within fp rounding of the
    tokens given, far below any logit gap here)."""
    crops = _watch_crops(monkeypatch)
    main, assistant = _models(dtype)
    ids = tiny_prompt(1, PROMPT)
    out = _run(main, assistant, SEED_TIERS[tier], mode, ids)
    cache = output_cache(out)
    assert isinstance(cache, fx.FlashCodecCache) and cache.is_croppable
    assert out.sequences.shape[1] == PROMPT + NEW and cache.get_seq_length() == PROMPT + NEW - 1
    if mode in ("other", "both"):  # the other assistant's drafts are mostly rejected: crops reach into the archive
        assert crops["archive"] > 0
    if tier == "png" and dtype == "float32":
        assert torch.equal(out.sequences, _generate(main, ids).sequences)


@pytest.mark.parametrize("mode", ["self", "other", "lookup"])
def test_png_speculative_decoding_matches_greedy_search(mode, monkeypatch):
    """As transformers' test_assisted_decoding_matches_greedy_search / test_prompt_lookup_decoding_matches_greedy_search:
    png's assisted tokens and logits equal plain greedy decoding's (fp32: logits within 1e-4), with crops into the
    archive along the way."""
    crops = _watch_crops(monkeypatch)
    main, assistant = _models("float32")
    ids = tiny_prompt(1, PROMPT)
    kw = dict(output_logits=True, output_scores=True)
    plain = _generate(main, ids, **kw)
    out = _run(main, assistant, SEED_TIERS["png"], mode, ids, **kw)
    assert torch.equal(out.sequences, plain.sequences) and len(out.logits) == len(plain.logits) == NEW
    for ours, theirs in zip(out.logits, plain.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    assert crops["count"] > 0 or mode == "self"  # the model as its own assistant: every draft accepted


@pytest.mark.parametrize("mode", ["other", "both", "lookup"])
@pytest.mark.parametrize("tier", list(SEED_TIERS))
def test_speculative_decoding_with_block_tiers_stops_at_max_length(tier, mode, monkeypatch):
    """Drafts longer than what max_length leaves are cut: the sequence ends at max_length, the cache one token short
    (the last token is never fed back)."""
    crops = _watch_crops(monkeypatch)
    main, assistant = _models("float32")
    ids = tiny_prompt(1, PROMPT)
    extra = dict(num_assistant_tokens=10) if mode != "lookup" else dict(prompt_lookup_num_tokens=10)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*generation_config.*")
        spec = {**_assisted_kwargs(mode, assistant), **extra}
        fx.apply_flash_codec(main, **SEED_TIERS[tier])
        if mode == "both":
            fx.apply_flash_codec(assistant, **SEED_TIERS[tier])
        try:
            out = main.generate(ids, max_length=PROMPT + 7, do_sample=False, return_dict_in_generate=True, **spec)
        finally:
            fx.remove_flash_codec(main)
            if mode == "both":
                fx.remove_flash_codec(assistant)
    assert out.sequences.shape[1] == PROMPT + 7
    assert output_cache(out).get_seq_length() == PROMPT + 6
    assert crops["count"] > 0 or mode == "lookup"  # a random prompt offers few n-gram matches


@pytest.mark.parametrize("tier", list(SEED_TIERS))
def test_assisted_sampling_with_block_tiers(tier, monkeypatch):
    """As transformers' test_assisted_decoding_sample: sampling with an assistant keeps the shapes and the cache."""
    crops = _watch_crops(monkeypatch)
    main, assistant = _models("float32")
    ids = tiny_prompt(1, PROMPT)
    fx.apply_flash_codec(main, **SEED_TIERS[tier])
    fx.apply_flash_codec(assistant, **SEED_TIERS[tier])
    torch.manual_seed(0)
    try:
        with torch.no_grad():
            out = main.generate(ids, max_new_tokens=NEW, do_sample=True, assistant_model=assistant,
                                output_scores=True, return_dict_in_generate=True)
    finally:
        fx.remove_flash_codec(main)
        fx.remove_flash_codec(assistant)
    assert out.sequences.shape == (1, PROMPT + NEW) and len(out.scores) == NEW
    assert output_cache(out).get_seq_length() == PROMPT + NEW - 1 and crops["count"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_png_beam_search_then_crops_into_the_archive_are_exact_and_repeatable(dtype):
    """The seed's beam search + crop exactness against the unpatched model: png beam search gives the plain model's
    beams; a crop that reopens an archived group of every beam row keeps what the beams read, layer 0 (whose keys and
    values do not depend on attention) equals the plain cache cropped alike, new tokens get the plain cache's logits,
    and cropping and feeding them again gives the same cache and logits (bf16: bitwise, an exact rollback; fp32:
    within fp rounding)."""
    model = fresh_tiny_model("llama", seed=0).to(dtype)
    ids = tiny_prompt(1, 12)
    kw = dict(num_beams=3, max_new_tokens=9, do_sample=False, return_dict_in_generate=True)
    plain = model.generate(ids, **kw)
    reference = output_cache(plain)
    fresh = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(9))
    fx.apply_flash_codec(model, mode="png")
    try:
        out = model.generate(ids, **kw)
        cache = output_cache(out)
        assert torch.equal(out.sequences, plain.sequences) and cache.get_seq_length() == 20
        before = [(layer.keys, layer.values) for layer in cache.layers]
        cache.crop(-7)  # to 13: reopens the group of positions 8..15 (the archive held 0..15)
        reference.crop(-7)
        assert cache.get_seq_length() == 13 and cache.layers[0].keys_stream.archived_tokens == 8
        for layer, (keys, values) in zip(cache.layers, before, strict=True):
            assert torch.equal(layer.keys, keys[:, :, :13]) and torch.equal(layer.values, values[:, :, :13])
        with torch.no_grad():
            logits = model(fresh, **cache_kwargs(cache)).logits
            fed = copy.deepcopy(cache)
            cache.crop(-7)
            again = model(fresh, **cache_kwargs(cache)).logits
    finally:
        fx.remove_flash_codec(model)
    with torch.no_grad():
        expected = model(fresh, **cache_kwargs(reference)).logits
    exact = dtype == torch.bfloat16
    ours, theirs = cache.layers[0], reference.layers[0]
    if exact:
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert torch.equal(again, logits)
        assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                   for a, b in zip(cache.layers, fed.layers, strict=True))
    else:
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(again, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, expected, rtol=0, atol=5e-2 if exact else 1e-4)
