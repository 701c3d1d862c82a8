"""Level sets: the grids as documented, Lloyd-Max tables equal to the published ones and at their fixed point."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _codec_data import FAST
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx.codecs import LEVELS, level_table, qmax
from flashcodec_fx.codecs.levels import LLOYD_MAX_BITS, MAX_BITS, base_scale, code_range, rms_sqrt

BITS = range(1, MAX_BITS + 1)
# Max (1960), "Quantizing for minimum distortion", Table I: the positive output levels for N(0, 1).
PUBLISHED_LLOYD = {
    1: (0.7979,),
    2: (0.4528, 1.5104),
    3: (0.2451, 0.7560, 1.3440, 2.1520),
    4: (0.1284, 0.3881, 0.6568, 0.9423, 1.2562, 1.6181, 2.0690, 2.7326),
}


def levels_bits():
    return [(lv, b) for lv in LEVELS for b in BITS if not (lv == "int" and b < 2 or lv == "lloyd" and b > LLOYD_MAX_BITS)]


@pytest.mark.parametrize("bits", list(PUBLISHED_LLOYD))
def test_lloyd_tables_match_published_values(bits):
    table = level_table("lloyd", bits).double()
    want = torch.tensor(PUBLISHED_LLOYD[bits], dtype=torch.float64)
    torch.testing.assert_close(table[1 << (bits - 1):], want, atol=1e-4, rtol=0)
    torch.testing.assert_close(table[: 1 << (bits - 1)], -want.flip(0), atol=1e-4, rtol=0)


def _normal_centroids(levels: torch.Tensor) -> torch.Tensor:
    """Centroid of N(0, 1) over each level's nearest-neighbour cell (fp64, computed here)."""
    inf = torch.tensor([math.inf], dtype=torch.float64)
    edges = torch.cat([-inf, (levels[1:] + levels[:-1]) / 2, inf])
    pdf = torch.exp(-0.5 * edges**2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + torch.erf(edges / math.sqrt(2)))
    return (pdf[:-1] - pdf[1:]) / (cdf[1:] - cdf[:-1])


@pytest.mark.parametrize("bits", range(1, LLOYD_MAX_BITS + 1))
def test_lloyd_levels_are_centroids_of_their_cells(bits):
    """The Lloyd-Max fixed point: each level is the mean of N(0, 1) over its cell (to 1e-6 of the local spacing)."""
    table = level_table("lloyd", bits).double()
    residual = (_normal_centroids(table) - table).abs()
    spacing = torch.cat([table[1:2] - table[:1], torch.minimum(table[1:-1] - table[:-2], table[2:] - table[1:-1]),
                         table[-1:] - table[-2:-1]]) if bits > 1 else table.abs()
    assert bool((residual <= 1e-6 * spacing).all()), float((residual / spacing).max())


@pytest.mark.parametrize("bits", range(LLOYD_MAX_BITS + 1, MAX_BITS + 1))
def test_lloyd_levels_stop_at_six_bits(bits):
    with pytest.raises(ValueError, match="'lloyd' is for 1..6 bits"):
        level_table("lloyd", bits)


@pytest.mark.parametrize(("levels", "bits"), levels_bits())
def test_tables_are_symmetric_increasing_fp32(levels, bits):
    table = level_table(levels, bits)
    assert table.shape == (1 << bits,) and table.dtype == torch.float32 and table.device.type == "cpu"
    assert bool((table.diff() > 0).all())
    if levels in ("midrise", "lloyd"):
        assert torch.equal(table, -table.flip(0))
    lo, hi = code_range(levels, bits)
    if levels == "int":  # the emitted codes 1..2**b - 1 are the symmetric -qmax..qmax
        assert torch.equal(table[lo: hi + 1], torch.arange(-qmax(bits), qmax(bits) + 1).float())


@pytest.mark.parametrize("bits", BITS)
def test_grids_as_documented(bits):
    n = 1 << bits
    assert torch.equal(level_table("uniform", bits), torch.arange(n).float())
    assert torch.equal(level_table("midrise", bits), torch.arange(n).float() - n / 2 + 0.5)
    if bits >= 2:
        assert torch.equal(level_table("int", bits), torch.arange(n).float() - n / 2)
        assert qmax(bits) == n // 2 - 1


@pytest.mark.parametrize(("levels", "bits"), levels_bits())
def test_code_ranges(levels, bits):
    lo, hi = code_range(levels, bits)
    assert hi == (1 << bits) - 1
    assert lo == (1 if levels == "int" else 0)


def test_int_needs_two_bits_and_unknown_sets_are_rejected():
    with pytest.raises(ValueError, match="levels='int' needs at least 2 bits"):
        level_table("int", 1)
    with pytest.raises(ValueError, match="levels must be one of"):
        level_table("gauss", 2)


def test_tables_are_cached_per_device():
    assert level_table("lloyd", 3) is level_table("lloyd", 3, "cpu")
    assert level_table("lloyd", 3, "meta").device.type == "meta"


@FAST
@given(levels=st.sampled_from(LEVELS), bits=st.integers(2, LLOYD_MAX_BITS), seed=st.integers(0, 2**31),
       offset=st.floats(-3, 3))
def test_base_scale_spans_the_slice(levels, bits, seed, offset):
    """The no-clipping scale of each level set: the outermost levels reach the slice's extremes (lloyd: the RMS)."""
    x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(seed)) + offset
    scale, zero = base_scale(levels, bits, x, (-1,))
    table = level_table(levels, bits)
    if levels == "uniform":
        torch.testing.assert_close(zero, x.amin(-1, keepdim=True))
        torch.testing.assert_close(zero + table[-1] * scale, x.amax(-1, keepdim=True))
        return
    assert float(zero.abs().max()) == 0
    amax = x.abs().amax(-1, keepdim=True)
    if levels == "lloyd":
        torch.testing.assert_close(scale, x.square().mean(-1, keepdim=True).sqrt())
    elif levels == "int":
        torch.testing.assert_close(table[-1] * scale, amax)
    else:  # midrise: amax sits half a step past the last level, so every value is within half a step of one
        torch.testing.assert_close((table[-1] + 0.5) * scale, amax)


def test_lloyd_rms_root_is_correctly_rounded():
    """The RMS's square root is the IEEE one (what C++ ``std::sqrt`` and Triton's ``sqrt_rn`` give the fast kernels),
    also where torch's CPU ``sqrt`` rounds the other way (a mean square a vLLM page store once coded one fp16 step
    apart from the reference)."""
    mean_square = torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 4
    mean_square[0] = 11.682511329650879 / 16
    exact = torch.from_numpy(np.sqrt(mean_square.numpy()))
    assert torch.equal(rms_sqrt(mean_square), exact)
    x = mean_square.sqrt()[:, None].expand(-1, 4)  # rows whose mean square is mean_square (to fp32 rounding)
    scale, _ = base_scale("lloyd", 3, x, (-1,))
    assert torch.equal(scale[:, 0], torch.from_numpy(np.sqrt(x.square().mean(-1).numpy())))
