"""ops/plan.py: one plan of a stored form; the C++ meta and the Triton tuples and tables are functions of it."""

from __future__ import annotations

import pytest
import torch
from _cpu_cases import CODECS
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcodec_fx.codecs import LEVELS, Codec, JPEGCodec, make_codec, trellis
from flashcodec_fx.codecs.jpeg import SEARCH_CODES
from flashcodec_fx.codecs.levels import LEVEL_SETS
from flashcodec_fx.codecs.quant import LLOYD_FACTORS, SHRINK_FACTORS, fit_start
from flashcodec_fx.ops.cpu.plan import CLASS_FIELDS, LEVEL_WIDTH, META_FIELDS, ROW_FIELDS, codec_plan
from flashcodec_fx.ops.plan import CHANNEL_CODES, FLOAT_ROWS, PRUNED_ROWS, TOKEN_CODES, StoredFormPlan, stored_form_plan
from flashcodec_fx.presets import PRESETS, preset_codecs

HEAD_DIMS = (16, 64, 128)


def _cases() -> list[tuple[Codec, int]]:
    """Every preset's (key, value) codecs of layers 0 and 1, every CPU test codec, and the Triton test forms where
    Triton imports; at each head_dim the codec stores."""
    codecs = [c for name in PRESETS for layer in (0, 1) for c in preset_codecs(name, layer)]
    codecs += [make_codec(mode, **opts) for mode, opts in CODECS.values()]
    try:
        from _triton_cases import FORMS, TRELLIS_FORMS
    except (ImportError, pytest.skip.Exception):
        FORMS, TRELLIS_FORMS = {}, {}
    codecs += [make_codec(mode, **opts) for mode, opts in (*FORMS.values(), *TRELLIS_FORMS.values())]
    out = []
    for c in {c.spec: c for c in codecs}.values():
        for d in HEAD_DIMS:
            try:
                c.check_head_dim(d)
            except ValueError:
                continue
            out.append((c, d))
    return out


CASES = _cases()


def _check_against_codec(plan: StoredFormPlan, codec: Codec, d: int) -> None:
    q = codec.quantizer
    assert (plan.spec, plan.head_dim, plan.block_size, plan.rows, plan.dense) == (codec.spec, d, codec.block_size,
                                                                                  codec.rows, codec.dense_rows)
    assert (plan.kept, plan.sinks, plan.window, plan.tail) == (codec.index_rows, codec.sinks, codec.window,
                                                               codec.tail_capacity)
    assert (plan.group, plan.group_blocks, plan.jpeg) == (codec.group, codec.blocks, isinstance(codec, JPEGCodec))
    assert (plan.rotate, plan.center) == (codec.rotate is not None, codec.center)
    assert (plan.shrink_factors, plan.lloyd_factors) == (SHRINK_FACTORS, LLOYD_FACTORS)
    assert plan.tcq_factors == (() if q is None else tuple(
        trellis.scale_factors(q.bits[rows[0]], bool(q.search)) if lv == "tcq" else ()
        for rows, lv in zip(q.classes, q.levels, strict=True)))
    assert torch.equal(plan.synthesis, codec.synthesis())
    assert (plan.analysis is None) == (not plan.jpeg)
    if plan.jpeg:
        assert torch.equal(plan.analysis, codec.analysis())
    rot = codec.rotation(d)
    assert (plan.rotation is None) == (rot is None) and (rot is None or torch.equal(plan.rotation, rot))
    if q is None:
        assert plan.form == (PRUNED_ROWS if codec.index_rows else FLOAT_ROWS) and not plan.quantized
        assert plan.bits == plan.class_levels == () and plan.levels is None
        assert (plan.classes, plan.zero_classes, plan.row_bytes, plan.slices, plan.level_width) == (0, 0, 0, 0, 1)
        return
    assert plan.form == (TOKEN_CODES if q.axis == "token" else CHANNEL_CODES) and plan.quantized
    assert plan.bits == q.bits and plan.search == SEARCH_CODES[q.search] and plan.row_bytes == sum(q.bits) * d // 8
    sizes = [d if q.axis == "token" else q.blocks * len(rows) for rows in q.classes]
    assert plan.class_fit == tuple(fit_start(lv, q.bits[rows[0]], n) for lv, rows, n in zip(q.levels, q.classes, sizes,
                                                                                           strict=True))
    offset = 0
    for j, bits in enumerate(q.bits):
        assert plan.bit_offset[j] == offset and plan.byte_offset[j] == offset * d // 8
        offset += bits
        c = plan.row_class[j]
        assert j in q.classes[c] and plan.class_first[c] <= j <= plan.class_last[c]
        assert plan.level_kind[j] == LEVEL_SETS.index(q.levels[c]) == plan.class_levels[c]
        assert plan.zero_slot[j] == plan.class_zero[c] == (q.zero_slot[c] if q.levels[c] == "uniform" else -1)
    assert plan.classes == len(q.classes) == len(plan.class_first) and plan.zero_classes == q.zero_classes
    assert all(plan.class_first[c] == min(rows) and plan.class_last[c] == max(rows) for c, rows in enumerate(q.classes))
    assert all((plan.slices & w != 0) == any(b & w for b in q.bits) for w in (1, 2, 4, 8))
    alphabet = max(b + (lv == "tcq") for b, lv in zip(q.bits, (q.levels[c] for c in q.row_class), strict=True))
    assert plan.lloyd == ("lloyd" in q.levels) and plan.level_width == 1 << alphabet  # tcq: 2**(b+1) levels
    assert torch.equal(plan.levels, q.level_rows())


def _check_meta(plan: StoredFormPlan) -> None:
    """The C++ kernels' plan is the plan serialized: every meta field, row and class entry, every table."""
    cpu = codec_plan(plan.spec, plan.head_dim, 4)
    meta = cpu.meta.tolist()
    head = dict(zip(META_FIELDS, meta, strict=False))
    assert head == {
        "jpeg": plan.jpeg, "r": plan.block_size, "rows": plan.rows, "dense": plan.dense,
        "blocks": plan.group_blocks, "group": plan.group, "sinks": plan.sinks, "window": plan.window,
        "tail_cap": plan.tail, "center": plan.center, "rotate": plan.rotate,
        "quant": {TOKEN_CODES: 1, CHANNEL_CODES: 2}.get(plan.form, 0), "pruned": plan.kept, "classes": plan.classes,
        "zero_classes": plan.zero_classes, "head_dim": plan.head_dim, "row_bytes": plan.row_bytes,
        "search": plan.search, "n_shrink": len(plan.shrink_factors), "n_lloyd": len(plan.lloyd_factors),
        "sum_width": 4}
    rest = meta[len(META_FIELDS):]
    k, nr, nc = len(plan.bits), len(ROW_FIELDS), len(CLASS_FIELDS)
    assert len(rest) == nr * k + nc * plan.classes
    for j in range(k):
        assert dict(zip(ROW_FIELDS, rest[nr * j: nr * (j + 1)], strict=True)) == {
            "bits": plan.bits[j], "byte_offset": plan.byte_offset[j], "row_class": plan.row_class[j]}
    for c in range(plan.classes):
        entry = rest[nr * k + nc * c: nr * k + nc * (c + 1)]
        assert dict(zip(CLASS_FIELDS, entry, strict=True)) == {
            "class_levels": plan.class_levels[c], "class_zero": plan.class_zero[c],
            "class_first": plan.class_first[c], "class_last": plan.class_last[c]}
    assert torch.equal(cpu.synth, plan.synthesis)
    assert cpu.analysis.shape == (0, plan.block_size) if plan.analysis is None else torch.equal(cpu.analysis, plan.analysis)
    assert cpu.rot.shape == (0, 0) if plan.rotation is None else torch.equal(cpu.rot, plan.rotation)
    assert cpu.levels.shape == (len(plan.bits), LEVEL_WIDTH)
    if plan.levels is not None:
        assert torch.equal(cpu.levels[:, : plan.level_width], plan.levels) and not cpu.levels[:, plan.level_width:].any()
    tcq = [f for c in plan.tcq_factors for f in c + (0.0,) * (trellis.FACTOR_SLOTS - len(c))]
    assert cpu.factors.tolist() == pytest.approx(list(plan.shrink_factors + plan.lloyd_factors
                                                      + sum(plan.class_fit, ())) + tcq)


def _check_triton(plan: StoredFormPlan, codec: Codec) -> None:
    """The Triton tuple and tables: each field the plan's (``fold`` only for channel codes, ``offset`` as given)."""
    from flashcodec_fx.ops.triton import common
    from flashcodec_fx.ops.triton.common import F_FOLD, F_OFFSET, F_R, StreamForm, pow2, stream_tables

    form = StreamForm.of(plan, fold=True, offset=3)
    tcq = LEVEL_SETS.index("tcq") in plan.level_kind  # trellis rows read their alphabet as a level table
    assert form._asdict() == {
        "form": plan.form, "r": plan.block_size, "rows": plan.rows, "dense": plan.dense, "dense_p": pow2(plan.dense),
        "kept": plan.kept, "sinks": plan.sinks, "tail": plan.tail, "group_blocks": plan.group_blocks,
        "classes": plan.classes, "zeros": plan.zero_classes, "row_bytes": plan.row_bytes, "slices": plan.slices,
        "lloyd": plan.lloyd or tcq, "tcq": tcq, "levels_w": plan.level_width, "rotate": plan.rotate, "center": plan.center,
        "fold": plan.form == CHANNEL_CODES, "offset": 3}
    tup = form.constexpr()
    assert type(tup) is tuple and tup[F_R] == plan.block_size and tup[F_OFFSET] == 3 and tup[F_FOLD] == form.fold
    for name in form._fields:  # each F_<NAME> is its field's place in the kernels' tuple
        assert tup[getattr(common, f"F_{name.upper()}")] == getattr(form, name)
    assert not StreamForm.of(plan).fold and StreamForm.of(plan).offset == 0
    tables = stream_tables(codec, plan.head_dim, "cpu")
    assert torch.equal(tables.synthesis, plan.synthesis)
    if plan.bits:
        want = {common.ROW_BITS: plan.bits, common.ROW_BIT_OFFSET: plan.bit_offset, common.ROW_CLASS: plan.row_class,
                common.ROW_ZERO_SLOT: plan.zero_slot, common.ROW_KIND: plan.level_kind}
        assert tables.rows.dtype == torch.int32 and len(tables.rows) == len(want)
        assert all(tables.rows[row.value].tolist() == list(values) for row, values in want.items())
        assert torch.equal(tables.levels, plan.levels)
    else:
        assert tables.rows.numel() == 1 and tables.levels.numel() == 1
    if plan.rotation is not None:
        assert torch.equal(tables.rotation, plan.rotation)
    if plan.analysis is not None:
        assert torch.equal(tables.analysis, plan.analysis)
    slots, k = common.FACTOR_SLOTS.value, len(plan.bits)
    assert tables.factors.shape == (2 * slots + 2 * k + k * common.TCQ_SLOTS.value,)
    assert tables.factors[: len(plan.shrink_factors)].tolist() == pytest.approx(list(plan.shrink_factors))
    assert tables.factors[slots: slots + len(plan.lloyd_factors)].tolist() == pytest.approx(list(plan.lloyd_factors))
    lines = [plan.class_fit[c] for c in plan.row_class]  # "fit"'s start line of each row's class
    assert tables.factors[2 * slots: 2 * slots + 2 * k].tolist() == [a for a, _ in lines] + [c for _, c in lines]
    tcq = tables.factors[2 * slots + 2 * k:].reshape(k, common.TCQ_SLOTS.value)  # each row's class's candidates
    for j, c in enumerate(plan.row_class):
        listed = plan.tcq_factors[c]
        assert tcq[j, : len(listed)].tolist() == pytest.approx(list(listed)) and not tcq[j, len(listed):].any()


def test_cases_cover_every_stored_form():
    assert {stored_form_plan(c.spec, d).form for c, d in CASES} == {FLOAT_ROWS, PRUNED_ROWS, TOKEN_CODES,
                                                                      CHANNEL_CODES}


@pytest.mark.parametrize("codec,d", CASES, ids=[f"{c.spec}@{d}" for c, d in CASES])
def test_plan_agrees_with_the_codec_and_the_cpu_meta_is_its_serialization(codec, d):
    plan = stored_form_plan(codec.spec, d)
    assert stored_form_plan(codec.spec, d) is plan  # made once per (spec, head_dim)
    _check_against_codec(plan, codec, d)
    _check_meta(plan)


@pytest.mark.parametrize("codec,d", CASES, ids=[f"{c.spec}@{d}" for c, d in CASES])
def test_triton_stream_form_and_tables_are_the_plan(codec, d):
    pytest.importorskip("triton")
    _check_triton(stored_form_plan(codec.spec, d), codec)


@st.composite
def _quantized(draw) -> Codec:
    """A quantized jpeg codec: any block, kept rows, bit table, level sets, axis and residual policy."""
    r = draw(st.integers(1, 8))
    keep = draw(st.integers(1, r))
    axis = draw(st.sampled_from(["token", "channel"]))
    bits = draw(st.lists(st.integers(2, 6), min_size=keep, max_size=keep))
    if axis == "token":
        levels = tuple(draw(st.lists(st.sampled_from(LEVELS), min_size=keep, max_size=keep)))
        group = None
    else:
        levels = (draw(st.sampled_from(LEVELS)),) + ((draw(st.sampled_from(LEVELS)),) if keep > 1 else ())
        if levels[-1] == "uniform":
            bits[1:] = [bits[-1]] * (keep - 1)
        group = r * draw(st.integers(1, 4))
    return make_codec("jpeg", block_size=r, keep_freqs=keep, quant_bits=tuple(bits), levels=levels, scale_axis=axis,
                      group=group, scale_search=draw(st.sampled_from([False, "trials", "fit"])),
                      rotate=draw(st.sampled_from([None, 1])),
                      center=draw(st.booleans()), sinks=draw(st.integers(0, 3)), window=draw(st.integers(0, 5)))


@settings(max_examples=60, deadline=None)
@given(codec=_quantized(), d=st.sampled_from([16, 32, 64]))
def test_any_quantized_plan_agrees_with_its_codec(codec, d):
    plan = stored_form_plan(codec.spec, d)
    _check_against_codec(plan, codec, d)
    _check_meta(plan)
