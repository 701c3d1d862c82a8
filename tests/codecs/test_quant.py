"""The Quantizer: every level set x scale axis x bit table quantizes to the nearest stored level, within half a step
inside the clipping range; fp16 scales used exactly as stored; the search never loses to no search."""

from __future__ import annotations

import pytest
import torch
from _codec_data import FAST, bit_table_and_levels
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx.codecs import AXES, LEVELS, Quantizer, level_table, qmax
from flashcodec_fx.codecs.levels import code_range
from flashcodec_fx.codecs.pack import unpack
from flashcodec_fx.codecs.quant import fp16_toward

GRIDS = ("int", "uniform", "midrise")
LEAD = 2  # leading (batch-like) dim of the test rows
FP16_ROUNDING, FP16_SUBNORMAL_ROUNDING = 2.0**-11, 2.0**-25  # half an ulp: relative (normal), absolute (subnormal)


@st.composite
def quantizers(draw, levels=LEVELS, search=None, axes=AXES):
    """A valid Quantizer: 1-5 rows, 1-8 bits per row, one level set per scale class (int: >= 2 bits; uniform: one
    width per class), 1-3 blocks per group on the channel axis."""
    axis = draw(st.sampled_from(axes))
    bits, chosen = bit_table_and_levels(draw, axis, draw(st.integers(1, 5)), levels)
    blocks = 1 if axis == "token" else draw(st.integers(1, 3))
    return Quantizer(tuple(bits), tuple(chosen), axis, blocks, draw(st.booleans()) if search is None else search)


def rows_for(q: Quantizer, d: int, seed: int, amp: float, offset: float) -> torch.Tensor:
    """``(LEAD, g, K, D)`` fp32 rows: Gaussian times ``amp`` plus ``offset``, some channels 10x larger."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(LEAD, q.blocks, q.rows, d, generator=gen) * amp
    x[..., : d // 8] *= 10
    return x + offset


def per_value(q: Quantizer, scale: torch.Tensor, zero: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of every value ``(..., g, K, D)`` from the documented layouts (fp32): token axis
    ``(..., g, classes)``, channel axis ``(..., classes, D)``; zero points only for ``uniform`` classes, in order."""
    s, z = torch.empty(shape), torch.zeros(shape)
    zero_slot = 0
    for c, rows in enumerate(q.classes):
        for j in rows:
            if q.axis == "token":
                s[..., j, :] = scale[..., c].float()[..., None]
            else:
                s[..., j, :] = scale[..., c, :].float()[..., None, :]
            if q.levels[c] == "uniform":
                z[..., j, :] = (zero[..., zero_slot].float()[..., None] if q.axis == "token"
                                else zero[..., zero_slot, :].float()[..., None, :])
        zero_slot += q.levels[c] == "uniform"
    return s, z


def row_levels(q: Quantizer, j: int) -> tuple[torch.Tensor, str]:
    """The levels row ``j`` may emit (its code range) and its level set."""
    lv = q.levels[q.row_class[j]]
    lo, hi = code_range(lv, q.bits[j])
    return level_table(lv, q.bits[j])[lo: hi + 1], lv


def round_trip(q: Quantizer, x: torch.Tensor):
    packed, scale, zero = q.quantize(x)
    return packed, scale, zero, q.dequantize(packed, scale, zero, x.shape[-1])


data = dict(d=st.sampled_from([8, 16]), seed=st.integers(0, 2**31), amp=st.sampled_from([0.02, 1.0, 40.0]))


@FAST
@given(q=quantizers(), offset=st.sampled_from([0.0, 0.3, -1.0]), **data)
def test_stored_form_and_exact_decode(q, d, seed, amp, offset):
    """Shapes and dtypes as documented; codes in their range; decode is ``level[code] * scale + zero`` with exactly
    the stored fp16 values; every row's bytes unpack from its documented offset."""
    x = rows_for(q, d, seed, amp, offset * amp)
    packed, scale, zero, out = round_trip(q, x)
    assert packed.dtype == torch.uint8 and packed.shape == (LEAD, q.blocks, sum(q.bits) * d // 8)
    assert packed.shape[-1] == q.row_bytes(d)
    assert scale.dtype == zero.dtype == torch.float16
    assert scale.shape == (LEAD, *q.scale_shape(d)) and zero.shape == (LEAD, *q.zero_shape(d))
    assert bool(torch.isfinite(scale).all()) and bool((scale >= 0).all()) and bool(torch.isfinite(zero).all())
    assert out.dtype == torch.float32 and out.shape == x.shape
    codes = q.codes(packed, d)
    s, z = per_value(q, scale, zero, x.shape)
    for j, b in enumerate(q.bits):
        start = q.row_offsets[j] * d // 8
        assert torch.equal(unpack(packed[..., start: start + b * d // 8], b, d), codes[..., j, :])
        lv = q.levels[q.row_class[j]]
        lo, hi = code_range(lv, b)
        assert lo <= int(codes[..., j, :].min()) and int(codes[..., j, :].max()) <= hi
        table = level_table(lv, b)
        assert torch.equal(out[..., j, :], table[codes[..., j, :].long()] * s[..., j, :] + z[..., j, :])


@FAST
@given(q=quantizers(), offset=st.sampled_from([0.0, 0.5, 3.0]), **data)
def test_each_value_decodes_to_its_nearest_stored_level(q, d, seed, amp, offset):
    """With the stored scale and zero point, no level of a row's range is closer to a value than the decoded one
    (the codes were computed with the rounded fp16 values)."""
    x = rows_for(q, d, seed, amp, offset * amp)
    _, scale, zero, out = round_trip(q, x)
    s, z = per_value(q, scale, zero, x.shape)
    tol = 1e-6 * float(x.abs().max() + z.abs().max() + s.max()) + 1e-30
    for j in range(q.rows):
        levels, _ = row_levels(q, j)
        candidates = levels.view(-1, 1, 1, 1) * s[None, ..., j, :] + z[None, ..., j, :]
        nearest = (candidates - x[None, ..., j, :]).abs().amin(0)
        got = (out[..., j, :] - x[..., j, :]).abs()
        assert bool((got <= nearest + tol).all()), (j, float((got - nearest).max()))


@FAST
@given(q=quantizers(levels=GRIDS), offset=st.sampled_from([0.0, 0.5, 3.0]), **data)
def test_half_a_step_inside_the_clipping_range(q, d, seed, amp, offset):
    """Grids (int / uniform / midrise): a value between the outermost levels is within half a step (the scale)."""
    x = rows_for(q, d, seed, amp, offset * amp)
    _, scale, zero, out = round_trip(q, x)
    s, z = per_value(q, scale, zero, x.shape)
    for j in range(q.rows):
        levels, _ = row_levels(q, j)
        low, high = levels[0] * s[..., j, :] + z[..., j, :], levels[-1] * s[..., j, :] + z[..., j, :]
        inside = (x[..., j, :] >= low) & (x[..., j, :] <= high)
        err = (out[..., j, :] - x[..., j, :]).abs()
        bound = 0.5 * s[..., j, :] * (1 + 1e-5) + 1e-6 * (x[..., j, :].abs() + z[..., j, :].abs())
        assert bool((err <= bound)[inside].all()), (j, float((err - bound)[inside].max()))


@FAST
@given(q=quantizers(levels=GRIDS, search=False), offset=st.sampled_from([0.0, 0.5, -1.0]), **data)
def test_without_search_every_value_is_within_half_a_step(q, d, seed, amp, offset):
    """No search: the level range spans each slice up to the fp16 rounding of scale and zero (which moves the
    extremes' distance to the outermost level by at most ``(|level| + 1/2) * ds + dz``, ``ds`` / ``dz`` half an fp16
    ulp of scale / zero), so every value is within half a step of a level plus that. Data offsets up to the spread
    (larger ones: test_uniform_offset_data_within_half_a_step)."""
    x = rows_for(q, d, seed, amp, offset * amp)
    _, scale, zero, out = round_trip(q, x)
    s, z = per_value(q, scale, zero, x.shape)
    outer = torch.stack([row_levels(q, j)[0].abs().max() for j in range(q.rows)]).view(q.rows, 1)
    err = (out - x).abs()
    ds, dz = ((FP16_ROUNDING * t.abs()).clamp_min(FP16_SUBNORMAL_ROUNDING) for t in (s, z))
    bound = 0.5 * s + ((outer + 0.5) * ds + dz) * (1 + 1e-3) + 1e-6 * x.abs()
    assert bool((err <= bound).all()), float((err - bound).max())


def test_uniform_offset_data_within_half_a_step():
    """Offset far from 0 relative to the spread (x = 3 + 0.01 N(0, 1)): the zero point rounds down and the scale up
    to fp16, so the stored grid still covers the slice and no value is clipped."""
    q = Quantizer((8,), ("uniform",), "token", 1, False)
    x = 3 + 0.01 * torch.randn(4, 1, 1, 64, generator=torch.Generator().manual_seed(0))
    _, scale, _, out = round_trip(q, x)
    steps = (out - x).abs().amax(-1).flatten() / scale.float().flatten()
    assert float(steps.max()) <= 0.5 * (1 + 2e-3), steps.tolist()


@FAST
@given(q=quantizers(search=True), offset=st.sampled_from([0.0, 0.5, 2.0]), **data)
def test_search_never_increases_the_squared_error(q, d, seed, amp, offset):
    """Per scale slice, the searched scale's squared error is at most the no-search one (factor 1 is a candidate)."""
    x = rows_for(q, d, seed, amp, offset * amp)
    x[..., 0, : d // 2] = x[..., 0, : d // 2] * 4  # a few outliers: clipping pays off somewhere
    plain = Quantizer(q.bits, q.levels, q.axis, q.blocks, False)
    searched_out, plain_out = round_trip(q, x)[3], round_trip(plain, x)[3]
    dims = (-1,) if q.axis == "token" else (-3, -2)
    for rows in q.classes:
        sl = slice(rows[0], rows[-1] + 1)
        e_search = (searched_out[..., sl, :] - x[..., sl, :]).square().sum(dims)
        e_plain = (plain_out[..., sl, :] - x[..., sl, :]).square().sum(dims)
        assert bool((e_search <= e_plain * (1 + 1e-6) + 1e-12).all()), float((e_search - e_plain).max())


@pytest.mark.parametrize("search", [False, True])
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("levels", LEVELS)
def test_all_zero_slices_decode_to_zeros(levels, axis, search):
    bits = (3, 2, 2) if levels != "uniform" else (3, 3, 3)
    n_classes = 3 if axis == "token" else 2
    q = Quantizer(bits, (levels,) * n_classes, axis, 1 if axis == "token" else 2, search)
    x = torch.randn(3, q.blocks, 3, 8, generator=torch.Generator().manual_seed(1))
    x[0] = 0  # one whole group of zeros, next to non-zero groups
    packed, scale, zero, out = round_trip(q, x)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(scale).all())
    assert not out[0].any() and not scale[0].any() and not zero[0].any()
    assert out[1:].any()


def up(x: torch.Tensor) -> torch.Tensor:
    """Scales round up to fp16, zero points down: the stored grid covers what the exact one did."""
    return fp16_toward(x, up=True).half()


def down(x: torch.Tensor) -> torch.Tensor:
    return fp16_toward(x, up=False).half()


@pytest.mark.parametrize("levels", LEVELS)
def test_token_axis_scales_are_the_documented_formulas(levels):
    """No search: int amax/qmax, midrise amax/2**(b-1), uniform (max - min)/(2**b - 1) with zero = min, lloyd the
    RMS; one per (row, slice) over head_dim, in fp16 (scales rounded up, zero points down, the uniform step then
    taken from the rounded zero point)."""
    bits = (4, 3) if levels != "int" else (4, 2)
    q = Quantizer(bits, (levels, levels), "token", 1, False)
    x = torch.randn(5, 1, 2, 16, generator=torch.Generator().manual_seed(2)) + 0.25
    _, scale, zero, _ = round_trip(q, x)
    for j, b in enumerate(bits):
        row = x[:, 0, j]
        amax = row.abs().amax(-1)
        low = down(row.amin(-1))
        want = {"int": amax / qmax(b), "midrise": amax / (1 << (b - 1)), "lloyd": row.square().mean(-1).sqrt(),
                "uniform": (row.amax(-1) - low.float()) / ((1 << b) - 1)}[levels]
        torch.testing.assert_close(scale[:, 0, j], up(want), atol=0, rtol=2.0**-10)
        if levels == "uniform":
            assert torch.equal(zero[:, 0, j], low)
    assert zero.shape[-1] == (2 if levels == "uniform" else 0)


@pytest.mark.parametrize("ac", ["int", "midrise", "lloyd"])
def test_channel_axis_shares_one_ac_step_per_channel(ac):
    """Channel axis: DC has its own scale per channel; every AC row (whatever its width) decodes with one shared
    per-channel scale. Grids: the no-clipping step of the row that needs the largest one."""
    bits = (5, 4, 3, 2)
    q = Quantizer(bits, ("uniform", ac), "channel", 3, False)
    x = torch.randn(2, 3, 4, 16, generator=torch.Generator().manual_seed(3))
    x[:, :, 3] *= 5  # the 2-bit row has the widest range: it sets the step
    packed, scale, zero, out = round_trip(q, x)
    assert scale.shape == (2, 2, 16) and zero.shape == (2, 1, 16)
    low = down(x[:, :, 0].amin(1))
    assert torch.equal(zero[:, 0], low)
    torch.testing.assert_close(scale[:, 0], up((x[:, :, 0].amax(1) - low.float()) / 31), atol=0, rtol=2.0**-10)
    ac_rows = x[:, :, 1:]
    if ac == "lloyd":
        want = ac_rows.square().mean((1, 2)).sqrt()
    else:
        div = torch.tensor([qmax(b) if ac == "int" else 1 << (b - 1) for b in bits[1:]]).float()
        want = (ac_rows.abs().amax(1) / div[:, None]).amax(1)
    torch.testing.assert_close(scale[:, 1], up(want), atol=0, rtol=2.0**-10)
    codes = q.codes(packed, 16)
    for j, b in enumerate(bits[1:], start=1):
        table = level_table(ac, b)
        assert torch.equal(out[:, :, j], table[codes[:, :, j].long()] * scale[:, None, 1].float())


@pytest.mark.parametrize("levels", ["uniform", "lloyd", "int"])
def test_uniform_zero_points_only_where_uniform(levels):
    q = Quantizer((4, 4, 4), ("uniform", levels), "channel", 2, False)
    assert q.zero_classes == 1 + (levels == "uniform") and q.zero_shape(8) == (q.zero_classes, 8)
    assert q.zero_slot == (0, 1 if levels == "uniform" else -1)
    t = Quantizer((4, 4, 4), ("uniform", levels, "uniform"), "token")
    assert t.zero_slot == (0, 1 if levels == "uniform" else -1, 2 if levels == "uniform" else 1)


@pytest.mark.parametrize(("bits", "levels", "axis", "blocks", "d"), [
    ((8,) * 8, ("int",) * 8, "token", 1, 64),
    ((5, 3, 3, 2, 2, 2, 2, 2), ("uniform", "midrise"), "channel", 16, 64),
    ((2,), ("lloyd",), "token", 1, 64),
    ((4,), ("uniform",), "channel", 128, 128),
])
def test_group_bytes_counts_codes_scales_and_zero_points(bits, levels, axis, blocks, d):
    q = Quantizer(bits, levels, axis, blocks)
    scales = blocks * len(q.classes) if axis == "token" else len(q.classes) * d
    zeros = (blocks if axis == "token" else d) * q.zero_classes
    assert q.row_bytes(d) == sum(bits) * d // 8
    assert q.group_bytes(d) == blocks * sum(bits) * d // 8 + 2 * (scales + zeros)
    packed, scale, zero = q.quantize(torch.randn(1, blocks, len(bits), d))
    assert q.group_bytes(d) == packed.nbytes + scale.nbytes + zero.nbytes


def test_level_rows_pad_each_row_table():
    q = Quantizer((3, 1, 2), ("int", "lloyd", "midrise"))
    rows = q.level_rows()
    assert rows.shape == (3, 8) and rows.dtype == torch.float32
    for j, (b, lv) in enumerate(zip(q.bits, q.levels, strict=True)):
        assert torch.equal(rows[j, : 1 << b], level_table(lv, b)) and not rows[j, 1 << b:].any()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"bits": (4,), "levels": ("int",), "axis": "row"}, "scale_axis"),
    ({"bits": (0,), "levels": ("midrise",)}, "quant_bits"),
    ({"bits": (9,), "levels": ("midrise",)}, "quant_bits"),
    ({"bits": (True,), "levels": ("midrise",)}, "quant_bits"),
    ({"bits": (4, 4), "levels": ("int",)}, "one entry per scale class"),
    ({"bits": (1,), "levels": ("int",)}, "at least 2 bits"),
    ({"bits": (4, 3, 2), "levels": ("int", "uniform"), "axis": "channel"}, "one bit width per scale class"),
    ({"bits": (4,), "levels": ("int",), "blocks": 2}, "blocks must be 1"),
    ({"bits": (4,), "levels": ("gauss",)}, "levels must be one of"),
])
def test_bad_quantizer_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Quantizer(**kwargs)
