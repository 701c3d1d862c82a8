"""Trellis-coded quantization (``levels="tcq"``, codecs/trellis.py): the windowed decode is the trellis walk, the
Viterbi encoder finds the least squared error path (brute force on short rows), decode(encode(x)) is that path's
reconstruction, the stored bits are the scalar codes' exactly, and bad options are refused naming the parameter."""

from __future__ import annotations

import itertools

import pytest
import torch
from _codec_data import FAST
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx.codecs import Quantizer, make_codec, trellis
from flashcodec_fx.codecs.quant import fp16_toward


@pytest.mark.parametrize("bits", sorted(trellis.ALPHABETS))
def test_alphabets_are_increasing_and_exactly_symmetric(bits):
    """The CPU's AVX2 decode reads the lower half of the 4-bit alphabet and flips the sign (token_simd.h)."""
    a = trellis.alphabet(bits)
    assert a.numel() == 2 ** (bits + 1) and bool((a[1:] > a[:-1]).all())
    assert torch.equal(a.flip(0), -a)


def walk(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Alphabet indices by walking the trellis from state 0 (the serial definition)."""
    out = torch.empty_like(codes, dtype=torch.int64)
    for r in range(codes.shape[0]):
        state = 0
        for t in range(codes.shape[1]):
            c = int(codes[r, t])
            out[r, t] = trellis.subset(state, c & 1) + 4 * (c >> 1)
            state = trellis.next_state(state, c & 1)
    return out


@FAST
@given(bits=st.integers(1, trellis.MAX_BITS), d=st.integers(1, 20), seed=st.integers(0, 2**31))
def test_windowed_decode_is_the_trellis_walk(bits, d, seed):
    codes = torch.randint(0, 1 << bits, (5, d), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(trellis.alphabet_index(codes), walk(codes, bits))


def test_ungerboeck_structure():
    """Both branches into a state and both out of it use subsets of one union (D0, D2 or D1, D3), and differ."""
    for s in range(trellis.STATES):
        out = {trellis.subset(s, b) for b in (0, 1)}
        assert len(out) == 2 and len({j & 1 for j in out}) == 1
    for n in range(trellis.STATES):
        into = {trellis.subset(p, b) for p in range(trellis.STATES) for b in (0, 1) if trellis.next_state(p, b) == n}
        assert len(into) == 2 and len({j & 1 for j in into}) == 1


def sequential_cost(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros(x.shape[0])
    for t in range(x.shape[1]):
        diff = x[:, t] - values[:, t]
        acc = acc + diff * diff
    return acc


@pytest.mark.parametrize(("bits", "d"), [(1, 8), (2, 5), (3, 3)])
def test_viterbi_finds_the_least_error_path(bits, d):
    """Against every code sequence of a short row: the same least cost (sequential sums, bitwise)."""
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(6, d, generator=gen)
    scale = fp16_toward(x.square().mean(-1).sqrt(), up=True)
    codes, cost = trellis.viterbi(x, scale, bits)
    every = torch.tensor(list(itertools.product(range(1 << bits), repeat=d)))
    for r in range(x.shape[0]):
        values = trellis.levels(every, bits) * scale[r]
        brute = sequential_cost(x[r].expand(every.shape[0], d), values)
        assert float(cost[r]) == float(brute.min())
        assert float(sequential_cost(x[r: r + 1], trellis.levels(codes[r: r + 1], bits) * scale[r])) == float(cost[r])


@FAST
@given(bits=st.integers(1, trellis.MAX_BITS), search=st.booleans(), seed=st.integers(0, 2**31),
       spread=st.floats(1e-3, 1e3))
def test_decode_of_encode_is_the_kept_path(bits, search, seed, spread):
    """The scale is an fp16 value; decode(encode(x)) is alphabet[index] * scale of the kept codes, and without the
    search it errs exactly the Viterbi path's cost at that scale."""
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(seed)) * spread
    codes, scale = trellis.encode(x, bits, search)
    assert torch.equal(scale.half().float(), scale) and (scale > 0).all()
    q = Quantizer((bits,), ("tcq",), search=search)
    packed, s, z = q.quantize(x[:, None, None, :])
    assert packed.shape == (7, 1, bits * 64 // 8) and z.numel() == 0
    assert torch.equal(q.codes(packed, 64)[:, 0, 0], codes) and torch.equal(s[:, 0, 0].float(), scale)
    rec = q.dequantize(packed, s, z, 64)[:, 0, 0]
    assert torch.equal(rec, trellis.levels(codes, bits) * scale[:, None])
    if not search:
        _, cost = trellis.viterbi(x, scale, bits)
        assert torch.equal(sequential_cost(x, rec), cost)


def test_search_lowers_the_error():
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(3))
    for bits in range(1, trellis.MAX_BITS + 1):
        errs = []
        for search in (False, True):
            codes, scale = trellis.encode(x, bits, search)
            errs.append(sequential_cost(x, trellis.levels(codes, bits) * scale[:, None]))
        assert float(errs[1].sum()) < float(errs[0].sum()), bits


def test_gaussian_mse_beats_lloyd_max():
    """The point of the trellis: at equal bits, about 0.75x the Lloyd-Max codes' squared error on Gaussian rows."""
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    for bits in (1, 2, 3):
        tcq = Quantizer((bits,), ("tcq",), search=True)
        lloyd = Quantizer((bits,), ("lloyd",), search=True)
        errs = []
        for q in (tcq, lloyd):
            rows = x[:, None, None, :]
            errs.append(float((q.dequantize(*q.quantize(rows), 64) - rows).square().sum()))
        assert errs[0] < 0.9 * errs[1], (bits, errs)


def test_zero_rows_decode_to_zero():
    codes, scale = trellis.encode(torch.zeros(3, 16), 2, True)
    assert torch.equal(trellis.levels(codes, 2) * scale[:, None], torch.zeros(3, 16))


def test_bits_as_stored_equal_the_scalar_codes():
    for bits in (1, 2, 3, 4):
        a = make_codec("jpeg", block_size=1, quant_bits=bits, levels="tcq", rotate=True, scale_search=True)
        b = make_codec("jpeg", block_size=1, quant_bits=bits, levels="lloyd", rotate=True, scale_search=True)
        assert a.group_bytes(64, torch.float32) == b.group_bytes(64, torch.float32) == bits * 8 + 2
        assert a.archive_shapes(64, torch.float32) == b.archive_shapes(64, torch.float32)


def test_spec_round_trips():
    from flashcodec_fx.codecs import codec_from_spec

    c = make_codec("jpeg", block_size=1, quant_bits=3, levels="tcq", rotate=True, center=True, scale_search=True,
                   sinks=4, window=18)
    assert "levels=tcq" in c.spec and codec_from_spec(c.spec) == c


@pytest.mark.parametrize(("options", "match"), [
    ({"quant_bits": 5}, "1..4 bits"),
    ({"quant_bits": 2, "scale_axis": "channel", "group": 4}, "scale_axis='token'"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        make_codec("jpeg", block_size=1, levels="tcq", **options)


def test_levels_name_lists_tcq():
    with pytest.raises(ValueError, match="tcq"):
        make_codec("jpeg", block_size=1, quant_bits=2, levels="trellis")


def test_only_kernels_that_decode_trellis_codes_serve_them():
    """The C++ CPU kernels serve trellis codecs (``trellis=True``); the Triton gate (default) leaves them to the
    reference ops."""
    from flashcodec_fx.ops.state import fast_kernels_serve

    tcq = make_codec("jpeg", block_size=1, quant_bits=3, levels="tcq", rotate=True).spec
    lloyd = make_codec("jpeg", block_size=1, quant_bits=3, levels="lloyd", rotate=True).spec
    assert fast_kernels_serve(lloyd, lloyd) and fast_kernels_serve(lloyd, tcq, trellis=True)
    assert not fast_kernels_serve(lloyd, tcq) and not fast_kernels_serve(tcq, head_dim=64)
