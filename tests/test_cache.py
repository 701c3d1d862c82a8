"""`CodecStream` / `CodecKVCache`: crop, storage accounting, beam reorder, and rejected calls that change nothing."""

from __future__ import annotations

import pytest
import torch
from codec_tiers import grid_data, tier_table

from flashcodec_fx import CodecKVCache, CodecStream, make_codec

ops = torch.ops.flashcodec
R = 8
TIERS = tier_table(R, low_keep=3)
LOSSY = ["jpeg-k3", "jpeg-int8", "png-half"]
LAYOUTS = ["dynamic", "static"]


def stream_of(tier, layout, x, steps=(), memoize=True, max_length=100):
    """Prefill with ``x[:, :, :steps[0]]`` then append chunk by chunk up to each cumulative end in ``steps``."""
    stream = CodecStream(TIERS[tier], layout, max_length=max_length, memoize=memoize)
    at = 0
    for end in steps:
        stream.append(x[:, :, at:end])
        at = end
    return stream


def snapshot(stream):
    tensors = [] if stream.state is None else [*stream.state, stream.tail, stream.length]
    if stream.memo is not None:
        tensors.append(stream.memo)
    return [t.clone() for t in tensors], stream._host_length, stream.capacity_blocks, stream.is_initialized


def assert_same_snapshot(a, b):
    assert a[1:] == b[1:]
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))


def assert_same_content(a: CodecStream, b: CodecStream):
    """Bitwise: archived blocks, open-block tail, length and read view."""
    n = a.get_seq_length()
    assert n == b.get_seq_length()
    for x, y in zip(a.state, b.state, strict=True):
        assert torch.equal(x[:, :, : n // R], y[:, :, : n // R])
    assert torch.equal(a.tail, b.tail)
    assert torch.equal(a.read(), b.read())
    assert torch.equal(ops.read(*a.state, a.tail, a.length, a.spec), ops.read(*b.state, b.tail, b.length, b.spec))


# ---------------------------------------------------------------------------------------------------- crop


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("keep", [0, 3, 8, 13, 16, 21, 30])
def test_crop_and_regrow_equals_fresh_run_lossless_png(keep, layout):
    x = grid_data((2, 2, 50, 8), torch.bfloat16)
    stream = stream_of("png", layout, x, (20, 25, 31))
    stream.crop(keep)
    assert stream.get_seq_length() == keep
    stream.append(x[:, :, keep:40])
    stream.append(x[:, :, 40:41])
    fresh = stream_of("png", layout, x, (41,))
    assert_same_content(stream, fresh)
    assert torch.equal(stream.read()[:, :, :41], x[:, :, :41])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_crop_and_regrow_jpeg_full_keep_to_tolerance(layout):
    x = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(1))
    stream = stream_of("jpeg", layout, x, (29,))
    stream.crop(-10)  # inside the archived block 16..23
    stream.append(x[:, :, 19:35])
    fresh = stream_of("jpeg", layout, x, (35,))
    torch.testing.assert_close(stream.read(), fresh.read(), atol=2e-6, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier", LOSSY)
@pytest.mark.parametrize("keep", [0, 8, 24])
def test_crop_at_block_boundary_and_regrow_equals_fresh_run_lossy(tier, keep, layout):
    x = torch.randn(2, 1, 50, 8, generator=torch.Generator().manual_seed(keep))
    stream = stream_of(tier, layout, x, (19, 37))
    stream.crop(keep)
    stream.append(x[:, :, keep:keep + 5])
    stream.append(x[:, :, keep + 5:45])
    assert_same_content(stream, stream_of(tier, layout, x, (45,)))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier", LOSSY)
def test_crop_inside_archived_block_keeps_what_was_read(tier, layout):
    """The read view of positions < n is unchanged by the crop: the cut block's tokens come back decoded."""
    x = torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(2))
    cache = CodecKVCache(TIERS[tier], layout=layout, max_length=100)
    cache.append(x[:, :, :33], x[:, :, :33])
    before = [view[:, :, :21].clone() for view in cache.read()]
    cache.crop(21)
    assert cache.get_seq_length() == 21 and cache.keys.archived_tokens == 16
    for stream, view in zip((cache.keys, cache.values), before, strict=True):
        assert torch.equal(stream.read()[:, :, :21], view)
        assert torch.equal(ops.read(*stream.state, stream.tail, stream.length, stream.spec)[:, :, :21], view)
    q = torch.randn(1, 2, 1, 8)
    k, v = before
    ref = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1) @ v
    torch.testing.assert_close(cache.attention(q), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("tier", "keep"), [("png", 19), ("jpeg-int8", 16), ("png-half", 24)])
def test_crop_is_repeatable(tier, keep, layout):
    """Cropping twice is cropping once; crop, regrow, crop again gives the same state (lossy tiers: at a block
    boundary, since regrowing re-encodes the cut block from its decoded tokens)."""
    x = torch.randn(1, 2, 60, 8, generator=torch.Generator().manual_seed(3))
    stream = stream_of(tier, layout, x, (30, 37))
    stream.crop(keep)
    once = snapshot(stream)
    stream.crop(keep)
    assert_same_snapshot(once, snapshot(stream))
    view = stream.read().clone()
    stream.append(x[:, :, 40:57])
    stream.crop(keep)
    assert torch.equal(stream.read(), view)
    assert torch.equal(stream.tail, once[0][3])
    stream.crop(-4)
    assert stream.get_seq_length() == keep - 4
    stream.crop(100)  # longer than the stream: nothing to drop
    assert stream.get_seq_length() == keep - 4


@pytest.mark.parametrize("tier", list(TIERS))
def test_static_memo_equals_read_op_after_crop_and_regrow(tier):
    """The static layout's read() is the whole memo: past the length it must hold zeros, like flashcodec::read."""
    x = torch.randn(1, 2, 60, 8, generator=torch.Generator().manual_seed(4))
    stream = stream_of(tier, "static", x, (30, 37))
    for keep in (21, 27, 16, 3):
        stream.crop(keep)
        stream.append(x[:, :, 50:51])
        assert torch.equal(stream.read(), ops.read(*stream.state, stream.tail, stream.length, stream.spec))


# ---------------------------------------------------------------------------------------------------- storage


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("memoize", [True, False])
@pytest.mark.parametrize("tier", list(TIERS))
def test_storage_bytes_count_every_tensor_held(tier, memoize, layout):
    cache = CodecKVCache(TIERS[tier], TIERS["png"], layout=layout, max_length=300, memoize=memoize)
    assert cache.storage_breakdown()["total"] == 0
    x = torch.randn(2, 3, 203, 16).to(torch.float16)
    cache.append(x, x)
    nbytes = cache.storage_breakdown()
    held = [*cache.keys.state, cache.keys.tail, cache.keys.length, *cache.values.state, cache.values.tail,
            cache.values.length]
    memos = [m for m in (cache.keys.memo, cache.values.memo) if m is not None]
    assert len(memos) == (2 if memoize else 0)
    assert nbytes["total"] == sum(t.nbytes for t in held + memos)
    assert type(cache.storage_bytes()) is int and cache.storage_bytes() == nbytes["total"]
    assert cache.storage_bytes() == cache.keys.storage_bytes() + cache.values.storage_bytes()
    assert nbytes["memo"] == sum(m.nbytes for m in memos)
    states = [*cache.keys.state, *cache.values.state]
    assert nbytes["archive"] + nbytes["scales"] + nbytes["index"] == sum(t.nbytes for t in states)
    per_block = TIERS[tier].bytes_per_block(16, torch.float16) + TIERS["png"].bytes_per_block(16, torch.float16)
    assert nbytes["archive_used"] == (203 // R) * 2 * 3 * per_block
    cache.release_memo()
    after = cache.storage_breakdown()
    assert after["memo"] == 0 and after["total"] == nbytes["total"] - nbytes["memo"]


def test_int8_tier_is_smaller_than_raw_by_the_expected_factor():
    d = 64
    stream = CodecStream(TIERS["jpeg-int8"], "static", max_length=128, memoize=False)
    stream.append(torch.randn(1, 4, 128, d).to(torch.bfloat16))
    nbytes = stream.storage_breakdown()
    raw = 1 * 4 * 128 * d * 2  # bf16
    # int8 codes (1 byte per value) + one fp32 scale per (block, frequency): 8 * 64 + 8 * 4 bytes per 8 x 64 block
    assert nbytes["archive"] + nbytes["scales"] == raw * (R * d + 4 * R) // (R * d * 2)
    assert nbytes["archive_used"] == nbytes["archive"] + nbytes["scales"]
    assert (nbytes["archive"] + nbytes["scales"]) / raw == pytest.approx(544 / 1024)
    png = CodecStream(TIERS["png"], "static", max_length=128, memoize=False)
    png.append(torch.randn(1, 4, 128, d).to(torch.bfloat16))
    assert png.storage_breakdown()["archive"] == 2 * raw  # fp32 deltas of a bf16 stream: honestly twice the raw size


# ---------------------------------------------------------------------------------------------------- beams


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("k_tier", "v_tier"), [("jpeg-int8", "png-half"), ("png", "jpeg-k3")])
def test_index_select_moves_everything_together(k_tier, v_tier, layout):
    """Select/reorder beams, keep decoding: equal to running each selected sequence on its own."""
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(4, 2, 60, 8, generator=gen)
    v = torch.randn(4, 2, 60, 8, generator=gen)
    pick = torch.tensor([2, 0, 2, 1])
    cache = CodecKVCache(TIERS[k_tier], TIERS[v_tier], layout=layout, max_length=64)
    cache.append(k[:, :, :21], v[:, :, :21])
    cache.append(k[:, :, 21:27], v[:, :, 27:27 + 6])
    cache.index_select(pick)
    later_k, later_v = torch.randn(4, 2, 9, 8, generator=gen), torch.randn(4, 2, 9, 8, generator=gen)
    cache.append(later_k[:, :, :4], later_v[:, :, :4])
    for i in range(4, 9):
        cache.append(later_k[:, :, i: i + 1], later_v[:, :, i: i + 1])
    q = torch.randn(4, 4, 1, 8, generator=gen)
    out = cache.attention(q)
    for row, src in enumerate(pick.tolist()):
        alone = CodecKVCache(TIERS[k_tier], TIERS[v_tier], layout=layout, max_length=64)
        alone.append(k[src: src + 1, :, :21], v[src: src + 1, :, :21])
        alone.append(k[src: src + 1, :, 21:27], v[src: src + 1, :, 27:33])
        alone.append(later_k[row: row + 1, :, :4], later_v[row: row + 1, :, :4])
        for i in range(4, 9):
            alone.append(later_k[row: row + 1, :, i: i + 1], later_v[row: row + 1, :, i: i + 1])
        for mine, theirs in ((cache.keys, alone.keys), (cache.values, alone.values)):
            for a, b in zip(mine.state, theirs.state, strict=True):
                assert torch.equal(a[row: row + 1], b)
            assert torch.equal(mine.tail[row: row + 1], theirs.tail)
            assert torch.equal(mine.memo[row: row + 1], theirs.memo)
        for a, b in zip(cache.read(), alone.read(), strict=True):
            assert torch.equal(a[row: row + 1], b)
        torch.testing.assert_close(out[row: row + 1], alone.attention(q[row: row + 1]), atol=1e-6, rtol=0)


def test_static_beam_reorder_keeps_buffer_addresses():
    """A same-size reorder of a static layout permutes in place: CUDA graphs keep valid pointers."""
    cache = CodecKVCache(TIERS["jpeg-int8"], layout="static", max_length=32)
    x = torch.randn(3, 2, 13, 8)
    cache.append(x, x)
    before = [t.data_ptr() for t in (*cache.keys.state, cache.keys.tail, cache.keys.memo)]
    expected = cache.keys.read().index_select(0, torch.tensor([2, 2, 0]))
    cache.index_select(torch.tensor([2, 2, 0]))
    assert [t.data_ptr() for t in (*cache.keys.state, cache.keys.tail, cache.keys.memo)] == before
    assert torch.equal(cache.keys.read(), expected)


def test_repeat_interleave_expands_every_tensor():
    x = torch.randn(2, 1, 19, 4)
    cache = CodecKVCache(TIERS["jpeg-int8"])
    cache.append(x, x)
    cache.repeat_interleave(3)
    twin = CodecKVCache(TIERS["jpeg-int8"])
    twin.append(x.repeat_interleave(3, dim=0), x.repeat_interleave(3, dim=0))
    for a, b in ((cache.keys, twin.keys), (cache.values, twin.values)):
        assert_same_content(a, b)
        assert torch.equal(a.memo, b.memo)


# ---------------------------------------------------------------------------------------------------- rejected calls


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"codec": "jpeg"}, TypeError, "codec"),
    ({"layout": "paged"}, ValueError, "layout"),
    ({"layout": "static"}, ValueError, "max_length"),
    ({"layout": "static", "max_length": 0}, ValueError, "max_length"),
    ({"layout": "static", "max_length": 10.0}, ValueError, "max_length"),
    ({"layout": "static", "max_length": True}, ValueError, "max_length"),
])
def test_bad_stream_options(kwargs, error, name):
    kwargs = {"codec": TIERS["jpeg"], **kwargs}
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
    ((TIERS["jpeg"],), {"mode": "jpeg"}, ValueError, "not both"),
    ((), {"mode": "gif"}, ValueError, "mode"),
    ((), {"mode": "jpeg", "keep_ratio": 0.5}, ValueError, "keep_ratio"),
    ((), {"mode": "png", "keep_freqs": 2}, ValueError, "keep_freqs"),
    ((), {"keep_freqs": 9}, ValueError, "keep_freqs"),
])
def test_bad_codec_keywords(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        CodecKVCache(*args, **kwargs)


def test_key_and_value_codecs_must_share_block_size():
    with pytest.raises(ValueError, match="block_size"):
        CodecKVCache(make_codec("jpeg", block_size=8), make_codec("png", block_size=4))


BAD_NEW = {
    "wrong heads": (lambda: torch.randn(2, 3, 1, 8), ValueError, r"\(2, 2, T, 8\)"),
    "wrong head_dim": (lambda: torch.randn(2, 2, 1, 4), ValueError, r"\(2, 2, T, 8\)"),
    "wrong batch": (lambda: torch.randn(1, 2, 1, 8), ValueError, r"\(2, 2, T, 8\)"),
    "wrong dtype": (lambda: torch.randn(2, 2, 1, 8, dtype=torch.float64), ValueError, "float32"),
    "integer": (lambda: torch.ones(2, 2, 1, 8, dtype=torch.int64), TypeError, "floating"),
    "rank 3": (lambda: torch.randn(2, 1, 8), ValueError, "B, H, T, D"),
    "empty": (lambda: torch.randn(2, 2, 0, 8), ValueError, "T >= 1"),
    "not a tensor": (lambda: [[1.0]], ValueError, "tensor"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(BAD_NEW))
def test_rejected_append_changes_nothing(case, layout):
    make, error, match = BAD_NEW[case]
    stream = stream_of("jpeg-int8", layout, torch.randn(2, 2, 20, 8), (11, 13))
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
    with pytest.raises(ValueError, match="max_length=20"):
        stream.append(torch.randn(1, 1, 21 if fresh else 6, 4))
    assert_same_snapshot(before, snapshot(stream))
    # the rejected call allocated nothing: a fresh stream still takes any shape and dtype
    stream.append(torch.randn(1, 1, 5, 4, dtype=torch.float64 if fresh else torch.float32))
    assert stream.get_seq_length() == (5 if fresh else 20)


def test_static_overflow_in_a_compiled_step_is_observable():
    """A compiled step skips the host length check: the append op drops what lies past the capacity, keeps every
    stored block intact, and the next host-side length query raises instead of returning a wrong length."""
    stream = CodecStream(TIERS["jpeg-int8"], "static", max_length=20)
    stream.append(torch.randn(1, 2, 18, 4))
    archived = [t.clone() for t in stream.state]

    @torch.compile(backend="eager", fullgraph=True)
    def step(x):
        stream.append(x)

    step(torch.randn(1, 2, 9, 4))  # 27 > max_length = 20 (capacity 24)
    assert int(stream.length) == 27
    for now, then in zip(stream.state, archived, strict=True):
        assert torch.equal(now[:, :, :2], then[:, :, :2])  # the blocks stored before are untouched
    with pytest.raises(RuntimeError, match="max_length=20"):
        stream.get_seq_length()


def test_cache_append_rejects_mismatched_keys_and_values_before_any_change():
    cache = CodecKVCache(TIERS["jpeg"], TIERS["png"], layout="static", max_length=12)
    cache.append(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    before = snapshot(cache.keys), snapshot(cache.values)
    for k, v, match in [
        (torch.randn(1, 2, 3, 4), torch.randn(1, 2, 2, 4), "share"),
        (torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 5), "new tokens"),
        (torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), "max_length"),
    ]:
        with pytest.raises(ValueError, match=match):
            cache.append(k, v)
        assert_same_snapshot(before[0], snapshot(cache.keys))
        assert_same_snapshot(before[1], snapshot(cache.values))


def test_bad_crop_arguments_change_nothing():
    stream = stream_of("png", "dynamic", torch.randn(1, 1, 20, 4), (13,))
    before = snapshot(stream)
    with pytest.raises(TypeError, match="n must be an int"):
        stream.crop(5.0)
    with pytest.raises(TypeError, match="n must be an int"):
        stream.crop(True)
    with pytest.raises(ValueError, match="cannot crop"):
        stream.crop(-14)
    assert_same_snapshot(before, snapshot(stream))


def test_reads_before_any_token_fail_clearly():
    cache = CodecKVCache(TIERS["jpeg"])
    with pytest.raises(RuntimeError, match="before any token"):
        cache.read()
    with pytest.raises(RuntimeError, match="at least one token"):
        cache.attention(torch.randn(1, 1, 1, 8))
