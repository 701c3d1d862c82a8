"""The C++ CPU kernel of `flashcodec::codec_attention` against the reference (the spec), called directly."""

from __future__ import annotations

import math

import pytest
import torch
from _cpu_cases import (
    CODECS,
    DTYPES,
    HEAD_DIMS,
    allocations,
    assert_matches,
    chunks,
    codec,
    filled,
    make_mask,
    variant_kwargs,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcodec_fx.ops.cpu.launch import cpu_append, cpu_codec_attention
from flashcodec_fx.ops.cpu.plan import codec_plan
from flashcodec_fx.ops.reference.append import append_reference
from flashcodec_fx.ops.reference.attention import codec_attention_reference


@st.composite
def attention_cases(draw):
    return {
        "k": draw(st.sampled_from(sorted(CODECS))), "v": draw(st.sampled_from(sorted(CODECS))),
        "dtype": draw(st.sampled_from(DTYPES)), "b": draw(st.integers(1, 2)), "hkv": draw(st.integers(1, 2)),
        "groups": draw(st.integers(1, 4)), "t": draw(st.integers(1, 3)), "d": draw(st.sampled_from(HEAD_DIMS)),
        "length": draw(st.integers(0, 70)), "seed": draw(st.integers(0, 10**6)),
        "mask": draw(st.sampled_from(["none", "bool", "additive"])), "new": draw(st.booleans()),
        "slack": draw(st.integers(0, 2)), "scale": draw(st.sampled_from([None, 0.3])),
    }


def run_case(case: dict, appender=append_reference):
    """Kernel and reference outputs of one case: states filled with random chunks (by ``appender``), then one
    attention call (with ``case["variants"]``: the keywords of ``variant_kwargs``, if any)."""
    ck, cv = codec(case["k"]), codec(case["v"])
    b, hkv, d, dtype, length, t = case["b"], case["hkv"], case["d"], case["dtype"], case["length"], case["t"]
    new = case["new"] and length >= t
    gen = torch.Generator().manual_seed(case["seed"])
    keys = torch.randn(b, hkv, length, d, generator=gen).to(dtype)
    values = torch.randn(b, hkv, length, d, generator=gen).to(dtype)
    sizes = chunks(length, case["seed"])
    ks = filled(ck, keys, sizes, groups=length // ck.group + case["slack"], appender=appender)
    vs = filled(cv, values, sizes, groups=length // cv.group + case["slack"], appender=appender)
    q = torch.randn(b, hkv * case["groups"], t, d, generator=gen).to(dtype)
    args = {"k_new": keys[:, :, length - t:], "v_new": values[:, :, length - t:]} if new else {}
    args["mask"] = make_mask(case["mask"], b, hkv * case["groups"], t, length + 3, case["seed"])
    args["scale"] = case["scale"]
    if case.get("variants"):
        args.update(variant_kwargs(**case["variants"], hq=hkv * case["groups"], seed=case["seed"],
                                   sink_dtype=dtype))
    ref = codec_attention_reference(q, ks, vs, ck.spec, cv.spec, **args)
    return cpu_codec_attention(q, ks, vs, ck.spec, cv.spec, **args), ref


@settings(max_examples=80, deadline=None)
@given(case=attention_cases())
def test_matches_reference(cpu_kernels, case):
    """Every pair of stored forms, dtypes, GQA groups, query counts, head dims, lengths on and off group boundaries,
    archives with and without spare groups (a capacity exactly full: overflow-free edge), masks and new tokens."""
    out, ref = run_case(case)
    assert_matches(out, ref)


@pytest.mark.parametrize(("k", "v"), [("jpeg-int8", "jpeg-int8"), ("channel-key", "token-lloyd-value"),
                                      ("png", "png-pruned"), ("jpeg-rot-center", "channel-int")])
def test_long_streams_every_split_and_chunk(cpu_kernels, k, v):
    """Long enough for several chunks per split (flash-decoding combine across splits), GQA 3 as SmolLM2. The states
    are filled by the CPU append kernel (bitwise the reference's: test_cpu_append.py), which is faster."""
    for threads, length in ((1, 1100), (2, 3100)):  # 2 threads: work enough for the second (kMinWorkPerThread)
        with_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            case = {"k": k, "v": v, "dtype": torch.float32, "b": 1, "hkv": 3, "groups": 3, "t": 1, "d": 64,
                    "length": length, "seed": threads, "mask": "bool", "new": True, "slack": 1, "scale": None}
            out, ref = run_case(case, appender=cpu_append)
        finally:
            torch.set_num_threads(with_threads)
        assert_matches(out, ref)


@st.composite
def variant_cases(draw):
    """attention_cases with at least one variant: a softcap that bends unit-scale logits (1.5) or hardly (30), sink
    logits, ALiBi slopes."""
    case = draw(attention_cases())
    variants = {"softcap": draw(st.sampled_from([None, 1.5, 30.0])), "sinks": draw(st.booleans()),
                "alibi": draw(st.booleans())}
    if variants == {"softcap": None, "sinks": False, "alibi": False}:
        variants["sinks"] = True
    return {**case, "variants": variants}


@settings(max_examples=60, deadline=None)
@given(case=variant_cases())
def test_variants_match_reference(cpu_kernels, case):
    """Softcap, sinks (in the stream dtype) and ALiBi, alone and together, over the cases of test_matches_reference:
    within the plain kernel's tolerance."""
    out, ref = run_case(case)
    assert_matches(out, ref)


@pytest.mark.parametrize(("k", "v"), [("channel-key", "token-lloyd-value"), ("png", "jpeg-int8")])
def test_variants_on_long_streams_every_split(cpu_kernels, k, v):
    """The three variants on streams long enough for several chunks per split and two threads' splits: the sink
    logits join the log-sum-exp combine of the splits, the ALiBi bias counts positions across chunks."""
    with_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        case = {"k": k, "v": v, "dtype": torch.float32, "b": 1, "hkv": 3, "groups": 3, "t": 1, "d": 64,
                "length": 3100, "seed": 5, "mask": "bool", "new": True, "slack": 1, "scale": None,
                "variants": {"softcap": 1.5, "sinks": True, "alibi": True}}
        out, ref = run_case(case, appender=cpu_append)
        case["variants"]["alibi"] = False  # slopes of ~0.02 over 3100 positions leave the last few keys alone
        out_no_alibi, ref_no_alibi = run_case(case, appender=cpu_append)
    finally:
        torch.set_num_threads(with_threads)
    assert_matches(out, ref)
    assert_matches(out_no_alibi, ref_no_alibi)


@pytest.mark.parametrize("name", ["jpeg-int8", "token-uniform-4bit"])  # block kernel; token kernel
def test_sinks_zero_rows_that_see_nothing_and_neutral_variants_change_nothing(cpu_kernels, name):
    """With sinks a row that sees no key gives zeros; a sink of -inf and slopes of 0 give the plain result bitwise."""
    c = codec(name)
    x = torch.randn(1, 1, 20, 16)
    state = filled(c, x, [20])
    q = torch.randn(1, 2, 2, 16)
    mask = torch.ones(1, 2, 2, 20, dtype=torch.bool)
    mask[0, 1, 0] = False
    sinks = torch.tensor([0.5, -1.0])
    out = cpu_codec_attention(q, state, state, c.spec, c.spec, mask=mask, sinks=sinks)
    assert torch.equal(out[0, 1, 0], torch.zeros(16)) and bool(torch.isfinite(out).all())
    assert_matches(out, codec_attention_reference(q, state, state, c.spec, c.spec, mask=mask, sinks=sinks))
    plain = cpu_codec_attention(q, state, state, c.spec, c.spec, mask=mask)
    assert torch.equal(cpu_codec_attention(q, state, state, c.spec, c.spec, mask=mask,
                                           sinks=torch.full((2,), float("-inf"))), plain)
    assert torch.equal(cpu_codec_attention(q, state, state, c.spec, c.spec, mask=mask, alibi=torch.zeros(2)), plain)


def test_rows_that_see_nothing_are_zero(cpu_kernels):
    c = codec("jpeg-int8")
    x = torch.randn(1, 1, 20, 16)
    state = filled(c, x, [20])
    q = torch.randn(1, 2, 2, 16)
    mask = torch.ones(1, 2, 2, 20, dtype=torch.bool)
    mask[0, 1, 0] = False
    out = cpu_codec_attention(q, state, state, c.spec, c.spec, mask=mask)
    assert torch.equal(out[0, 1, 0], torch.zeros(16))
    assert_matches(out, codec_attention_reference(q, state, state, c.spec, c.spec, mask=mask))


def test_cropped_states(cpu_kernels):
    """A crop inside the tail moves only the length (CodecStream.crop): the rows past it are not read."""
    c = codec("channel-key")
    x = torch.randn(1, 2, 40, 32)
    q = torch.randn(1, 4, 1, 32)
    cropped = filled(c, x, [30, 1, 1])
    cropped[7].fill_(int(cropped[8]) + 1)  # length moves back inside the tail, as CodecStream.crop does
    assert_matches(cpu_codec_attention(q, cropped, cropped, c.spec, c.spec),
                   codec_attention_reference(q, cropped, cropped, c.spec, c.spec))


def test_strided_inputs_and_other_dtypes(cpu_kernels):
    """State tensors whose inner dims are not contiguous are read through copies; fp64 streams run the reference."""
    c = codec("token-table")
    x = torch.randn(2, 2, 30, 16)
    state = filled(c, x, [25, 1, 4])
    q = torch.randn(2, 4, 3, 16).transpose(2, 3).contiguous().transpose(2, 3)  # q's last dim strided
    strided = [t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 4 and t.numel() else t for t in state]
    assert not strided[6].is_contiguous()
    assert_matches(cpu_codec_attention(q, strided, strided, c.spec, c.spec),
                   codec_attention_reference(q, state, state, c.spec, c.spec))
    plain = codec("png")
    x64 = torch.randn(1, 1, 9, 8, dtype=torch.float64)
    s64 = filled(plain, x64, [9])
    q64 = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    assert torch.equal(cpu_codec_attention(q64, s64, s64, plain.spec, plain.spec),
                       codec_attention_reference(q64, s64, s64, plain.spec, plain.spec))


def test_dispatcher_runs_the_cpu_kernel(cpu_kernels):
    """The op's CPU kernel is this one (bitwise the same as calling it), not the reference."""
    c = codec("jpeg-int8")
    x = torch.randn(1, 2, 50, 32)
    state = filled(c, x, [50])
    q = torch.randn(1, 4, 1, 32)
    out = torch.ops.flashcodec.codec_attention(q, state, state, c.spec, c.spec)
    assert torch.equal(out, cpu_codec_attention(q, state, state, c.spec, c.spec))
    assert not torch.equal(out, codec_attention_reference(q, state, state, c.spec, c.spec))  # another order


def test_rejects_what_the_reference_rejects(cpu_kernels):
    c = codec("jpeg-int8")
    state = filled(c, torch.randn(1, 2, 10, 16), [10])
    with pytest.raises(ValueError, match="query heads"):
        cpu_codec_attention(torch.randn(1, 3, 1, 16), state, state, c.spec, c.spec)
    with pytest.raises(ValueError, match="mask"):
        cpu_codec_attention(torch.randn(1, 4, 1, 16), state, state, c.spec, c.spec,
                            mask=torch.ones(1, 1, 1, 20, dtype=torch.int64))
    q = torch.randn(1, 4, 1, 16)
    with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\)"):
        cpu_codec_attention(q, state, state, c.spec, c.spec, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="alibi must be a float32 tensor"):
        cpu_codec_attention(q, state, state, c.spec, c.spec, alibi=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="softcap must be a positive"):
        cpu_codec_attention(q, state, state, c.spec, c.spec, softcap=-1.0)
    cpu_codec_attention(q, state, state, c.spec, c.spec, softcap=1.0)  # a valid layout remembered first ...
    with pytest.raises(ValueError, match="softcap must be a positive"):
        cpu_codec_attention(q, state, state, c.spec, c.spec, softcap=0.0)  # ... never lets another value pass


@pytest.mark.parametrize("names", [("jpeg-int8", "jpeg-int8"), ("channel-key", "token-lloyd-value"),
                                   ("token-lloyd-value", "token-uniform-4bit")])  # block kernel; token kernel
def test_allocates_only_its_output(cpu_kernels, names):
    """The workspace (its size a function of the shapes and the thread count, never of the length) is the calling
    thread's, kept between calls: a decode step allocates its output and nothing else."""
    ck, cv = codec(names[0]), codec(names[1])
    q = torch.randn(1, 6, 1, 64)
    seen = []
    for length in (40, 1000):
        x = torch.randn(1, 2, length, 64)
        ks, vs = filled(ck, x, [length], appender=cpu_append), filled(cv, x, [length], appender=cpu_append)
        cpu_codec_attention(q, ks, vs, ck.spec, cv.spec)  # validation and plans cached, as in a decode loop
        seen.append(allocations(lambda ks=ks, vs=vs: cpu_codec_attention(q, ks, vs, ck.spec, cv.spec)))
    assert seen[0] == seen[1] == [q.numel() * 4]
    assert cpu_kernels.attention_workspace(codec_plan(ck.spec, 64), codec_plan(cv.spec, 64), 1, 2, 3, 64) > 0


@pytest.mark.parametrize(("k", "v", "dtype", "mask"), [
    ("jpeg-int8", "png", torch.float32, None), ("channel-key", "token-lloyd-value", torch.bfloat16, "bool"),
    ("png-pruned", "jpeg-k2-residual", torch.float16, "additive"),
])
def test_opcheck(cpu_kernels, k, v, dtype, mask):
    ck, cv = codec(k), codec(v)
    x = torch.randn(2, 2, 23, 16).to(dtype)
    ks, vs = filled(ck, x, [20, 1, 2]), filled(cv, x, [20, 1, 2])
    q = torch.randn(2, 4, 2, 16).to(dtype)
    m = make_mask(mask, 2, 4, 2, 23, seed=7) if mask else None
    torch.library.opcheck(torch.ops.flashcodec.codec_attention.default,
                          (q, ks, vs, ck.spec, cv.spec, x[:, :, -2:], x[:, :, -2:], m, 1 / math.sqrt(16)))
    torch.library.opcheck(torch.ops.flashcodec.codec_attention.default,
                          (q, ks, vs, ck.spec, cv.spec, x[:, :, -2:], x[:, :, -2:], m, 1 / math.sqrt(16), 2.0),
                          {"sinks": torch.randn(4).to(dtype), "alibi": torch.rand(4)})
