"""`png` codec: exact round trip where the docstring says so (and not beyond), Top-M pruning keeps the largest deltas."""

from __future__ import annotations

import math

import pytest
import torch
from _codec_data import DTYPES, FAST, png_exact_data, randn
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx.codecs import codec_from_spec, make_codec

shapes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 4), st.integers(1, 33))


@FAST
@given(shape=shapes, r=st.integers(2, 32), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31))
def test_exact_round_trip_within_documented_dynamic_range(shape, r, dtype, seed):
    b, h, nb, d = shape
    x = png_exact_data((b, h, nb * r, d), dtype, seed)
    codec = make_codec("png", block_size=r, keep_ratio=1.0)
    enc = codec.encode(x)
    assert enc.data.dtype == torch.float32 and enc.data.shape == (b, h, nb, r, d)
    assert enc.scale.shape == enc.zero.shape == (b, h, nb, 0) and enc.index.shape == (b, h, nb, 0, d)
    assert enc.scale.dtype == enc.zero.dtype == torch.float16 and enc.index.dtype == torch.uint8
    out = codec.decode(enc, dtype)
    assert out.dtype == dtype
    assert float((out.float() - x.float()).abs().max()) == 0.0


@FAST
@given(shape=shapes, r=st.integers(2, 32), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       seed=st.integers(0, 2**31))
def test_exact_for_any_values_next_to_zeros(shape, r, dtype, seed):
    """Every other token zero: each difference is a value itself or its negation, so any dynamic range is exact."""
    b, h, nb, d = shape
    gen = torch.Generator().manual_seed(seed)
    low = -24 if dtype == torch.float16 else -120
    exp = torch.randint(low, 15, (b, h, nb * r, d), generator=gen).float()
    x = (torch.pow(2.0, exp) * (1 + torch.rand(exp.shape, generator=gen))).to(dtype)
    x[:, :, 1::2] = 0
    codec = make_codec("png", block_size=r)
    assert torch.equal(codec.decode(codec.encode(x), dtype), x)


@pytest.mark.parametrize(("dtype", "big", "small"), [
    (torch.float32, 1e30, 1.0),            # difference 1 - 1e30 rounds to -1e30
    (torch.float16, 60000.0, 2.0**-24),    # factor 2**40 > 2**13
    (torch.bfloat16, 2.0**100, 1.0),       # factor 2**100 > 2**16
])
def test_not_exact_beyond_documented_dynamic_range(dtype, big, small):
    """The limit of the docstring's claim: a huge dynamic range between neighbours is NOT reproduced exactly."""
    x = torch.tensor([big, small, big, small], dtype=dtype).view(1, 1, 4, 1)
    codec = make_codec("png", block_size=4)
    out = codec.decode(codec.encode(x), dtype)
    assert not torch.equal(out, x)
    assert out[0, 0, 0, 0] == x[0, 0, 0, 0]  # the anchor itself is stored in full precision


@FAST
@given(shape=shapes, r=st.integers(3, 32), ratio=st.floats(0.01, 0.99), seed=st.integers(0, 2**31))
def test_pruning_keeps_the_top_m_deltas(shape, r, ratio, seed):
    b, h, nb, d = shape
    codec = make_codec("png", block_size=r, keep_ratio=ratio)
    m = max(1, math.ceil(ratio * (r - 1) - 1e-9))
    assert codec.kept_deltas == m and codec.rows == 1 + m
    x = png_exact_data((b, h, nb * r, d), torch.float32, seed, zeros=0.0)
    blocks = x.view(b, h, nb, r, d)
    deltas = blocks[..., 1:, :] - blocks[..., :-1, :]
    enc = codec.encode(x)
    assert enc.data.shape == (b, h, nb, 1 + m, d) and enc.data.dtype == torch.float32
    if m == r - 1:
        assert codec.index_rows == 0 and enc.index.shape == (b, h, nb, 0, d)
        assert torch.equal(codec.decode(enc, torch.float32), x)
        return
    assert enc.index.shape == (b, h, nb, m, d) and enc.index.dtype == torch.uint8
    assert torch.equal(enc.data[..., 0, :], blocks[..., 0, :])
    pos = enc.index.long()
    assert bool((pos.sort(dim=-2).values.diff(dim=-2) > 0).all()), "kept positions must be distinct"
    assert torch.equal(enc.data[..., 1:, :], deltas.gather(-2, pos))
    kept = torch.zeros_like(deltas, dtype=torch.bool).scatter_(-2, pos, True)
    mag = deltas.abs()
    smallest_kept = mag.masked_fill(~kept, float("inf")).amin(dim=-2)
    largest_dropped = mag.masked_fill(kept, -1.0).amax(dim=-2)
    assert bool((smallest_kept >= largest_dropped).all())
    pruned = torch.where(kept, deltas, torch.zeros_like(deltas))
    expected = torch.cat([blocks[..., :1, :], pruned], dim=-2).double().cumsum(dim=-2).flatten(-3, -2)
    err = (codec.decode(enc, torch.float32).double() - expected).abs().max()
    assert float(err) <= 2.0**-23 * 2 * r * float(x.abs().max())  # r fp32 additions of terms <= 2 max|x|


@FAST
@given(shape=shapes, r=st.integers(2, 16), ratio=st.sampled_from([0.3, 0.5, 1.0]), seed=st.integers(0, 2**31))
def test_decode_is_synthesis_times_stored_rows(shape, r, ratio, seed):
    b, h, nb, d = shape
    x = randn((b, h, nb * r, d), torch.float32, seed)
    codec = make_codec("png", block_size=r, keep_ratio=ratio)
    a = codec.synthesis()
    assert torch.equal(a, torch.tril(torch.ones(r, r)))
    rows = codec.stored_rows(codec.encode(x), d)
    assert rows.shape == (b, h, nb, r, d) and codec.dense_rows == r
    expected = (a.double() @ rows.double()).flatten(-3, -2)
    torch.testing.assert_close(codec.decode(codec.encode(x), torch.float64), expected, atol=1e-5, rtol=1e-5)


def test_spec_round_trips_for_pruned_codecs():
    for r in (2, 3, 8, 16, 256):
        for ratio in (0.01, 0.25, 0.5, 0.7, 1.0):
            codec = make_codec("png", block_size=r, keep_ratio=ratio, sinks=r % 3, window=r // 2)
            back = codec_from_spec(codec.spec)
            assert back.spec == codec.spec and back.kept_deltas == codec.kept_deltas
            assert (back.sinks, back.window) == (codec.sinks, codec.window)


def test_residual_policy_does_not_change_the_stored_form():
    """Sinks and window decide which tokens are archived, not how a group is stored; group = block for png."""
    x = png_exact_data((1, 2, 16, 8), torch.float32, seed=3)
    plain, residual = make_codec("png", block_size=8), make_codec("png", block_size=8, sinks=3, window=5)
    assert residual.group == 8 and residual.tail_capacity == 5 + 8
    for a, b in zip(plain.encode(x), residual.encode(x), strict=True):
        assert torch.equal(a, b)
