"""``FlashCodecCache.save`` / ``load`` (issue 21): a loaded cache is bitwise the saved one and continues generation
with the same tokens (every preset, dynamic and static layouts, sliding rings, native layers of hybrid models,
batch > 1); a file for another model, dtype or weights, or a damaged file, raises ValueError and builds nothing."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from cache_state import same, snapshot  # noqa: E402
from conftest import cache_kwargs, fresh_tiny_model, tiny_config, tiny_prompt  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.hf import apply_codec_attention, cache_file  # noqa: E402
from flashcodec_fx.hf.sliding_layer import FlashCodecSlidingLayer  # noqa: E402
from flashcodec_fx.presets import PRESETS  # noqa: E402

COMPRESSIONS = ("raw", "zstd", "ppmd")


def prefilled(model, preset: str = "int8", layout: str = "dynamic", batch: int = 2, length: int = 20, **options):
    static = dict(layout="static", max_cache_len=64) if layout == "static" else {}
    cache = fx.FlashCodecCache.from_config(model.config, preset=preset, **static, **options)
    with torch.no_grad():
        model(tiny_prompt(batch, length), use_cache=True, **cache_kwargs(cache))
    return cache


def continued(model, cache, batch: int = 2, length: int = 20) -> torch.Tensor:
    ids = torch.cat([tiny_prompt(batch, length), tiny_prompt(batch, 2, seed=7)], dim=1)
    return model.generate(ids, max_new_tokens=4, do_sample=False, **cache_kwargs(cache))


def codec_state(cache) -> list:
    """Every codec layer's state, rings as their next update leaves them (what a file holds)."""
    cache = copy.deepcopy(cache)
    for layer in cache.layers:
        if isinstance(layer, FlashCodecSlidingLayer):
            layer.slide()
    return [snapshot(layer) for layer in cache.layers if isinstance(layer, fx.FlashCodecLayer)]


def native_tensors(cache) -> list:
    return [t for layer in cache.layers if not isinstance(layer, fx.FlashCodecLayer)
            for t in vars(layer).values() if isinstance(t, torch.Tensor)]


CASES = [("llama", preset, "dynamic") for preset in sorted(PRESETS)] + \
        [("llama", "lossless", "static"), ("llama", "4bit", "static"), ("gemma3", "4bit", "dynamic"),
         ("gemma3", "lossless", "static"), ("hybrid", "int8", "dynamic"), ("hybrid", "lossless", "static")]


@pytest.mark.parametrize(("family", "preset", "layout"), CASES)
def test_loaded_cache_is_bitwise_and_continues_with_the_same_tokens(tmp_path, family, preset, layout):
    model = fresh_tiny_model(family)
    apply_codec_attention(model)
    cache = prefilled(model, preset, layout)
    compression = COMPRESSIONS[len(tmp_path.name) % 3]  # every compression over the cases
    cache.save(tmp_path / "prompt.fc", compression=compression)
    loaded = fx.FlashCodecCache.load(tmp_path / "prompt.fc", model)
    assert all(same(a, b) for a, b in zip(codec_state(loaded), codec_state(cache), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(native_tensors(loaded), native_tensors(cache), strict=True))
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in cache.layers]
    assert torch.equal(continued(model, loaded), continued(model, copy.deepcopy(cache)))


def test_sliding_ring_that_dropped_groups_round_trips(tmp_path):
    model = fresh_tiny_model("gemma3")  # sliding window 12: the second call drops the ring's oldest groups
    apply_codec_attention(model)
    cache = prefilled(model, "int8", length=30)
    with torch.no_grad():
        model(tiny_prompt(2, 10, seed=3), use_cache=True, **cache_kwargs(cache))
    assert any(getattr(layer, "dropped", 0) for layer in cache.layers)
    cache.save(tmp_path / "c.fc")
    loaded = fx.FlashCodecCache.load(tmp_path / "c.fc", model)
    assert all(same(a, b) for a, b in zip(codec_state(loaded), codec_state(cache), strict=True))
    rings = [(ours, theirs) for ours, theirs in zip(loaded.layers, cache.layers, strict=True)
             if isinstance(ours, FlashCodecSlidingLayer)]
    assert all(ours.dropped >= theirs.dropped and ours._drop_target() == ours.dropped for ours, theirs in rings)
    assert any(ours.dropped > theirs.dropped for ours, theirs in rings)  # the file left out what the ring would drop
    assert torch.equal(continued(model, loaded, length=40), continued(model, copy.deepcopy(cache), length=40))


def test_cache_attending_on_its_view_keeps_its_memo(tmp_path):
    model = fresh_tiny_model("llama")
    cache = prefilled(model, "4bit", materialization_free=False, length=64)  # past the raw prefix: a memo is kept
    cache.save(tmp_path / "c.fc", compression="zstd")
    loaded = fx.FlashCodecCache.load(tmp_path / "c.fc", model.config)
    for ours, theirs in zip(loaded.layers, cache.layers, strict=True):
        assert torch.equal(ours.keys_stream.memo, theirs.keys_stream.memo)
    assert torch.equal(continued(model, loaded, length=64), continued(model, copy.deepcopy(cache), length=64))


def test_lossless_compression_is_smaller_than_raw(tmp_path):
    model = fresh_tiny_model("llama")
    cache = prefilled(model, "lossless", length=64)
    sizes = {c: cache.save(tmp_path / f"{c}.fc", compression=c).stat().st_size for c in COMPRESSIONS}
    assert sizes["ppmd"] < sizes["zstd"] < sizes["raw"]


@pytest.fixture
def saved(tmp_path):
    model = fresh_tiny_model("llama")
    path = prefilled(model).save(tmp_path / "c.fc", model_or_config=model)
    return model, path


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if load constructs a cache."""
    def refuse(*args, **kwargs):
        raise AssertionError("load built a cache before refusing the file")

    monkeypatch.setattr(cache_file, "FlashCodecCache", refuse)


def test_other_model_config_is_refused(saved, nothing_built):
    _, path = saved
    other = tiny_config("llama")
    other.num_key_value_heads = 1
    with pytest.raises(ValueError, match="num_key_value_heads: file 2, model 1"):
        fx.FlashCodecCache.load(path, other)
    with pytest.raises(ValueError, match="model_type"):
        fx.FlashCodecCache.load(path, tiny_config("qwen3"))


def test_other_weights_and_dtype_are_refused(saved, nothing_built):
    _, path = saved
    with pytest.raises(ValueError, match="other weights"):
        fx.FlashCodecCache.load(path, fresh_tiny_model("llama", seed=1))
    with pytest.raises(ValueError, match="runs in torch.bfloat16"):
        fx.FlashCodecCache.load(path, fresh_tiny_model("llama").to(torch.bfloat16))


def test_damaged_files_are_refused(saved, nothing_built):
    model, path = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        fx.FlashCodecCache.load(path, model)
    damaged = bytearray(data)
    damaged[-10] ^= 0xFF
    path.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="corrupted|damaged"):
        fx.FlashCodecCache.load(path, model)


def test_a_missing_file_is_file_not_found(tmp_path, nothing_built):
    model = fresh_tiny_model("llama")
    with pytest.raises(FileNotFoundError, match="no cache file at .*missing.fc"):
        fx.FlashCodecCache.load(tmp_path / "missing.fc", model)
    with pytest.raises(IsADirectoryError, match="is a folder"):
        fx.FlashCodecCache.load(tmp_path, model)


def test_bad_arguments_are_refused_before_writing(tmp_path):
    model = fresh_tiny_model("llama")
    cache = prefilled(model)
    with pytest.raises(ValueError, match="compression must be one of"):
        cache.save(tmp_path / "c.fc", compression="gzip")
    with pytest.raises(TypeError, match="path must be"):
        cache.save(3)
    unbound = fx.FlashCodecCache(preset="int8", num_layers=2)
    with pytest.raises(ValueError, match="model_or_config is required"):
        unbound.save(tmp_path / "c.fc")
    assert not any(tmp_path.iterdir())
    with pytest.raises(TypeError, match="model_or_config must be"):
        fx.FlashCodecCache.load(tmp_path / "c.fc", "llama")
    with pytest.raises(ValueError, match="device must name a torch device"):
        fx.FlashCodecCache.load(tmp_path / "c.fc", model, device="gpu0")
    with pytest.raises(TypeError, match="device must be None"):
        fx.FlashCodecCache.load(tmp_path / "c.fc", model, device=0.5)


def test_cache_without_config_saves_with_one(tmp_path):
    model = fresh_tiny_model("llama")
    apply_codec_attention(model)
    cache = fx.FlashCodecCache(preset="3bit", num_layers=2)
    with torch.no_grad():
        model(tiny_prompt(2, 20), use_cache=True, **cache_kwargs(cache))
    loaded = fx.FlashCodecCache.load(cache.save(tmp_path / "c.fc", model_or_config=model.config), model)
    assert torch.equal(continued(model, loaded), continued(model, copy.deepcopy(cache)))
