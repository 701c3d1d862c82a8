"""Random FlashCodecCaches (preset, layout, dtype, batch, lengths, full and sliding layers) saved with a random
compression load back bitwise; any damaged byte of their file is refused, or changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from codec_tiers import FAST
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("transformers")

from cache_state import same, snapshot  # noqa: E402
from conftest import tiny_config  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.hf.sliding_layer import FlashCodecSlidingLayer  # noqa: E402
from flashcodec_fx.presets import PRESETS  # noqa: E402

caches = st.fixed_dictionaries({
    "family": st.sampled_from(["llama", "gemma3"]), "preset": st.sampled_from(sorted(PRESETS)),
    "layout": st.sampled_from(["dynamic", "static"]), "dtype": st.sampled_from([torch.bfloat16, torch.float32]),
    "batch": st.integers(1, 3), "chunks": st.lists(st.integers(1, 20), min_size=1, max_size=3),
    "compression": st.sampled_from(["raw", "zstd", "ppmd"]), "seed": st.integers(0, 2**16)})


def random_cache(family, preset, layout, dtype, batch, chunks, seed, **_):
    config = tiny_config(family)
    static = dict(layout="static", max_cache_len=64) if layout == "static" else {}
    cache = fx.FlashCodecCache.from_config(config, preset=preset, **static)
    gen = torch.Generator().manual_seed(seed)
    for t in chunks:
        for idx in range(config.num_hidden_layers):
            k, v = (torch.randn(batch, 2, t, 16, generator=gen).to(dtype) for _ in range(2))
            cache.update(k, v, idx)
    return config, cache


def layers_state(cache) -> list:
    """Every layer's state, rings as their next update leaves them (what a file holds)."""
    cache, out = copy.deepcopy(cache), []
    for layer in cache.layers:
        if isinstance(layer, FlashCodecSlidingLayer):
            layer.slide()
    for layer in cache.layers:
        if isinstance(layer, fx.FlashCodecLayer):
            out.append(snapshot(layer))
        else:
            out.append([t.clone() for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)])
    return out


def equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))


@FAST
@given(case=caches)
def test_random_caches_round_trip_bitwise(tmp_path_factory, case):
    config, cache = random_cache(**case)
    path = cache.save(tmp_path_factory.mktemp("c") / "c.fc", compression=case["compression"])
    assert equal(layers_state(fx.FlashCodecCache.load(path, config)), layers_state(cache))


@FAST
@given(case=caches, at=st.floats(0, 1, exclude_max=True), flip=st.integers(1, 255))
def test_damaged_files_are_refused_or_load_unchanged(tmp_path_factory, case, at, flip):
    config, cache = random_cache(**case)
    path = cache.save(tmp_path_factory.mktemp("c") / "c.fc", compression=case["compression"])
    data = bytearray(path.read_bytes())
    data[int(at * len(data))] ^= flip
    path.write_bytes(bytes(data))
    try:
        loaded = fx.FlashCodecCache.load(path, config)
    except ValueError:
        return
    assert equal(layers_state(loaded), layers_state(cache))
