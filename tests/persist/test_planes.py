"""Plane transforms: split / join are inverses bitwise for every bit pattern, and each transform puts the bits it
promises into each plane."""

from __future__ import annotations

import pytest
import torch
from codec_tiers import FAST
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx.persist import planes

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
shapes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 9), st.integers(1, 5))


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern of ``dtype`` equally likely (NaNs, infinities, subnormals and -0 included)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=torch.Generator().manual_seed(seed),
                        dtype=torch.uint8)
    return raw.view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


@FAST
@given(shape=shapes, dtype=st.sampled_from(FLOATS), transform=st.sampled_from(planes.TRANSFORMS),
       seed=st.integers(0, 2**31))
def test_split_join_round_trip_bitwise(shape, dtype, transform, seed):
    x = random_bits(shape, dtype, seed)
    if transform == "expsign" and not planes.fits_expsign(x):
        with pytest.raises(ValueError, match="256"):
            planes.split(x, transform)
        return
    parts, table = planes.split(x, transform)
    assert len(parts) == planes.plane_count(transform, dtype)
    assert all(p.dtype == torch.uint8 and p.shape == (*shape[:-2], shape[-1], shape[-2]) for p in parts)
    assert same_bits(planes.join(parts, transform, dtype, table), x)


@pytest.mark.parametrize("dtype", FLOATS)
def test_fields_planes_hold_exponent_then_sign_mantissa(dtype):
    x = torch.tensor([[1.0, -2.0], [0.5, -0.0]], dtype=dtype)
    exponent, *rest = planes.split(x, "fields")[0]
    exp_bits, mant_bits = planes.FLOAT_BITS[dtype]
    bias = (1 << (exp_bits - 1)) - 1
    assert exponent.T.tolist() == [[bias, bias + 1], [bias - 1, 0]]
    sign_mantissa = sum(p.to(torch.int64) << (8 * i) for i, p in enumerate(rest))
    assert (sign_mantissa.T >> mant_bits).tolist() == [[0, 1], [0, 1]]  # the sign bit above the (zero) mantissa


def test_expsign_symbols_index_the_sorted_pairs():
    x = torch.tensor([[1.0], [-1.0], [4.0], [1.5]], dtype=torch.bfloat16)
    (symbols, mantissa), table = planes.split(x, "expsign")
    assert table.tolist() == [127 * 2, 127 * 2 + 1, 129 * 2]  # (exponent, sign) pairs present, sorted
    assert symbols.tolist() == [[0, 1, 2, 0]] and mantissa.tolist() == [[0, 0, 0, 64]]


def test_expsign_refuses_more_than_256_pairs():
    x = torch.tensor([2.0 ** e for e in range(-126, 128)] + [-(2.0 ** e) for e in range(-126, -100)]).reshape(-1, 1)
    assert not planes.fits_expsign(x)
    with pytest.raises(ValueError, match="at most 256"):
        planes.split(x, "expsign")


def test_xor_planes_are_zero_where_a_channel_repeats():
    x = torch.full((6, 3), 0.75, dtype=torch.float16)
    parts, _ = planes.split(x, "xor")
    assert all(torch.count_nonzero(p[:, 1:]) == 0 for p in parts)  # every token after the first equals the previous


def test_bad_arguments_name_the_allowed_values():
    with pytest.raises(ValueError, match="transform must be one of"):
        planes.split(torch.zeros(2, 2), "gorilla")
    with pytest.raises(TypeError, match="bfloat16"):
        planes.split(torch.zeros(2, 2, dtype=torch.float64), "bytes")
    with pytest.raises(ValueError, match="at least 2 dims"):
        planes.split(torch.zeros(3), "bytes")
