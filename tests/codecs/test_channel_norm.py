"""Per-channel exponents against outlier channels (``codecs/channel_norm.py``): what they measure and what they do."""

from __future__ import annotations

import pytest
import torch
from codec_tiers import FAST
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx.codecs import make_codec
from flashcodec_fx.codecs.channel_norm import MAX_EXPONENT, OUTLIER_RATIO, channel_exponents, channel_factors


def _counted(t: int, skip: int = 0) -> torch.Tensor:
    return torch.arange(t) >= skip


def test_a_channel_k_times_wider_than_the_median_is_brought_within_the_ratio():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 400, 32, generator=gen)
    x[..., 3] *= 16  # 16x the median spread: exponent floor(log2(16 / 2)) = 3
    x[..., 9] *= 5  # 5x: floor(log2(2.5)) = 1
    x[..., 20] += 100.0  # an offset is not a spread
    e = channel_exponents(x, _counted(400))
    want = torch.zeros(32, dtype=torch.uint8)
    want[3], want[9] = 3, 1
    assert e.dtype == torch.uint8 and e.shape == (1, 1, 32)
    assert torch.equal(e[0, 0], want)
    spread = (x / channel_factors(e)[:, :, None]).std(2)[0, 0]
    assert float(spread.max() / spread.median()) <= 2 * OUTLIER_RATIO


def test_only_counted_tokens_are_measured():
    x = torch.randn(2, 3, 20, 16)
    x[:, :, :4, 5] = 1e4  # sinks: huge, not counted
    assert torch.equal(channel_exponents(x, _counted(20, skip=4)), channel_exponents(x[:, :, 4:], _counted(16)))


@pytest.mark.parametrize("tokens", [0, 1])
def test_fewer_than_two_tokens_measure_nothing(tokens):
    assert not channel_exponents(torch.randn(1, 2, tokens, 8) * 100, _counted(tokens)).any()


def test_constant_channels_and_zeros_give_zero_exponents():
    x = torch.zeros(1, 1, 10, 8)
    assert not channel_exponents(x, _counted(10)).any()
    x[..., 0] = torch.arange(10.0)  # only one channel moves: the median spread is 0
    assert not channel_exponents(x, _counted(10)).any()


@FAST
@given(shift=st.lists(st.integers(0, 20), min_size=8, max_size=8), seed=st.integers(0, 1000))
def test_exponents_stay_in_range_and_factors_are_exact_powers_of_two(shift, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, 30, 8, generator=gen) * torch.exp2(torch.tensor(shift, dtype=torch.float32))
    e = channel_exponents(x, _counted(30))
    assert int(e.max()) <= MAX_EXPONENT
    n = channel_factors(e)
    assert torch.equal(torch.exp2(torch.log2(n).round()), n)
    assert torch.equal((x / n[:, :, None]) * n[:, :, None], x)  # powers of two scale floats exactly


def test_normalize_is_a_spec_field_only_when_set():
    base = make_codec("jpeg", block_size=1, quant_bits=3, levels="lloyd", rotate=True)
    norm = make_codec("jpeg", block_size=1, quant_bits=3, levels="lloyd", rotate=True, normalize=True)
    assert "norm" not in base.spec and norm.spec.endswith("norm=1;sinks=0;window=0") and norm.normalize
    with pytest.raises(TypeError, match="normalize must be a bool"):
        make_codec("jpeg", block_size=1, normalize=1)
    assert not make_codec("jpeg", block_size=1, normalize=True).stores_raw
