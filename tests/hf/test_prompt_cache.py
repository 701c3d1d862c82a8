"""Prompt-cache reuse (issue 21): several requests continued from one loaded prefix through ``FlashCodecCache.fork``
give the tokens of transformers' recipe (``copy.deepcopy`` of a prefilled ``DynamicCache``) on the lossless preset, and
of a deep copy of the same FlashCodecCache on every preset; forks share the prefix's archive until they write one, and
the prefix itself never changes."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from cache_state import same, snapshot  # noqa: E402
from conftest import cache_kwargs, fresh_tiny_model, tiny_prompt  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.hf import apply_codec_attention  # noqa: E402

PREFIX = tiny_prompt(1, 48)  # past the lossy presets' raw prefix (lossless holds it raw: 64 tokens)
REQUESTS = [tiny_prompt(1, n, seed=10 + n) for n in (1, 3, 6)]


def generate(model, request: torch.Tensor, cache) -> torch.Tensor:
    ids = torch.cat([PREFIX, request], dim=1)
    return model.generate(ids, max_new_tokens=6, do_sample=False, **cache_kwargs(cache))


def prefilled(model, cache):
    with torch.no_grad():
        model(PREFIX, use_cache=True, **cache_kwargs(cache))
    return cache


def streams(cache) -> list:
    return [s for layer in cache.layers if isinstance(layer, fx.FlashCodecLayer)
            for s in (layer.keys_stream, layer.values_stream)]


def archive_ptrs(cache) -> set[int]:
    return {t.data_ptr() for s in streams(cache) for t in s.state[:4] if t.numel()}


def shares_archive(a, b) -> bool:
    return a.state.data.data_ptr() == b.state.data.data_ptr()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_loaded_prefix_serves_requests_as_deep_copies_of_a_dynamic_cache(tmp_path, family):
    model = fresh_tiny_model(family)
    prompt_cache = prefilled(model, DynamicCache(config=model.config))
    expected = [generate(model, r, copy.deepcopy(prompt_cache)) for r in REQUESTS]
    apply_codec_attention(model)
    path = prefilled(model, fx.FlashCodecCache.from_config(model.config, preset="lossless")).save(tmp_path / "p.fc")
    loaded = fx.FlashCodecCache.load(path, model)
    before = [snapshot(layer) for layer in loaded.layers if isinstance(layer, fx.FlashCodecLayer)]
    for request, want in zip(REQUESTS, expected, strict=True):
        assert torch.equal(generate(model, request, loaded.fork()), want)
    after = [snapshot(layer) for layer in loaded.layers if isinstance(layer, fx.FlashCodecLayer)]
    assert all(same(a, b) for a, b in zip(before, after, strict=True))  # the prefix is never written


@pytest.mark.parametrize("preset", ["int8", "4bit"])
def test_forks_equal_deep_copies_and_share_the_archive(preset):
    model = fresh_tiny_model("llama")
    apply_codec_attention(model)
    prefix = prefilled(model, fx.FlashCodecCache.from_config(model.config, preset=preset))
    expected = [generate(model, r, copy.deepcopy(prefix)) for r in REQUESTS]
    forks = [prefix.fork() for _ in REQUESTS]
    assert all(archive_ptrs(f) == archive_ptrs(prefix) for f in forks)  # nothing copied yet
    for request, child, want in zip(REQUESTS, forks, expected, strict=True):
        assert torch.equal(generate(model, request, child), want)
    for child in forks:  # a stream that archived a group (or grew its archive) copied it; any other still shares it
        for theirs, ours in zip(streams(prefix), streams(child), strict=True):
            grew = ours.state.data.shape[2] != theirs.state.data.shape[2]
            assert shares_archive(theirs, ours) == (not grew and ours.archived_tokens == theirs.archived_tokens)


def test_fork_is_refused_in_the_middle_of_a_step():
    model = fresh_tiny_model("llama")
    apply_codec_attention(model)
    cache = prefilled(model, fx.FlashCodecCache.from_config(model.config, preset="int8"))
    layer = cache.layers[0]
    layer.update(*(torch.zeros(1, 2, 1, 16) for _ in range(2)))  # handed to attention, not read yet
    with pytest.raises(ValueError, match="middle of a step"):
        cache.fork()
