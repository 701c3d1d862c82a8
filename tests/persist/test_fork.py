"""Copy-on-append forks of the engine cache: a fork shares the prefix's archive until it writes one, and every fork
(and the original) then holds exactly what a deep copy given the same tokens holds, bitwise."""

from __future__ import annotations

import copy

import pytest
import torch
from codec_tiers import FAST
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx import CodecKVCache, make_codec
from flashcodec_fx.persist.fork import fork_kv_cache
from flashcodec_fx.presets import PRESETS, preset_codecs


def filled(preset: str, tokens: int, seed: int = 0, layout: str = "dynamic") -> CodecKVCache:
    key, value = preset_codecs(preset)
    cache = CodecKVCache(key, value, layout=layout, max_length=256 if layout == "static" else None)
    gen = torch.Generator().manual_seed(seed)
    cache.append(torch.randn(2, 2, tokens, 16, generator=gen), torch.randn(2, 2, tokens, 16, generator=gen))
    return cache


def states(cache: CodecKVCache) -> list[torch.Tensor]:
    """Every tensor of both streams' state (a stream holding its tokens raw: those tokens)."""
    return [t for s in (cache.keys, cache.values) for t in (s.state if s.state is not None else (s.tail,))]


def same(a: CodecKVCache, b: CodecKVCache) -> bool:
    return a.keys.raw_prefix == b.keys.raw_prefix and a.values.raw_prefix == b.values.raw_prefix and \
        all(torch.equal(x, y) for x, y in zip(states(a), states(b), strict=True))


def archive_ptrs(cache: CodecKVCache) -> list[int]:
    return [t.data_ptr() for s in (cache.keys, cache.values) for t in s.state[:4] if t.numel()]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_fork_shares_the_archive_until_it_writes(preset):
    prefix = filled(preset, 72)  # past every stream's raw prefix: both hold their codec state
    child = fork_kv_cache(prefix)
    assert archive_ptrs(child) == archive_ptrs(prefix)  # nothing of the archive copied
    assert child.keys.state.tail.data_ptr() != prefix.keys.state.tail.data_ptr()  # the tail is the fork's own
    codec = child.values.codec
    gen = torch.Generator().manual_seed(5)
    for _ in range(codec.window + codec.group):  # enough tokens that both streams archive a group
        child.append(torch.randn(2, 2, 1, 16, generator=gen), torch.randn(2, 2, 1, 16, generator=gen))
    assert not set(archive_ptrs(child)) & set(archive_ptrs(prefix))


@FAST
@given(preset=st.sampled_from(sorted(PRESETS)), prefix=st.integers(1, 40),
       chunks=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_forks_equal_deep_copies_bitwise(preset, prefix, chunks, seed):
    """Several requests continued from one prefix, the original continued last: each equals a deep copy of the
    prefix given the same tokens, and no request changes another's state."""
    base = filled(preset, prefix, seed)
    copies = [copy.deepcopy(base) for _ in chunks]
    forks = [fork_kv_cache(base) for _ in chunks[1:]] + [base]
    gen = torch.Generator().manual_seed(seed + 1)
    for sizes, reference, child in zip(chunks, copies, forks, strict=True):
        for t in sizes:
            k, v = torch.randn(2, 2, t, 16, generator=gen), torch.randn(2, 2, t, 16, generator=gen)
            reference.append(k, v)
            child.append(k, v)
    for reference, child in zip(copies, forks, strict=True):
        assert child.get_seq_length() == reference.get_seq_length() and same(child, reference)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_fork_shares_the_tokens_held_raw_until_either_appends(preset):
    prefix = filled(preset, 1)
    assert prefix.keys.raw_prefix and prefix.values.raw_prefix
    child = fork_kv_cache(prefix)
    assert child.keys.tail.data_ptr() == prefix.keys.tail.data_ptr() and same(child, prefix)
    k = torch.randn(2, 2, 1, 16)
    child.append(k, k)
    assert child.keys.tail.data_ptr() != prefix.keys.tail.data_ptr() and prefix.get_seq_length() == 1


def test_static_forks_copy_everything():
    prefix = filled("int8", 20, layout="static")
    child = fork_kv_cache(prefix)
    assert not set(archive_ptrs(child)) & set(archive_ptrs(prefix))
    assert same(child, prefix)


@pytest.mark.parametrize("tier", [*sorted(PRESETS), "jpeg-blocks"])
def test_a_crop_into_a_forks_archive_leaves_the_prefix_alone(tier):
    """A crop into the shared archive (a group boundary of per-token codes, or a jpeg block group reopened) copies the
    fork's archive first: the prefix keeps every tensor, and the fork equals a deep copy cropped alike (it zeroed the
    prefix's groups before)."""
    if tier == "jpeg-blocks":
        codec = make_codec("jpeg", block_size=8, quant_bits=8)
        prefix = CodecKVCache(codec, codec)
        gen = torch.Generator().manual_seed(0)
        prefix.append(torch.randn(2, 2, 72, 16, generator=gen), torch.randn(2, 2, 72, 16, generator=gen))
    else:
        prefix = filled(tier, 72)
    assert min(prefix.keys.archived_tokens, prefix.values.archived_tokens) > 37  # the crop reaches into the archive
    untouched, reference = copy.deepcopy(prefix), copy.deepcopy(prefix)
    child = fork_kv_cache(prefix)
    child.crop(37)
    reference.crop(37)
    assert same(prefix, untouched) and same(child, reference)
