"""The per-token CPU kernel of `flashcodec::codec_attention` (token_attention.cpp: both streams one row per token,
every lossy preset) against the reference (the spec), on its SIMD path and on its portable path.

Tolerance (`_cpu_cases.TOLERANCE`): fp32 outputs within 2e-5 absolute + 1e-5 relative of the reference for
unit-scale data (fp32 accumulation in another order; the exp polynomial within 2 ulp); fp16 / bf16 outputs one
rounding of that fp32 result, so within one ulp of the output.
"""

from __future__ import annotations

import math

import pytest
import torch
from _cpu_cases import DTYPES, assert_matches, chunks, filled, make_mask, variant_kwargs
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcodec_fx import presets
from flashcodec_fx.codecs import make_codec
from flashcodec_fx.ops.cpu.launch import cpu_append, cpu_codec_attention
from flashcodec_fx.ops.cpu.plan import codec_plan
from flashcodec_fx.ops.reference.attention import codec_attention_reference

SIMD_WIDTHS = (1, 2, 3, 4, 8)  # code widths the SIMD loops read (token_simd.h); the others take the portable path
# head dims not divisible by 16 (8, 24, 40) take the AVX2 loops on AVX-512 machines, with odd 8-channel chunk counts
# (24, 40: the value loop's one-chunk pass); 16 .. 80 every AVX-512 value pass (1-4 chunks of 16, then 4 + 1)
HEAD_DIMS = (8, 16, 24, 32, 40, 48, 64, 80, 128, 256)
CHUNK = 256  # token_attention.cpp kTokenChunk: lengths past it take several softmax steps
# an explicit softmax scale, times 1 / sqrt(d): logits of about 2.4 standard deviations at every head dim (0.3 at
# d=64), within the tolerance's unit-scale assumption (a fixed 0.3 at d=256 gives logits of ~5 standard deviations,
# where fp32 sums in another order move the output by up to 6e-5)
EXPLICIT_SCALE = 2.4


@st.composite
def token_codecs(draw):
    """A per-token codec: block_size 1, every bit width and level set (or unquantized), rotation, center, raw sinks
    and window."""
    options = {"block_size": 1, "rotate": draw(st.sampled_from([None, 0, 3])), "center": draw(st.booleans()),
               "sinks": draw(st.integers(0, 5)), "window": draw(st.sampled_from([0, 1, 4, 32]))}
    bits = draw(st.sampled_from([None, 1, 2, 3, 4, 5, 6, 7, 8]))
    if bits is not None:
        allowed = ["uniform", "midrise"] + (["int"] if bits >= 2 else []) + (["lloyd"] if bits <= 6 else []) + (
            ["tcq"] if bits <= 4 else [])
        options.update(quant_bits=bits, levels=draw(st.sampled_from(allowed)), scale_search=draw(st.booleans()))
    return make_codec("jpeg", **options)


def run(ck, cv, *, dtype, b, hkv, groups, t, d, length, seed, mask, new, slack, scale, simd, variants=None):
    """Kernel (simd or portable path) and reference outputs of one call on states filled in random chunks
    (``variants``: the keywords of ``variant_kwargs``, if any)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, hkv, length, d, generator=gen).to(dtype)
    values = torch.randn(b, hkv, length, d, generator=gen).to(dtype)
    sizes = chunks(length, seed)
    ks = filled(ck, keys, sizes, groups=length + slack, appender=cpu_append)
    vs = filled(cv, values, sizes, groups=length + slack, appender=cpu_append)
    q = torch.randn(b, hkv * groups, t, d, generator=gen).to(dtype)
    use_new = new and length >= t
    k_new, v_new = (keys[:, :, length - t:], values[:, :, length - t:]) if use_new else (None, None)
    m = make_mask(mask, b, hkv * groups, t, length + 3, seed)
    kw = {} if variants is None else variant_kwargs(**variants, hq=hkv * groups, seed=seed, sink_dtype=dtype)
    ref = codec_attention_reference(q, ks, vs, ck.spec, cv.spec, k_new, v_new, m, scale, **kw)
    from flashcodec_fx.ops.cpu.build import EXTENSION

    out = EXTENSION.module().codec_attention(q, ks, vs, codec_plan(ck.spec, d), codec_plan(cv.spec, d), k_new, v_new, m,
                                             1 / math.sqrt(d) if scale is None else scale, simd,
                                             kw.get("softcap", 0.0), kw.get("sinks"), kw.get("alibi"))
    return out, ref


@settings(max_examples=120, deadline=None)
@given(ck=token_codecs(), cv=token_codecs(), dtype=st.sampled_from(DTYPES), b=st.integers(1, 2),
       hkv=st.integers(1, 3), groups=st.integers(1, 8), t=st.integers(1, 3), d=st.sampled_from(HEAD_DIMS),
       length=st.one_of(st.integers(0, 40), st.integers(CHUNK - 9, 2 * CHUNK + 9)), seed=st.integers(0, 10**6),
       mask=st.sampled_from(["none", "bool", "additive"]), new=st.booleans(), slack=st.integers(0, 2),
       scale=st.sampled_from([None, EXPLICIT_SCALE]), simd=st.booleans())
def test_matches_reference(cpu_kernels, ck, cv, dtype, b, hkv, groups, t, d, length, seed, mask, new, slack, scale,
                           simd):
    """Every bit width and level set (SIMD widths and portable ones), unquantized rows, rotations, centers, sinks and
    windows per stream, dtypes, GQA groups 1..8 with 1..3 query tokens (tiles of 1..4 rows), head dims with even and
    odd chunk counts, lengths within one softmax chunk and across chunks (not multiples of 8: partial row blocks),
    full and spare capacities, masks, the call's new tokens, both code paths."""
    scale = None if scale is None else scale / math.sqrt(d)
    out, ref = run(ck, cv, dtype=dtype, b=b, hkv=hkv, groups=groups, t=t, d=d, length=length, seed=seed, mask=mask,
                   new=new, slack=slack, scale=scale, simd=simd)
    assert_matches(out, ref)


@st.composite
def variants(draw):
    """At least one of: a softcap bending unit-scale logits (1.5) or hardly (30), sink logits, ALiBi slopes."""
    out = {"softcap": draw(st.sampled_from([None, 1.5, 30.0])), "sinks": draw(st.booleans()),
           "alibi": draw(st.booleans())}
    if out == {"softcap": None, "sinks": False, "alibi": False}:
        out["alibi"] = True
    return out


@settings(max_examples=80, deadline=None)
@given(ck=token_codecs(), cv=token_codecs(), dtype=st.sampled_from(DTYPES), b=st.integers(1, 2),
       hkv=st.integers(1, 3), groups=st.integers(1, 8), t=st.integers(1, 3), d=st.sampled_from(HEAD_DIMS),
       length=st.one_of(st.integers(0, 40), st.integers(CHUNK - 9, 2 * CHUNK + 9)), seed=st.integers(0, 10**6),
       mask=st.sampled_from(["none", "bool", "additive"]), new=st.booleans(), slack=st.integers(0, 2),
       simd=st.booleans(), variants=variants())
def test_variants_match_reference(cpu_kernels, ck, cv, dtype, b, hkv, groups, t, d, length, seed, mask, new, slack,
                                  simd, variants):
    """Softcap, sinks (in the stream dtype) and ALiBi, alone and together, on both code paths (the SIMD loops with
    tiles of 1..4 query rows, the portable rows), across softmax chunks: within the plain kernel's tolerance."""
    out, ref = run(ck, cv, dtype=dtype, b=b, hkv=hkv, groups=groups, t=t, d=d, length=length, seed=seed, mask=mask,
                   new=new, slack=slack, scale=None, simd=simd, variants=variants)
    assert_matches(out, ref)


@pytest.mark.parametrize("name", ["int8", "4bit", "2bit"])
def test_presets_long_streams_with_variants(cpu_kernels, name):
    """The three variants on a preset's long stream split over two threads (the sinks in the splits' combine)."""
    ck, cv = presets.preset_codecs(name)
    with_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, ref = run(ck, cv, dtype=torch.float32, b=1, hkv=3, groups=3, t=1, d=64, length=6001, seed=3,
                       mask="none", new=True, slack=1, scale=None, simd=True,
                       variants={"softcap": 1.5, "sinks": True, "alibi": False})
        alibi, alibi_ref = run(ck, cv, dtype=torch.float32, b=1, hkv=3, groups=3, t=1, d=64, length=6001, seed=3,
                               mask="none", new=True, slack=1, scale=None, simd=True,
                               variants={"softcap": None, "sinks": True, "alibi": True})
    finally:
        torch.set_num_threads(with_threads)
    assert_matches(out, ref)
    assert_matches(alibi, alibi_ref)


@pytest.mark.parametrize("name", ["int8", "4bit", "3bit", "2.5bit", "2bit"])
@pytest.mark.parametrize("threads", [1, 2])
def test_presets_long_streams(cpu_kernels, name, threads):
    """Each preset at SmolLM2's attention shape, long enough that two threads split the positions (the parallel
    region with its shared item counter, splits combined by log-sum-exp)."""
    ck, cv = presets.preset_codecs(name)
    with_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, ref = run(ck, cv, dtype=torch.float32, b=1, hkv=3, groups=3, t=1, d=64, length=6001, seed=threads,
                       mask="none", new=True, slack=1, scale=None, simd=True)
    finally:
        torch.set_num_threads(with_threads)
    assert_matches(out, ref)


def test_paths(cpu_kernels):
    """Which code serves which pair: per-token pairs the token kernel (SIMD code widths on AVX2 machines), any block
    codec the block kernel."""
    isa = cpu_kernels.simd_isa()
    assert isa in ("avx512", "avx2", "portable")
    plan = {bits: codec_plan(make_codec("jpeg", block_size=1, quant_bits=bits, levels="midrise").spec, 64)
            for bits in (1, 2, 3, 4, 5, 8)}
    for bits in SIMD_WIDTHS:
        assert cpu_kernels.attention_path(plan[bits], plan[bits], True) == f"token:{isa}/{isa}"
        assert cpu_kernels.attention_path(plan[bits], plan[bits], False) == "token:portable/portable"
    assert cpu_kernels.attention_path(plan[5], plan[1], True) == f"token:portable/{isa}"
    raw = codec_plan(make_codec("jpeg", block_size=1, rotate=0).spec, 64)
    assert cpu_kernels.attention_path(raw, plan[4], True) == f"token:raw/{isa}"
    block = codec_plan(make_codec("jpeg", block_size=8, quant_bits=8).spec, 64)
    assert cpu_kernels.attention_path(block, plan[8], True) == "block"
    tcq = {bits: codec_plan(make_codec("jpeg", block_size=1, quant_bits=bits, levels="tcq").spec, 64)
           for bits in (1, 2, 3, 4)}
    for bits in (1, 2, 3, 4):  # trellis codes: SIMD at 1-4 bits (an alphabet of at most 32 values)
        assert cpu_kernels.attention_path(tcq[bits], tcq[bits], True) == f"token:{isa}/{isa}"
        assert cpu_kernels.attention_path(tcq[bits], tcq[bits], False) == "token:portable/portable"


def test_simd_is_compiled_where_the_cpu_has_avx2(cpu_kernels):
    """The build's flags are honest and used: an AVX2 + FMA + F16C CPU gets the AVX2 loops, one with AVX-512 F / DQ /
    BW the AVX-512 ones too (for head dims divisible by 16; AVX2 serves the others)."""
    from flashcodec_fx.ops.cpu.build import _cpu_flags

    flags = set(_cpu_flags().split())
    if {"avx2", "fma", "f16c"} <= flags:
        wide = {"avx512f", "avx512dq", "avx512bw"} <= flags
        assert cpu_kernels.simd_isa() == ("avx512" if wide else "avx2")
        plan = {d: codec_plan(make_codec("jpeg", block_size=1, quant_bits=4).spec, d) for d in (64, 72)}
        assert cpu_kernels.attention_path(plan[64], plan[64], True) == f"token:{cpu_kernels.simd_isa()}/{cpu_kernels.simd_isa()}"
        assert cpu_kernels.attention_path(plan[72], plan[72], True) == "token:avx2/avx2"
    else:
        assert cpu_kernels.simd_isa() == "portable"


def test_dispatcher_runs_the_token_kernel(cpu_kernels):
    """The op's CPU kernel is this one: bitwise the direct SIMD call, not the reference's rounding."""
    ck, cv = presets.preset_codecs("4bit")
    x = torch.randn(1, 3, 300, 64)
    ks, vs = filled(ck, x, [300], appender=cpu_append), filled(cv, x, [300], appender=cpu_append)
    q = torch.randn(1, 9, 1, 64)
    out = torch.ops.flashcodec.codec_attention(q, ks, vs, ck.spec, cv.spec)
    direct = cpu_kernels.codec_attention(q, ks, vs, codec_plan(ck.spec, 64), codec_plan(cv.spec, 64), None, None, None,
                                         0.125, True)
    assert torch.equal(out, direct) and torch.equal(out, cpu_codec_attention(q, ks, vs, ck.spec, cv.spec))
    assert_matches(out, codec_attention_reference(q, ks, vs, ck.spec, cv.spec))
