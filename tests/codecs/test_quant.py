"""The Quantizer: every level set x scale axis x bit table quantizes to the nearest stored level, within half a step
inside the clipping range; fp16 scales used exactly as stored; the search never loses to no search; "fit" stores the
least-squares scale of its codes and errs no more than at its start, about as little as the trials on Gaussian rows."""

from __future__ import annotations

import pytest
import torch
from _codec_data import FAST, bit_table_and_levels
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx.codecs import AXES, LEVELS, Quantizer, level_table, qmax
from flashcodec_fx.codecs.levels import code_range
from flashcodec_fx.codecs.pack import unpack
from flashcodec_fx.codecs.quant import fit_start, fp16_toward

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
    if search is None:
        search = st.sampled_from([False, True, "fit"])
    search = draw(search) if isinstance(search, st.SearchStrategy) else search
    return Quantizer(tuple(bits), tuple(chosen), axis, blocks, search)


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
@given(q=quantizers(search=st.sampled_from([False, True])), offset=st.sampled_from([0.0, 0.5, 3.0]), **data)
def test_each_value_decodes_to_its_nearest_stored_level(q, d, seed, amp, offset):
    """With the stored scale and zero point, no level of a row's range is closer to a value than the decoded one
    (the codes were computed with the rounded fp16 values). Not "fit": its codes are the nearest ones of its last
    pass's scale, the stored scale their least-squares refit (test_fit_*)."""
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
@given(q=quantizers(levels=GRIDS, search=st.sampled_from([False, True])), offset=st.sampled_from([0.0, 0.5, 3.0]),
       **data)
def test_half_a_step_inside_the_clipping_range(q, d, seed, amp, offset):
    """Grids (int / uniform / midrise): a value between the outermost levels is within half a step (the scale).
    Nearest codes of the stored scale: not "fit" (test_each_value_decodes_to_its_nearest_stored_level)."""
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


@pytest.mark.parametrize("search", [False, True, "fit"])
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


def slice_errors(q: Quantizer, x: torch.Tensor, out: torch.Tensor, c: int) -> torch.Tensor:
    """Squared error of class ``c``'s slices."""
    rows = q.classes[c]
    sl = slice(rows[0], rows[-1] + 1)
    return (out[..., sl, :] - x[..., sl, :]).square().sum((-1,) if q.axis == "token" else (-3, -2))


@FAST
@given(q=quantizers(search="fit"), offset=st.sampled_from([0.0, 0.5, 2.0]), **data)
def test_fit_errs_no_more_than_at_its_start(q, d, seed, amp, offset):
    """Each least-squares pass and each nearest-code pass can only lower a slice's squared error, so "fit" ends at
    most where its start scale (the closed-form clipping factor) puts it, up to the fp16 rounding of its scales."""
    x = rows_for(q, d, seed, amp, offset * amp)
    x[..., 0, : d // 2] = x[..., 0, : d // 2] * 4
    out = round_trip(q, x)[3]
    for c, rows in enumerate(q.classes):
        xc = x[..., rows[0]: rows[-1] + 1, :]
        scale, zero = (t[0] for t in q._candidates(xc, c))
        start = q._levels_of(q._nearest(xc, scale, zero, c), c) * scale + zero
        e_start = (start - xc).square().sum((-1,) if q.axis == "token" else (-3, -2))
        e_fit = slice_errors(q, x, out, c)
        size = xc.shape[-1] if q.axis == "token" else xc.shape[-3] * xc.shape[-2]
        tol = 1e-5 * (out[..., rows[0]: rows[-1] + 1, :].square() + xc.square()).sum() / size + 1e-12
        assert bool((e_fit <= e_start * (1 + 1e-5) + tol).all()), float((e_fit - e_start).max())


@FAST
@given(q=quantizers(levels=("int", "midrise", "lloyd"), search="fit", axes=("token",)),
       offset=st.sampled_from([0.0, 0.5]), **data)
def test_fit_stores_the_least_squares_scale_of_its_codes(q, d, seed, amp, offset):
    """Symmetric level sets: a slice's stored scale is ``<x, l> / <l, l>`` of its stored codes' levels ``l``, rounded
    to the nearest fp16 (fp32 sums: within one fp16 step of the float64 value)."""
    x = rows_for(q, d, seed, amp, offset * amp)
    packed, scale, _, _ = round_trip(q, x)
    codes = q.codes(packed, d)
    for c, rows in enumerate(q.classes):
        lv = q._levels_of(codes[..., rows[0]: rows[0] + 1, :], c).double()[..., 0, :]
        xc = x[..., rows[0], :].double()
        ll = lv.square().sum(-1)
        fit = (xc * lv).sum(-1) / ll.clamp_min(1e-300)
        stored = scale[..., c].double()
        want = fit.clamp(max=65504).half().double()
        ulp = (torch.finfo(torch.float16).eps * want.abs()).clamp_min(2.0**-24)
        ok = (ll > 0) & (fit > 0)
        assert bool(((stored - want).abs() <= ulp)[ok].all()), (stored[ok] - want[ok]).abs().max()


def test_fit_one_bit_lloyd_is_the_least_squares_optimum():
    """1-bit Lloyd-Max: the codes are the signs at any positive scale, and the scale is their least-squares one,
    ``mean |x| / t`` (t the level): the optimum, which the trials only approach."""
    x = torch.randn(400, 1, 1, 64, generator=torch.Generator().manual_seed(3))
    fit, trials = Quantizer((1,), ("lloyd",), "token", 1, "fit"), Quantizer((1,), ("lloyd",), "token", 1, True)
    packed, scale, _, out = round_trip(fit, x)
    assert torch.equal(fit.codes(packed, 64), (x > 0).int())
    t = float(level_table("lloyd", 1)[1])
    want = (x.double().abs().mean(-1) / t).half()
    assert (scale[..., 0].double() - want[..., 0].double()).abs().max() <= float(want.double().abs().max()) * 2.0**-10
    assert float((out - x).square().sum()) <= float((round_trip(trials, x)[3] - x).square().sum())


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_fit_on_gaussian_rows_errs_about_as_little_as_the_trials(bits, d):
    """Rotated K/V rows are near-Gaussian: there "fit" (two passes) errs within 2% of the trials (seven passes, one
    per clipping factor) in total (benchmarks/bench_clipping.py mse measures more sizes, tails and SmolLM2's rows)."""
    x = torch.randn(3000, 1, 1, d, generator=torch.Generator().manual_seed(bits * d))
    err = {m: float((round_trip(Quantizer((bits,), ("lloyd",), "token", 1, m), x)[3] - x).square().sum())
           for m in (False, "trials", "fit")}
    assert err["fit"] <= 1.02 * err["trials"] and err["fit"] < err[False], err


def test_fit_start_lines_interpolate_in_log2_of_the_slice_size():
    """At the table's sizes its lines (as fp32), between them linear in log2(size), clamped outside; level sets
    without a line start unclipped (0, 1)."""
    from flashcodec_fx.codecs.quant import FIT_LINES, FIT_SIZES

    for (levels, bits), lines in FIT_LINES.items():
        for n, line in zip(FIT_SIZES, lines, strict=True):
            assert fit_start(levels, bits, n) == pytest.approx(line, abs=1e-6)
        assert fit_start(levels, bits, 1) == fit_start(levels, bits, FIT_SIZES[0])
        assert fit_start(levels, bits, 1 << 16) == fit_start(levels, bits, FIT_SIZES[-1])
        mid = fit_start(levels, bits, round((FIT_SIZES[0] * FIT_SIZES[1]) ** 0.5))
        for k in (0, 1):
            assert min(lines[0][k], lines[1][k]) - 1e-6 <= mid[k] <= max(lines[0][k], lines[1][k]) + 1e-6
    assert fit_start("tcq", 2, 64) == (0.0, 1.0)


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
