"""`flashcodec::append_attention`: the op is the two appends then codec_attention. Its CPU kernel (one C++ call)
leaves the stream states bitwise those of the three ops and returns their output bitwise; every check runs before any
state changes; the fake kernel, opcheck and torch.compile (the mutated lists functionalized)."""

from __future__ import annotations

import importlib

import pytest
import torch
from _cpu_cases import allocations, codec, make_mask, variant_kwargs
from _op_states import new_state
from torch._subclasses.fake_tensor import FakeTensorMode

from flashcodec_fx import presets
from flashcodec_fx.codecs import make_codec
from flashcodec_fx.ops import append_attention, empty_state
from flashcodec_fx.ops.cpu import launch
from flashcodec_fx.ops.reference import op_kernels
from flashcodec_fx.ops.reference.append import append_reference
from flashcodec_fx.ops.reference.append_attention import append_attention_reference
from flashcodec_fx.ops.reference.attention import codec_attention_reference

fused = importlib.import_module("flashcodec_fx.ops.reference.append_attention")  # the module (its op shadows it)
ops = torch.ops.flashcodec
PRESET_NAMES = ("int8", "4bit", "3bit", "2bit")


def preset_pair(name: str, dtype: torch.dtype):
    """The key and value codecs of a preset as a stream of ``dtype`` stores with them (bf16 raw rows in fp32)."""
    return tuple(c.resolved(dtype) for c in presets.preset_codecs(name))


def streams(ck, cv, b: int, hkv: int, d: int, dtype, prompt: int, capacity: int, seed: int, outliers: bool = True):
    """K / V tokens (``prompt + 40`` of them, channels 3 / 5 wide: normalized presets scale them) and two pairs of
    states holding the prompt (appended by the ops' kernels)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, prompt + 40, d, generator=gen)
    v = torch.randn(b, hkv, prompt + 40, d, generator=gen)
    if outliers:
        k[..., 3] *= 40
        v[..., 5] *= 20
    k, v = k.to(dtype), v.to(dtype)

    def pair():
        ks = list(empty_state(ck, b, hkv, capacity, d, dtype, "cpu"))
        vs = list(empty_state(cv, b, hkv, capacity, d, dtype, "cpu"))
        if prompt:
            ops.append(ks, k[:, :, :prompt], ck.spec, None)
            ops.append(vs, v[:, :, :prompt], cv.spec, None)
        return ks, vs

    return k, v, pair(), pair()


def three_ops(q, ks, vs, ck, cv, kn, vn, **kwargs):
    ops.append(ks, kn, ck.spec, None)
    ops.append(vs, vn, cv.spec, None)
    return ops.codec_attention(q, ks, vs, ck.spec, cv.spec, kn, vn, kwargs.pop("mask", None), kwargs.pop("scale", None),
                               **kwargs)


def assert_bitwise(got_states, want_states, got, want):
    for name, a, b in zip(("k",) * 10 + ("v",) * 10, got_states, want_states, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[got.dtype]
    assert torch.equal(got.view(bits), want.view(bits))


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prompt", [0, 3, 4, 37])
def test_decode_steps_are_bitwise_the_three_ops(cpu_kernels, name, dtype, prompt):
    """Single-token steps from every prompt length around the sinks (the append that measures a normalized stream's
    channel exponents included), GQA 3, the SmolLM2 layer's shape."""
    ck, cv = preset_pair(name, dtype)
    k, v, (ks, vs), (ks2, vs2) = streams(ck, cv, 1, 3, 64, dtype, prompt, prompt + 48, seed=prompt)
    gen = torch.Generator().manual_seed(1)
    for t in range(prompt, prompt + 12):
        q = torch.randn(1, 9, 1, 64, generator=gen).to(dtype)
        kn, vn = k[:, :, t: t + 1], v[:, :, t: t + 1]
        want = three_ops(q, ks, vs, ck, cv, kn, vn)
        got = append_attention(q, ks2, vs2, ck.spec, cv.spec, kn, vn)
        assert_bitwise(ks2 + vs2, ks + vs, got, want)
    if name != "int8" and prompt == 37:
        assert ks2[9].any() and vs2[9].any()  # normalized with channel factors: q, the own tokens, the output scaled


@pytest.mark.parametrize(("k_name", "v_name", "dtype", "b", "hkv", "group", "t", "mask"), [
    ("jpeg-rot-center", "token-lloyd-value", torch.float32, 2, 2, 2, 3, "bool"),  # block kernel; a chunk
    ("token-uniform-4bit", "token-lloyd-value", torch.bfloat16, 2, 1, 4, 1, "additive"),  # one kv head
    ("png-pruned", "jpeg-int8", torch.float16, 1, 2, 1, 5, None),
    ("channel-key", "png", torch.float32, 1, 3, 3, 2, "bool"),
])
def test_other_codecs_batches_masks_and_chunks(cpu_kernels, k_name, v_name, dtype, b, hkv, group, t, mask):
    ck, cv = codec(k_name), codec(v_name)
    d = 32
    k, v, (ks, vs), (ks2, vs2) = streams(ck, cv, b, hkv, d, dtype, 21, 80, seed=5, outliers=False)
    gen = torch.Generator().manual_seed(2)
    at = 21
    for step in range(4):
        q = torch.randn(b, hkv * group, t, d, generator=gen).to(dtype)
        kn, vn = k[:, :, at: at + t], v[:, :, at: at + t]
        m = make_mask(mask, b, hkv * group, t, 80, seed=step + 1) if mask else None
        want = three_ops(q, ks, vs, ck, cv, kn, vn, mask=m, scale=0.3)
        got = append_attention(q, ks2, vs2, ck.spec, cv.spec, kn, vn, m, 0.3)
        assert_bitwise(ks2 + vs2, ks + vs, got, want)
        at += t


@pytest.mark.parametrize("variants", [("softcap",), ("sinks",), ("alibi",), ("softcap", "sinks", "alibi")])
def test_variants_are_bitwise_the_three_ops(cpu_kernels, variants):
    ck, cv = preset_pair("4bit", torch.float32)
    k, v, (ks, vs), (ks2, vs2) = streams(ck, cv, 1, 3, 64, torch.float32, 40, 60, seed=3)
    kwargs = variant_kwargs(30.0 if "softcap" in variants else None, "sinks" in variants, "alibi" in variants, 9, 0)
    for t in range(40, 44):
        q = torch.randn(1, 9, 1, 64)
        want = three_ops(q, ks, vs, ck, cv, k[:, :, t: t + 1], v[:, :, t: t + 1], **dict(kwargs))
        got = append_attention(q, ks2, vs2, ck.spec, cv.spec, k[:, :, t: t + 1], v[:, :, t: t + 1], **kwargs)
        assert_bitwise(ks2 + vs2, ks + vs, got, want)


def test_strided_inputs_and_two_threads(cpu_kernels):
    """q and the new tokens as views with any strides (a model's transposed projections); two threads at a length
    where the attention splits."""
    torch.set_num_threads(2)
    ck, cv = preset_pair("3bit", torch.float32)
    k, v, (ks, vs), (ks2, vs2) = streams(ck, cv, 1, 2, 64, torch.float32, 3000, 3100, seed=4)
    for t in range(3000, 3003):
        q = torch.randn(1, 1, 8, 64).transpose(1, 2)  # (1, 8, 1, 64), non-contiguous
        kn = k[:, :, t: t + 1].transpose(1, 2).contiguous().transpose(1, 2)
        vn = v[:, :, t: t + 1]
        want = three_ops(q, ks, vs, ck, cv, kn, vn)
        got = append_attention(q, ks2, vs2, ck.spec, cv.spec, kn, vn)
        assert_bitwise(ks2 + vs2, ks + vs, got, want)


def test_the_reference_is_the_three_reference_ops(monkeypatch):
    """append_attention_reference runs the ops (on CPU their kernels); with the reference kernels it is the
    references' composition, outputs and states alike."""
    ck, cv = preset_pair("4bit", torch.float32)
    k, v, (ks, vs), (ks2, vs2) = streams(ck, cv, 1, 2, 32, torch.float32, 30, 40, seed=6)
    q = torch.randn(1, 4, 2, 32)
    kn, vn = k[:, :, 30:32], v[:, :, 30:32]
    append_reference(ks, kn, ck.spec)
    append_reference(vs, vn, cv.spec)
    want = codec_attention_reference(q, ks, vs, ck.spec, cv.spec, kn, vn)
    monkeypatch.setattr(fused, "append", lambda *a: append_reference(*a))
    monkeypatch.setattr(fused, "codec_attention", codec_attention_reference)
    got = append_attention_reference(q, ks2, vs2, ck.spec, cv.spec, kn, vn)
    assert_bitwise(ks2 + vs2, ks + vs, got, want)


def _bad_calls(q, ks, vs, sk, sv, kn, vn):
    """(arguments, exception, message) of calls that must fail before changing anything."""
    return [
        ((q, ks, vs, "jpeg:nonsense", sv, kn, vn), ValueError, "spec_k"),
        ((q, ks, vs, sk, 5, kn, vn), TypeError, "spec_v"),
        ((q, ks[:9], vs, sk, sv, kn, vn), ValueError, "k_state must hold"),
        ((q, ks, vs, sk, sv, kn[:, :1], vn), ValueError, "k_new must be"),
        ((q, ks, vs, sk, sv, kn, vn.double()), ValueError, "v_new must be"),
        ((q, ks, vs, sk, sv, kn, vn[:, :, :0]), ValueError, "k_new and v_new must hold the same tokens"),
        ((q[:, :2], ks, vs, sk, sv, kn, vn), ValueError, "query heads"),
        ((q.half(), ks, vs, sk, sv, kn, vn), ValueError, "q dtype"),
        ((q, ks, vs, sk, sv, None, vn), TypeError, "k_new must be a tensor"),
        ((q, ks, vs, sk, sv, kn, vn, torch.ones(1, 1, 1, 9, dtype=torch.int64)), ValueError, "mask"),
        ((q, ks, vs, sk, sv, kn, vn, None, None, -1.0), ValueError, "softcap must be a positive"),
        ((q, ks, vs, sk, sv, kn, vn, None, None, None, torch.zeros(2)), ValueError, r"sinks must have shape \(Hq,\)"),
        ((q, ks, vs, sk, sv, kn, vn, None, None, None, None, torch.zeros(9, dtype=torch.float64)), TypeError,
         "alibi must be a float32 tensor"),
    ]


@pytest.mark.parametrize("call", ["op", "cpu", "reference"])
def test_checks_name_the_parameter_before_any_state_changes(cpu_kernels, call):
    """Each bad argument raises naming it and leaves both streams as they were, also after the same pair's valid
    layout was remembered by the CPU kernel (the remembered layout never lets another value pass)."""
    fn = {"op": append_attention, "cpu": launch.cpu_append_attention, "reference": append_attention_reference}[call]
    ck, cv = preset_pair("4bit", torch.float32)
    k, v, (ks, vs), _ = streams(ck, cv, 1, 3, 64, torch.float32, 40, 60, seed=7)
    q, kn, vn = torch.randn(1, 9, 1, 64), k[:, :, 40:41], v[:, :, 40:41]
    fn(q, ks, vs, ck.spec, cv.spec, kn, vn, None, None, 1.0)  # a valid layout first
    before = [t.clone() for t in ks + vs]
    for args, error, message in _bad_calls(q, ks, vs, ck.spec, cv.spec, kn, vn):
        if call == "op" and error is TypeError and message != "spec_v":  # the dispatcher refuses non-tensors itself
            continue
        with pytest.raises((error, RuntimeError) if call == "op" and message == "spec_v" else error, match=message):
            fn(*args)
        assert all(torch.equal(a, b) for a, b in zip(ks + vs, before, strict=True)), message


def test_a_codec_or_dtype_the_kernels_do_not_serve_runs_the_reference(cpu_kernels):
    """head_dim not a multiple of 8 and float64 streams: the reference ops, the same results as the three ops."""
    c = make_codec("jpeg", block_size=1, quant_bits=4, levels="lloyd", rotate=True, sinks=2, window=3)
    for d, dtype in ((12, torch.float32), (16, torch.float64)):
        x = torch.randn(1, 2, 20, d).to(dtype)
        ks, vs = new_state(c, x, 24), new_state(c, x, 24)
        ks2, vs2 = new_state(c, x, 24), new_state(c, x, 24)
        for s in ((ks, vs), (ks2, vs2)):
            ops.append(s[0], x[:, :, :15], c.spec, None)
            ops.append(s[1], x[:, :, :15], c.spec, None)
        q = torch.randn(1, 4, 1, d).to(dtype)
        want = three_ops(q, list(ks), list(vs), c, c, x[:, :, 15:16], x[:, :, 15:16])
        got = append_attention(q, list(ks2), list(vs2), c.spec, c.spec, x[:, :, 15:16], x[:, :, 15:16])
        assert torch.equal(got, want)


def test_a_decode_step_allocates_only_its_output(cpu_kernels):
    ck, cv = preset_pair("4bit", torch.float32)
    k, v, (ks, vs), _ = streams(ck, cv, 1, 3, 64, torch.float32, 200, 260, seed=8)
    q = torch.randn(1, 9, 1, 64)
    step = launch.cpu_append_attention  # the kernel itself (the profiler counts an op's allocations twice)
    step(q, ks, vs, ck.spec, cv.spec, k[:, :, 200:201], v[:, :, 200:201])  # the layout remembered
    seen = allocations(lambda: step(q, ks, vs, ck.spec, cv.spec, k[:, :, 201:202], v[:, :, 201:202]))
    assert seen == [q.numel() * 4]


def test_kernels_are_registered_and_read_back(cpu_kernels):
    kernels = op_kernels(fused.QUALNAME)
    assert kernels[None] is append_attention_reference
    assert kernels["cpu"] is launch.cpu_append_attention
    fused.register_kernel("cpu", launch.cpu_append_attention)  # again: a no-op
    calls = []

    def spy(*args):
        calls.append(1)
        return launch.cpu_append_attention(*args)

    try:
        fused.register_kernel("cpu", spy)  # another function replaces it
        ck, cv = preset_pair("int8", torch.float32)
        k, v, (ks, vs), _ = streams(ck, cv, 1, 1, 16, torch.float32, 5, 10, seed=9)
        append_attention(torch.randn(1, 2, 1, 16), ks, vs, ck.spec, cv.spec, k[:, :, 5:6], v[:, :, 5:6])
        assert calls == [1]
    finally:
        fused.register_kernel("cpu", launch.cpu_append_attention)


def test_fake_kernel_matches_the_real_output():
    ck, cv = preset_pair("4bit", torch.bfloat16)
    k, v, (ks, vs), _ = streams(ck, cv, 2, 2, 32, torch.bfloat16, 10, 20, seed=10)
    q = torch.randn(2, 4, 3, 32).to(torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
    args = (q, ks, vs, ck.spec, cv.spec, k[:, :, 10:13], v[:, :, 10:13])
    kwargs = {"softcap": 20.0, "sinks": torch.randn(4).to(torch.bfloat16), "alibi": torch.rand(4)}
    mode = FakeTensorMode()
    with mode:
        fake_args, fake_kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        fake = append_attention(*fake_args, **fake_kwargs)
        with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\)"):
            append_attention(*fake_args, sinks=fake_kwargs["sinks"][:2])
    real = append_attention(*args, **kwargs)
    assert fake.shape == real.shape and fake.dtype == real.dtype and fake.stride() == real.stride()


@pytest.mark.parametrize(("name", "dtype", "t", "mask", "variants"), [
    ("4bit", torch.float32, 1, None, False),
    ("int8", torch.bfloat16, 2, "bool", True),
    ("3bit", torch.float16, 1, "additive", False),
])
def test_opcheck(cpu_kernels, name, dtype, t, mask, variants):
    ck, cv = preset_pair(name, dtype)
    k, v, (ks, vs), _ = streams(ck, cv, 2, 2, 16, dtype, 20, 30, seed=11)
    q = torch.randn(2, 4, t, 16).to(dtype)
    m = make_mask(mask, 2, 4, t, 30, seed=3) if mask else None
    kwargs = variant_kwargs(5.0, True, True, 4, 0) if variants else {}
    torch.library.opcheck(ops.append_attention.default,
                          (q, ks, vs, ck.spec, cv.spec, k[:, :, 20: 20 + t], v[:, :, 20: 20 + t], m), kwargs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_traces_it(cpu_kernels, backend):
    """fullgraph: the op with its mutated state lists is functionalized and its writes land in the caller's states,
    the same as eager."""
    ck, cv = preset_pair("4bit", torch.float32)
    k, v, (ks, vs), (ks2, vs2) = streams(ck, cv, 1, 2, 32, torch.float32, 20, 30, seed=12)

    def step(q, ks, vs, kn, vn):
        return append_attention(q, ks, vs, ck.spec, cv.spec, kn, vn) * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for t in range(20, 23):
        q = torch.randn(1, 4, 1, 32)
        want = step(q, ks, vs, k[:, :, t: t + 1], v[:, :, t: t + 1])
        got = compiled(q, ks2, vs2, k[:, :, t: t + 1], v[:, :, t: t + 1])
        assert_bitwise(ks2 + vs2, ks + vs, got, want)
