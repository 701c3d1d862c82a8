"""`CodecStream` / `CodecKVCache`: growth, crop, storage accounting, beams, reset, and rejected calls that change nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from codec_tiers import FAST, grid_data
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx import CodecKVCache, CodecOverflowError, CodecStream, make_codec
from flashcodec_fx.ops.state import BATCHED_FIELDS

ops = torch.ops.flashcodec
D = 16
TIERS = {
    "png": make_codec("png", block_size=8),
    "png-window": make_codec("png", block_size=4, sinks=2, window=3),
    "int8": make_codec("jpeg", block_size=8, quant_bits=8),
    "k-dct-channel": make_codec("jpeg", block_size=4, quant_bits=(4, 2, 2, 1), levels=("uniform", "midrise"),
                                scale_axis="channel", group=16, scale_search=True, rotate=1, sinks=2),
    "v-token-lloyd": make_codec("jpeg", block_size=1, quant_bits=2, levels="lloyd", rotate=2, center=True,
                                scale_search=True, sinks=2, window=5),
}
LOSSY = ["int8", "k-dct-channel", "v-token-lloyd"]
LAYOUTS = ["dynamic", "static"]


def stream_of(tier, layout, x, steps=(), max_length=100, **kwargs):
    """Append ``x[:, :, a:b]`` for consecutive cumulative ends ``b`` in ``steps``."""
    stream = CodecStream(TIERS[tier], layout, max_length=max_length, **kwargs)
    at = 0
    for end in steps:
        stream.append(x[:, :, at:end])
        at = end
    return stream


def snapshot(stream):
    tensors = [] if stream.state is None else list(stream.state)
    if stream.memo is not None:
        tensors.append(stream.memo)
    return [t.clone() for t in tensors], stream.get_seq_length(), stream.capacity, stream.is_initialized


def assert_same_snapshot(a, b):
    assert a[1:] == b[1:]
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))


def assert_same_content(a: CodecStream, b: CodecStream):
    """Bitwise: the filled archive groups, sinks, mean, the tail rows holding tokens, the length and the view (streams
    holding their tokens raw: the tokens)."""
    n = a.get_seq_length()
    assert n == b.get_seq_length() and a.raw_prefix == b.raw_prefix
    if a.raw_prefix:
        assert torch.equal(a.read(), b.read())
        return
    groups = max(0, a.archived_tokens - a.codec.sinks) // a.codec.group
    for x, y in zip(a.state[:4], b.state[:4], strict=True):
        assert torch.equal(x[:, :, :groups], y[:, :, :groups])
    held = n - a.archived_tokens if n > a.archived_tokens else 0
    assert torch.equal(a.state.tail[:, :, :held], b.state.tail[:, :, :held])
    for field in ("mean", "sink", "length"):
        assert torch.equal(getattr(a.state, field), getattr(b.state, field)), field
    assert torch.equal(a.read()[:, :, :n], b.read()[:, :, :n])


# ---------------------------------------------------------------------------------------------------- growth


@pytest.mark.parametrize("tier", list(TIERS))
def test_dynamic_growth_keeps_everything_and_equals_static(tier):
    x = torch.randn(1, 2, 700, D, generator=torch.Generator().manual_seed(0))
    steps = (3, 190, 191, 260, 513, 700)  # across the 256 -> 512 -> 1024 position doublings
    dynamic = stream_of(tier, "dynamic", x, steps)
    static = stream_of(tier, "static", x, steps, max_length=700)
    assert dynamic.capacity >= 700 and dynamic.capacity == dynamic.codec.sinks + dynamic.state.data.shape[2] * \
        dynamic.codec.group
    assert_same_content(dynamic, static)


@pytest.mark.parametrize("tier", ["png", "png-window"])
def test_png_stores_grid_data_exactly(tier):
    x = grid_data((2, 2, 77, D), torch.bfloat16)
    stream = stream_of(tier, "dynamic", x, (1, 30, 31, 77))
    assert torch.equal(stream.decoded(), x)


# ---------------------------------------------------------------------------------------------------- crop


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("keep", [0, 1, 3, 8, 13, 16, 21, 30])
@pytest.mark.parametrize("tier", ["png", "png-window"])
def test_lossless_crop_and_regrow_equals_fresh_run(tier, keep, layout):
    x = grid_data((2, 2, 50, D), torch.bfloat16)
    stream = stream_of(tier, layout, x, (20, 25, 31))
    stream.crop(keep)
    assert stream.get_seq_length() == keep
    stream.append(x[:, :, keep:40])
    stream.append(x[:, :, 40:41])
    assert_same_content(stream, stream_of(tier, layout, x, (41,)))
    assert torch.equal(stream.read()[:, :, :41], x[:, :, :41])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier", LOSSY)
def test_lossy_crop_inside_the_raw_tail_is_a_true_rollback(tier, layout):
    """A crop that reopens no archived group drops raw tail rows only: crop + re-append == never cropped, bitwise."""
    x = torch.randn(1, 2, 60, D, generator=torch.Generator().manual_seed(1))
    stream = stream_of(tier, layout, x, (37,))
    depth = stream.get_seq_length() - max(stream.archived_tokens, stream.codec.sinks)
    assert depth >= 1
    stream.crop(-depth)
    stream.append(x[:, :, 37 - depth:45])
    assert_same_content(stream, stream_of(tier, layout, x, (37, 45)))


@pytest.mark.parametrize("tier", ["int8", "k-dct-channel"])
def test_exact_crop_inside_an_archived_group_raises_and_changes_nothing(tier):
    x = torch.randn(1, 2, 60, D, generator=torch.Generator().manual_seed(2))
    stream = stream_of(tier, "dynamic", x, (41,), crop="exact")
    assert not stream.croppable and stream_of(tier, "dynamic", x, (41,)).croppable  # the default reopens
    before = snapshot(stream)
    depth = stream.get_seq_length() - max(stream.archived_tokens, stream.codec.sinks)
    with pytest.raises(ValueError, match="reopen archived tokens") as err:
        stream.crop(-(depth + 1))
    assert f"crop at most {depth} tokens" in str(err.value) and "crop='decode'" in str(err.value)
    assert_same_snapshot(before, snapshot(stream))


@pytest.mark.parametrize("tier", LOSSY)
def test_lossy_crop_to_a_group_boundary_is_a_true_rollback(tier):
    """Per-token codecs (groups of one token) roll back exactly at any depth; others at group boundaries."""
    x = torch.randn(1, 2, 60, D, generator=torch.Generator().manual_seed(6))
    stream = stream_of(tier, "dynamic", x, (41, 52))
    codec = stream.codec
    keep = codec.sinks + (stream.archived_tokens - codec.sinks - 1) // codec.group * codec.group
    assert keep < stream.archived_tokens
    stream.crop(keep)
    stream.append(x[:, :, keep:52])
    assert_same_content(stream, stream_of(tier, "dynamic", x, (41, 52)))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier", LOSSY)
def test_decode_crop_keeps_what_attention_read(tier, layout):
    """crop='decode': the view of the kept positions is unchanged by the crop; attention equals SDPA over it."""
    x = torch.randn(1, 2, 40, D, generator=torch.Generator().manual_seed(3))
    cache = CodecKVCache(TIERS[tier], layout=layout, max_length=100, crop="decode")
    cache.append(x[:, :, :33], x[:, :, :33])
    before = [view[:, :, :21].clone() for view in cache.read()]
    cache.crop(21)
    assert cache.get_seq_length() == 21
    for stream, view in zip((cache.keys, cache.values), before, strict=True):
        assert torch.equal(stream.read()[:, :, :21], view)
    q = torch.randn(1, 2, 1, D)
    k, v = before
    torch.testing.assert_close(cache.attention(q), F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=0)


@FAST
@given(tier=st.sampled_from(list(TIERS)), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       layout=st.sampled_from(LAYOUTS), memoize=st.booleans(), first=st.integers(1, 40), keep=st.integers(0, 60),
       more=st.integers(1, 20))
def test_a_default_crop_at_any_depth_keeps_the_view_and_rolls_back_exactly_where_it_can(tier, dtype, layout, memoize,
                                                                                         first, keep, more):
    """The default crop mode (issue 32): any crop succeeds, the kept positions read as before it, bitwise (reopened
    groups come back as their decoded rows), and where the stream says every crop is an exact rollback
    (``exact_rollback``: per-token groups, png on 16-bit streams), the dropped tokens appended again in the same calls
    give back every stored tensor, bitwise."""
    x = torch.randn(1, 2, 80, D, generator=torch.Generator().manual_seed(first * 100 + keep)).to(dtype)
    keep = min(keep, first + more)
    calls = (first, keep, first + more) if first < keep else (keep, first + more) if keep else (first + more,)

    def filled():
        stream = CodecStream(TIERS[tier], layout, max_length=100, memoize=memoize)
        at = 0
        for end in calls:
            if end > at:
                stream.append(x[:, :, at:end])
            at = end
        return stream

    stream, plain = filled(), filled()
    assert stream.croppable
    before = stream.read()[:, :, :keep].clone()
    stream.crop(keep)
    assert stream.get_seq_length() == keep and torch.equal(stream.read()[:, :, :keep], before)
    if keep < first + more:
        stream.append(x[:, :, keep: first + more])
    if stream.exact_rollback:
        assert_same_content(stream, plain)


@pytest.mark.parametrize("memoize", [False, True])
def test_a_crop_decodes_the_reopened_group_alone(memoize, monkeypatch):
    """A crop into an archived group decodes that group's positions only (memoized: reads the memo's rows), never the
    history: no per-crop cost that grows with the length."""
    x = torch.randn(1, 2, 300, D, generator=torch.Generator().manual_seed(8))
    stream = CodecStream(TIERS["int8"], memoize=memoize)
    stream.append(x)
    view = stream.read()[:, :, :291].clone()
    calls = []
    read = torch.ops.flashcodec.read
    monkeypatch.setattr(torch.ops.flashcodec, "read", lambda state, *args: calls.append(state[0].shape[2]) or
                        read(state, *args))
    stream.crop(291)  # reopens the group of positions 288..295
    assert calls == ([] if memoize else [1])
    monkeypatch.undo()
    assert stream.archived_tokens == 288 and torch.equal(stream.read(), view)


# not centered: a mean summed over another call length may round apart (the raw prefix replays that call whole)
NORMALIZED = make_codec("jpeg", block_size=1, quant_bits=3, levels="lloyd", rotate=1, normalize=True, sinks=4, window=3)


def outlier_channels(x: torch.Tensor) -> torch.Tensor:
    """``x`` with channels 1 and 6 made 16x wider: a normalized codec stores them divided by powers of two."""
    x = x.clone()
    x[..., [1, 6]] *= 16
    return x


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("keep", [2, 20])
def test_normalized_crop_is_a_true_rollback(layout, keep):
    """A crop to ``keep`` and the same tokens appended again store what was stored, bitwise: a crop into the sinks
    restores the sink rows and forgets the exponents (the next call past the sinks measures the same tokens again);
    a crop inside the archive of per-token codes keeps the exponents."""
    x = outlier_channels(torch.randn(1, 2, 48, D, generator=torch.Generator().manual_seed(5)))
    plain = CodecStream(NORMALIZED, layout, max_length=100)
    plain.append(x)
    assert plain.state.norm.any()
    rolled = CodecStream(NORMALIZED, layout, max_length=100)
    rolled.append(x)
    rolled.crop(keep)
    if keep < NORMALIZED.sinks:
        stored = x[:, :, :keep].to(rolled.raw_dtype).to(x.dtype)  # the sinks as stored (bf16 rows of an fp32 stream)
        assert not rolled.state.norm.any() and torch.equal(rolled.read()[:, :, :keep], stored)
    rolled.append(x[:, :, keep:])
    assert_same_content(rolled, plain)
    assert torch.equal(rolled.state.norm, plain.state.norm)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_normalized_decode_crop_keeps_what_attention_read(layout):
    """crop='decode' reopens archived rows into the raw tail in the stored domain: the view is unchanged."""
    x = outlier_channels(torch.randn(1, 2, 40, D, generator=torch.Generator().manual_seed(6)))
    stream = CodecStream(make_codec("jpeg", block_size=4, quant_bits=3, rotate=1, normalize=True, sinks=2, window=2),
                         layout, max_length=100, crop="decode")
    stream.append(x[:, :, :33])
    before = stream.read()[:, :, :21].clone()
    stream.crop(21)
    assert torch.equal(stream.read()[:, :, :21], before)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("tier", "keep"), [("png", 19), ("int8", 16), ("v-token-lloyd", 24), ("png-window", 2)])
def test_crop_is_repeatable_and_past_the_start_empties(tier, keep, layout):
    x = torch.randn(1, 2, 60, D, generator=torch.Generator().manual_seed(4))
    stream = stream_of(tier, layout, x, (30, 37), crop="decode")
    stream.crop(keep)
    once = snapshot(stream)
    stream.crop(keep)
    assert_same_snapshot(once, snapshot(stream))
    stream.crop(100)  # longer than the stream: nothing to drop
    assert stream.get_seq_length() == keep
    stream.crop(-(keep + 5))  # past the start: empty, as transformers' DynamicLayer (a lossy dynamic stream: raw again)
    assert stream.get_seq_length() == 0 and (stream.raw_prefix or int(stream.length) == 0)
    assert stream.raw_prefix == (layout == "dynamic" and tier in LOSSY)
    stream.append(x[:, :, :9])
    assert_same_content(stream, stream_of(tier, layout, x, (9,)))


@pytest.mark.parametrize("tier", list(TIERS))
def test_static_memo_equals_read_op_after_crop_and_regrow(tier):
    x = torch.randn(1, 2, 60, D, generator=torch.Generator().manual_seed(5))
    stream = stream_of(tier, "static", x, (30, 37), memoize=True, crop="decode")
    for keep in (21, 27, 16, 3):
        stream.crop(keep)
        stream.append(x[:, :, 50:51])
        view = ops.read(list(stream.state), stream.spec)
        n = stream.get_seq_length()
        torch.testing.assert_close(stream.read()[:, :, :n], view[:, :, :n], atol=1e-6, rtol=0)
        assert not stream.read()[:, :, n:].any()


# ---------------------------------------------------------------------------------------------------- storage


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("memoize", [True, False])
@pytest.mark.parametrize("tier", list(TIERS))
def test_storage_counts_every_tensor_held(tier, memoize, layout):
    cache = CodecKVCache(TIERS[tier], TIERS["png"] if TIERS[tier].sinks == 0 else TIERS[tier], layout=layout,
                         max_length=300, memoize=memoize)
    assert cache.storage_bytes() == 0
    x = torch.randn(2, 3, 203, D).to(torch.float16)
    cache.append(x, x)
    parts = cache.storage_breakdown()
    held = [*cache.keys.state, *cache.values.state]
    memos = [m for m in (cache.keys.memo, cache.values.memo) if m is not None]
    assert len(memos) == (2 if memoize else 0)
    assert isinstance(cache.storage_bytes(), int)
    assert cache.storage_bytes() == parts["total"] == sum(t.nbytes for t in held + memos)
    assert parts["memo"] == sum(m.nbytes for m in memos)
    for stream in (cache.keys, cache.values):
        codec = stream.codec
        groups = (stream.archived_tokens - codec.sinks) // codec.group
        assert stream.storage_breakdown()["archive_used"] == groups * 2 * 3 * codec.group_bytes(D, torch.float16)
    cache.release_memo()
    assert cache.storage_bytes() == parts["total"] - parts["memo"]


@pytest.mark.parametrize(("codec", "bits"), [
    (make_codec("jpeg", block_size=8, quant_bits=8), 8.25),
    (make_codec("jpeg", block_size=8, quant_bits=(5, 3, 3, 2, 2, 2, 2, 2), levels=("uniform", "midrise"),
                scale_axis="channel", group=128), 3.0),
    (make_codec("jpeg", block_size=1, quant_bits=2, levels="lloyd"), 2.25),
    (make_codec("jpeg", block_size=1, quant_bits=4, levels="uniform"), 4.5),
])
def test_stored_bits_are_the_format_when_every_group_is_full(codec, bits):
    stream = CodecStream(codec, "dynamic")
    stream.append(torch.randn(1, 2, 256, 64).to(torch.bfloat16))
    assert stream.stored_bits() / (2 * 256 * 64) == pytest.approx(bits)


def test_bits_per_value_counts_raw_sinks_tail_and_mean():
    k = make_codec("jpeg", block_size=8, quant_bits=8, sinks=4)
    v = make_codec("jpeg", block_size=1, quant_bits=2, levels="lloyd", center=True, sinks=4, window=10)
    cache = CodecKVCache(k, v)
    n, d = 100, 64
    cache.append(torch.randn(1, 2, n, d).to(torch.bfloat16), torch.randn(1, 2, n, d).to(torch.bfloat16))
    key_bits = ((n - 4) // 8 * 8 * 8.25 + (4 + (n - 4) % 8) * 16) * d * 2
    value_bits = ((n - 4 - 10) * 2.25 + 14 * 16) * d * 2 + 32 * d * 2  # + the fp32 mean per (B, H)
    assert cache.keys.stored_bits() == key_bits
    assert cache.values.stored_bits() == value_bits
    assert cache.bits_per_value() == pytest.approx((key_bits + value_bits) / (2 * 2 * n * d))


LOSSLESS_PREFIX = 64  # lossless holds its tokens raw up to here, then one raw tail row and 1/16 growth


@pytest.mark.parametrize("preset", ["lossless", "int8", "4bit", "3bit", "2.5bit", "2bit"])
def test_held_bytes_never_exceed_a_dynamic_cache(preset):
    """Every preset, bf16 decode steps 1..2048 and fp32 / bf16 prefills of 1..80 tokens and every 97th up to 2048:
    a layer never holds more bytes than a DynamicCache of that length (``2 * H * n * D`` values), counting everything
    ``storage_bytes`` counts; while both streams hold their tokens raw, exactly as many
    (benchmarks/results/held.json). ``lossless`` stores raw: from its 64th token it holds one raw tail row per stream
    and the two 0-dim lengths beside its tokens, and its archive grows by 1/16, so there it is bounded by 17/16 of a
    DynamicCache plus those rows (1.07x at 64 tokens, 1/16 over it asymptotically in decode, one row in a prefill)."""
    from flashcodec_fx.presets import preset_codecs

    key, value = preset_codecs(preset, layer_idx=1)
    d, heads = 8, 2
    prefills = [*range(1, 81), *range(81, 2049, 97), 2048]
    for dtype, lengths, decode in ((torch.bfloat16, range(1, 2049), True), (torch.float32, prefills, False),
                                   (torch.bfloat16, prefills, False)):
        item = torch.empty((), dtype=dtype).element_size()
        x = grid_data((1, heads, max(lengths), d), dtype, 3)
        cache = CodecKVCache(key, value)
        for n in lengths:
            if decode:
                cache.append(x[:, :, n - 1: n], x[:, :, n - 1: n])
            else:
                cache = CodecKVCache(key, value)
                cache.append(x[:, :, :n], x[:, :, :n])
            raw = 2 * heads * n * d * item
            bound = raw if preset != "lossless" or n < LOSSLESS_PREFIX else raw * 17 // 16 + 2 * (heads * d * item + 16)
            held = cache.storage_bytes()
            assert held <= bound, (preset, dtype, n, held, bound)
            assert held == raw or not (cache.keys.raw_prefix and cache.values.raw_prefix)


# ---------------------------------------------------------------------------------------------------- beams


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("k_tier", "v_tier"), [("int8", "png"), ("k-dct-channel", "v-token-lloyd")])
def test_index_select_moves_everything_together(k_tier, v_tier, layout):
    """Select/reorder beams, keep decoding: equal to running each selected sequence on its own."""
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(4, 2, 60, D, generator=gen), torch.randn(4, 2, 60, D, generator=gen)
    pick = torch.tensor([2, 0, 2, 1])

    def run(rows, src, later):
        cache = CodecKVCache(TIERS[k_tier], TIERS[v_tier], layout=layout, max_length=64, memoize=True)
        cache.append(k[src, :, :21], v[src, :, :21])
        cache.append(k[src, :, 21:27], v[src, :, 27:33])
        if rows is not None:
            cache.index_select(rows)
        for i in range(9):
            cache.append(later[0][:, :, i: i + 1], later[1][:, :, i: i + 1])
        return cache

    later = torch.randn(4, 2, 9, D, generator=gen), torch.randn(4, 2, 9, D, generator=gen)
    cache = run(pick, slice(None), later)
    q = torch.randn(4, 4, 1, D, generator=gen)
    out = cache.attention(q)
    for row, src in enumerate(pick.tolist()):
        alone = run(None, slice(src, src + 1), (later[0][row: row + 1], later[1][row: row + 1]))
        for mine, theirs in ((cache.keys, alone.keys), (cache.values, alone.values)):
            for field in BATCHED_FIELDS:
                assert torch.equal(getattr(mine.state, field)[row: row + 1], getattr(theirs.state, field))
            assert torch.equal(mine.memo[row: row + 1], theirs.memo)
        torch.testing.assert_close(out[row: row + 1], alone.attention(q[row: row + 1]), atol=1e-6, rtol=0)


def test_static_beam_reorder_keeps_buffer_addresses():
    """A same-size reorder of a static layout permutes in place: CUDA graphs keep valid pointers."""
    cache = CodecKVCache(TIERS["v-token-lloyd"], layout="static", max_length=32, memoize=True)
    x = torch.randn(3, 2, 13, D)
    cache.append(x, x)
    tensors = lambda: [t.data_ptr() for t in (*cache.keys.state, cache.keys.memo)]  # noqa: E731
    before = tensors()
    expected = cache.keys.read().index_select(0, torch.tensor([2, 2, 0]))
    cache.index_select(torch.tensor([2, 2, 0]))
    assert tensors() == before
    assert torch.equal(cache.keys.read(), expected)


@pytest.mark.parametrize("n", [19, 60])  # held raw, then in the codec state
def test_repeat_interleave_expands_every_tensor(n):
    x = torch.randn(2, 1, n, D)
    cache = CodecKVCache(TIERS["k-dct-channel"], memoize=True)
    cache.append(x, x)
    cache.repeat_interleave(3)
    twin = CodecKVCache(TIERS["k-dct-channel"], memoize=True)
    twin.append(x.repeat_interleave(3, dim=0), x.repeat_interleave(3, dim=0))
    assert cache.keys.raw_prefix == (n == 19)
    for a, b in ((cache.keys, twin.keys), (cache.values, twin.values)):
        assert_same_content(a, b)
        assert a.memo is b.memo is None if a.raw_prefix else torch.equal(a.memo, b.memo)


# ---------------------------------------------------------------------------------------------------- reset


def test_dynamic_reset_takes_a_new_batch_size():
    cache = CodecKVCache(TIERS["int8"])
    cache.append(torch.randn(2, 2, 12, D), torch.randn(2, 2, 12, D))
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.storage_bytes() == 0
    x = torch.randn(1, 2, 12, D)
    cache.append(x, x)
    fresh = CodecKVCache(TIERS["int8"])
    fresh.append(x, x)
    assert_same_content(cache.keys, fresh.keys)


def test_static_reset_zeroes_in_place():
    cache = CodecKVCache(TIERS["v-token-lloyd"], layout="static", max_length=40)
    x = torch.randn(1, 2, 30, D)
    cache.append(x, x)
    pointers = [t.data_ptr() for t in cache.keys.state]
    cache.reset()
    assert [t.data_ptr() for t in cache.keys.state] == pointers
    st = cache.keys.state
    assert all(not t.any() for t in st._replace(start=st.length)) and int(st.start) == cache.keys.codec.sinks
    cache.append(x, x)
    fresh = CodecKVCache(TIERS["v-token-lloyd"], layout="static", max_length=40)
    fresh.append(x, x)
    assert_same_content(cache.keys, fresh.keys)


# ---------------------------------------------------------------------------------------------------- construction


def test_static_streams_share_one_capacity():
    cache = CodecKVCache(TIERS["k-dct-channel"], TIERS["v-token-lloyd"], layout="static", max_length=50)
    x = torch.randn(1, 2, 3, D)
    cache.append(x, x)
    assert cache.keys.capacity == cache.values.capacity >= 50
    assert cache.keys.read().shape == cache.values.read().shape
    with pytest.raises(ValueError, match="same sinks"):
        CodecKVCache(TIERS["int8"], TIERS["v-token-lloyd"], layout="static", max_length=50)


def test_attention_reads_the_new_tokens_exactly_when_given():
    """decode_step returns what is stored (lossy here: two full groups); attention(new=...) reads the call's own
    tokens as given, attention() without them what is stored."""
    cache = CodecKVCache(TIERS["int8"])
    x, y = torch.randn(1, 2, 16, D), torch.randn(1, 2, 16, D)
    k, v = cache.decode_step(x, y)
    assert not torch.equal(k, x) and torch.allclose(k, x, atol=0.05)
    q = torch.randn(1, 4, 16, D)
    repeat = lambda t: t.repeat_interleave(2, 1)  # noqa: E731
    exact = F.scaled_dot_product_attention(q, repeat(x), repeat(y))
    torch.testing.assert_close(cache.attention(q, new=(x, y)), exact, atol=1e-5, rtol=0)
    stored = F.scaled_dot_product_attention(q, repeat(k), repeat(v))
    torch.testing.assert_close(cache.attention(q), stored, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------- rejected calls


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"codec": "jpeg"}, TypeError, "codec"),
    ({"layout": "paged"}, ValueError, "layout"),
    ({"layout": "static"}, TypeError, "max_length"),
    ({"layout": "static", "max_length": 0}, ValueError, "max_length"),
    ({"layout": "static", "max_length": 10.0}, TypeError, "max_length"),
    ({"layout": "static", "max_length": True}, TypeError, "max_length"),
    ({"memoize": 1}, TypeError, "memoize"),
    ({"crop": "lossy"}, ValueError, "crop"),
])
def test_bad_stream_options(kwargs, error, name):
    kwargs = {"codec": TIERS["png"], **kwargs}
    with pytest.raises(error, match=name):
        CodecStream(**kwargs)


@pytest.mark.parametrize(("options", "codec"), [
    ({"mode": "jpeg", "block_size": 8, "keep_freqs": 2}, make_codec("jpeg", block_size=8, keep_freqs=2)),
    ({"mode": "jpeg", "keep_freqs": 4, "quant_bits": 8}, make_codec("jpeg", keep_freqs=4, quant_bits=8)),
    ({"block_size": 16}, make_codec("jpeg", block_size=16)),
    ({"mode": "png", "block_size": 4, "keep_ratio": 0.5}, make_codec("png", block_size=4, keep_ratio=0.5)),
])
def test_codec_options_as_keywords_build_the_same_codec_for_both_streams(options, codec):
    cache = CodecKVCache(**options)
    assert cache.keys.spec == cache.values.spec == codec.spec
    x = grid_data((1, 2, 21, 8))
    reference = CodecKVCache(codec)
    for got, want in zip(cache.forward(x, x), reference.forward(x, x), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("args", "kwargs", "error", "match"), [
    ((), {}, TypeError, "codec options"),
    ((TIERS["png"],), {"mode": "jpeg"}, ValueError, "not both"),
    ((), {"mode": "gif"}, ValueError, "mode"),
    ((), {"mode": "jpeg", "keep_ratio": 0.5}, ValueError, "keep_ratio"),
    ((), {"mode": "png", "keep_freqs": 2}, ValueError, "keep_freqs"),
    ((), {"keep_freqs": 9}, ValueError, "keep_freqs"),
])
def test_bad_codec_keywords(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        CodecKVCache(*args, **kwargs)


BAD_NEW = {
    "wrong heads": (lambda: torch.randn(2, 3, 1, D), ValueError, rf"\(2, 2, T, {D}\)"),
    "wrong head_dim": (lambda: torch.randn(2, 2, 1, 8), ValueError, rf"\(2, 2, T, {D}\)"),
    "wrong batch": (lambda: torch.randn(1, 2, 1, D), ValueError, rf"\(2, 2, T, {D}\)"),
    "wrong dtype": (lambda: torch.randn(2, 2, 1, D, dtype=torch.float64), ValueError, "float32"),
    "integer": (lambda: torch.ones(2, 2, 1, D, dtype=torch.int64), TypeError, "floating"),
    "rank 3": (lambda: torch.randn(2, 1, D), ValueError, "B, H, T, D"),
    "empty": (lambda: torch.randn(2, 2, 0, D), ValueError, "T >= 1"),
    "not a tensor": (lambda: [[1.0]], TypeError, "tensor"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(BAD_NEW))
def test_rejected_append_changes_nothing(case, layout):
    make, error, match = BAD_NEW[case]
    stream = stream_of("k-dct-channel", layout, torch.randn(2, 2, 20, D), (11, 13))
    before = snapshot(stream)
    with pytest.raises(error, match=match):
        stream.append(make())
    assert_same_snapshot(before, snapshot(stream))


@pytest.mark.parametrize("fresh", [True, False])
def test_static_overflow_is_rejected_before_any_state_change(fresh):
    stream = CodecStream(TIERS["png"], "static", max_length=20)
    if not fresh:
        stream.append(torch.randn(1, 1, 15, 4))
    before = snapshot(stream)
    with pytest.raises(CodecOverflowError, match="max_length=20") as err:
        stream.append(torch.randn(1, 1, 21 if fresh else 6, 4))
    assert isinstance(err.value, IndexError) and isinstance(err.value, ValueError)  # as StaticCache / as ours
    assert_same_snapshot(before, snapshot(stream))
    # the rejected call allocated nothing: a fresh stream still takes any shape and dtype
    stream.append(torch.randn(1, 1, 5, 4, dtype=torch.float64 if fresh else torch.float32))
    assert stream.get_seq_length() == (5 if fresh else 20)


def test_static_overflow_in_a_compiled_step_is_observable():
    """A compiled step skips the host length check: the append op drops what lies past the capacity, keeps every
    stored block intact, and the next host-side length query raises instead of returning a wrong length."""
    stream = CodecStream(TIERS["int8"], "static", max_length=20)
    stream.append(torch.randn(1, 2, 18, D))
    archived = [t.clone() for t in stream.state[:4]]

    @torch.compile(backend="eager", fullgraph=True)
    def step(x):
        stream.append(x)

    step(torch.randn(1, 2, 9, D))  # 27 > max_length = 20 (capacity 24)
    assert int(stream.length) == 27
    for now, then in zip(stream.state[:4], archived, strict=True):
        assert torch.equal(now[:, :, :2], then[:, :, :2])  # the groups stored before are untouched
    with pytest.raises(RuntimeError, match="max_length=20"):
        stream.get_seq_length()


def test_cache_append_rejects_mismatched_keys_and_values_before_any_change():
    cache = CodecKVCache(TIERS["int8"], TIERS["png"], layout="static", max_length=12)
    cache.append(torch.randn(1, 2, 5, D), torch.randn(1, 2, 5, D))
    before = snapshot(cache.keys), snapshot(cache.values)
    for k, v, match in [
        (torch.randn(1, 2, 3, D), torch.randn(1, 2, 2, D), "share"),
        (torch.randn(1, 2, 3, D), torch.randn(1, 2, 3, D + 8), "new tokens"),
        (torch.randn(1, 2, 8, D), torch.randn(1, 2, 8, D), "max_length"),
    ]:
        with pytest.raises(ValueError, match=match):
            cache.append(k, v)
        assert_same_snapshot(before[0], snapshot(cache.keys))
        assert_same_snapshot(before[1], snapshot(cache.values))


def test_bad_crop_arguments_change_nothing():
    stream = stream_of("png", "dynamic", torch.randn(1, 1, 20, 4), (13,))
    before = snapshot(stream)
    for bad in (5.0, True, "3"):
        with pytest.raises(TypeError, match="n must be an int"):
            stream.crop(bad)
    assert_same_snapshot(before, snapshot(stream))


def test_reads_before_any_token_fail_clearly():
    cache = CodecKVCache(TIERS["int8"])
    with pytest.raises(RuntimeError, match="before any token"):
        cache.read()
    with pytest.raises(RuntimeError, match="at least one token"):
        cache.attention(torch.randn(1, 1, 1, 8))
