"""The C++ CPU kernel of `flashcodec::append` against the reference (the spec), called directly: bitwise, with the
reference run on one thread (the kernel's products use one BLAS thread; MKL rounds some small products differently
with more, so the reference itself changes with the thread count there)."""

from __future__ import annotations

import pytest
import torch
from _cpu_cases import CODECS, DTYPES, HEAD_DIMS, chunks, codec, filled
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcodec_fx.ops.cpu.launch import cpu_append
from flashcodec_fx.ops.reference.append import append_reference
from flashcodec_fx.ops.state import StreamState, capacity, empty_state

QUANTIZED = [name for name in CODECS if "quant_bits" in CODECS[name][1]]
# Largest share of codes and scales allowed to differ from the reference. The encoder follows BLAS's order for the DCT
# and rotation sums and torch's for the quantizer's sums, and is bitwise equal here (0 of ~20M codes differ; see
# test_mismatch_rate_on_random_data); a BLAS or torch build that orders its sums otherwise could move a value sitting
# at a rounding tie by one code step (or one fp16 scale step), which this bound tolerates without hiding a real bug.
TIE_RATE = 1e-4


@pytest.fixture(autouse=True)
def one_thread():
    """The reference's BLAS products on one thread, as the kernel's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_blas_products_stay_on_the_calling_thread(cpu_kernels):
    """With torch's MKL the kernel can keep its products off a BLAS thread team (a busy machine stalls one)."""
    assert cpu_kernels.serial_blas() == torch.backends.mkl.is_available()


def assert_same_state(got: list[torch.Tensor], want: list[torch.Tensor], codec_name: str) -> None:
    """Bitwise, except codes / scales / zero points of quantized codecs within the tie rate, one step apart."""
    c = codec(codec_name)
    for field, a, b in zip(StreamState._fields, got, want, strict=True):
        if torch.equal(a, b):
            continue
        assert c.quantizer is not None and field in ("data", "scale", "zero"), f"{field} differs"
        if field == "data":
            d = a.shape[-1] * 8 // sum(c.quantizer.bits)
            ca, cb = c.quantizer.codes(a, d), c.quantizer.codes(b, d)
            assert (ca - cb).abs().max() <= 1 and (ca != cb).float().mean() <= TIE_RATE, field
        else:
            ulp = torch.finfo(torch.float16).eps * b.float().abs().clamp_min(2.0**-14)
            assert ((a.float() - b.float()).abs() <= ulp).all() and (a != b).float().mean() <= TIE_RATE, field


@st.composite
def append_cases(draw):
    return {"codec": draw(st.sampled_from(sorted(CODECS))), "dtype": draw(st.sampled_from(DTYPES)),
            "b": draw(st.integers(1, 2)), "h": draw(st.integers(1, 3)), "d": draw(st.sampled_from(HEAD_DIMS)),
            "length": draw(st.integers(1, 60)), "seed": draw(st.integers(0, 10**6)), "memo": draw(st.booleans()),
            "groups": draw(st.integers(0, 12))}


@settings(max_examples=80, deadline=None)
@given(case=append_cases())
def test_matches_reference(cpu_kernels, case):
    """Random chunk schedules (prefills, single tokens, group-completing chunks), every stored form and dtype, memo
    or not, archives too small for the stream (overflow: nothing written past the capacity)."""
    c = codec(case["codec"])
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["b"], case["h"], case["length"], case["d"], generator=gen).to(case["dtype"])
    state = list(empty_state(c, case["b"], case["h"], case["groups"], case["d"], case["dtype"], "cpu"))
    ref = [t.clone() for t in state]
    cap = capacity(c, state)
    memo = torch.zeros(case["b"], case["h"], cap, case["d"], dtype=case["dtype"]) if case["memo"] else None
    ref_memo = None if memo is None else memo.clone()
    at = 0
    for n in chunks(case["length"], case["seed"]):
        cpu_append(state, x[:, :, at: at + n], c.spec, memo)
        append_reference(ref, x[:, :, at: at + n], c.spec, ref_memo)
        at += n
        assert_same_state(state, ref, case["codec"])
    if memo is not None and c.quantizer is None:
        assert torch.equal(memo, ref_memo)
    elif memo is not None:
        torch.testing.assert_close(memo.float(), ref_memo.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("name", ["channel-key", "token-lloyd-value", "png-pruned"])
def test_crop_then_append(cpu_kernels, name):
    """A crop inside the tail (only the length moves) followed by appends: the stale rows are overwritten as the
    reference overwrites them."""
    c = codec(name)
    x = torch.randn(1, 2, 50, 16)
    state = filled(c, x, [23, 1, 1], appender=cpu_append)
    ref = filled(c, x, [23, 1, 1])
    for s in (state, ref):
        s[7].fill_(int(s[8]) + 1)
    for n in (1, 9, 3):
        cpu_append(state, x[:, :, 30: 30 + n], c.spec)
        append_reference(ref, x[:, :, 30: 30 + n], c.spec)
        assert_same_state(state, ref, name)


def test_strided_state_is_written_back(cpu_kernels):
    """State tensors whose inner dims are not contiguous are computed on contiguous copies and written back."""
    c = codec("token-table")
    x = torch.randn(2, 2, 30, 16)
    base = list(empty_state(c, 2, 2, 9, 16, torch.float32, "cpu"))
    state = [t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 4 and t.numel() else t for t in base]
    assert not state[6].is_contiguous()
    ref = [t.clone() for t in base]
    for at, n in ((0, 21), (21, 1), (22, 8)):
        cpu_append(state, x[:, :, at: at + n], c.spec)
        append_reference(ref, x[:, :, at: at + n], c.spec)
    assert_same_state(state, ref, "token-table")


def test_rejected_append_mutates_nothing(cpu_kernels):
    c = codec("jpeg-int8")
    state = filled(c, torch.randn(1, 2, 11, 8), [11], appender=cpu_append)
    before = [t.clone() for t in state]
    with pytest.raises(ValueError, match="new must be"):
        cpu_append(state, torch.randn(1, 3, 2, 8), c.spec)
    with pytest.raises(ValueError, match="memo must be"):
        cpu_append(state, torch.randn(1, 2, 2, 8), c.spec, torch.zeros(1, 2, 3, 8))
    assert all(torch.equal(a, b) for a, b in zip(state, before, strict=True))


@pytest.mark.parametrize("name", QUANTIZED)
def test_mismatch_rate_on_random_data(cpu_kernels, name):
    """Whole-stream encodes of random data at D=64: the share of codes and scales that differ from the reference's,
    measured (0 of ~20M codes on the development machine, at larger sizes) and bounded by TIE_RATE."""
    c = codec(name)
    gen = torch.Generator().manual_seed(len(name))
    x = torch.randn(1, 4, 1000, 64, generator=gen) * torch.rand(1, 1, 1, 64, generator=gen) * 3
    got = filled(c, x, [800, 1, 199], appender=cpu_append)
    want = filled(c, x, [800, 1, 199])
    assert_same_state(got, want, name)


@pytest.mark.parametrize("memo", [False, True])
@pytest.mark.parametrize(("name", "dtype"), [("jpeg-int8", torch.float32), ("channel-key", torch.bfloat16),
                                             ("token-lloyd-value", torch.float16), ("png-pruned", torch.float32)])
def test_opcheck(cpu_kernels, name, dtype, memo):
    c = codec(name)
    state = filled(c, torch.randn(2, 2, 9, 16).to(dtype), [9], groups=6, appender=cpu_append)
    buf = torch.zeros(2, 2, capacity(c, state), 16, dtype=dtype) if memo else None
    torch.library.opcheck(torch.ops.flashcodec.append.default, (state, torch.randn(2, 2, 7, 16).to(dtype), c.spec, buf))


def test_dispatcher_runs_the_cpu_kernel(cpu_kernels, monkeypatch):
    """The op's CPU kernel is this one: it works while the reference is made to fail."""
    import flashcodec_fx.ops.cpu.launch as launch

    def fail(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(launch, "append_reference", fail)
    c = codec("jpeg-int8")
    state = list(empty_state(c, 1, 2, 3, 8, torch.float32, "cpu"))
    torch.ops.flashcodec.append(state, torch.randn(1, 2, 9, 8), c.spec, None)
    assert int(state[7]) == 9 and int(state[8]) == 8
