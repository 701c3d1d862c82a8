"""The CUDA registration's capability gate and the kernel tables made when a stream allocates (CPU: faked)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _triton_cases import DEVICES, form, smooth, stored_state

from flashcodec_fx import CodecStream
from flashcodec_fx.ops.triton import gate as triton_gate
from flashcodec_fx.ops.triton.common import _tables, stream_tables


@pytest.fixture
def fake_capability(monkeypatch):
    """``set(index -> (major, minor))`` replaces the CUDA capability query; the per-device choice cache is reset."""
    table = {}
    monkeypatch.setattr(triton_gate, "_capability", lambda index: table[index])
    triton_gate.kernel_choice.cache_clear()
    yield table.update
    triton_gate.kernel_choice.cache_clear()


def test_devices_below_sm80_get_the_reference_with_one_warning(fake_capability):
    fake_capability({0: (7, 5), 1: (9, 0), 2: (8, 0)})
    with pytest.warns(triton_gate.OldGPUFallback, match="cuda:0 has compute capability 7.5.*8.0 or newer"):
        assert triton_gate.kernel_choice(torch.device("cuda", 0)) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cached per device: no second warning, no second query
        assert triton_gate.kernel_choice(torch.device("cuda", 0)) == "reference"
        assert triton_gate.kernel_choice(torch.device("cuda", 1)) == "triton"
        assert triton_gate.kernel_choice(torch.device("cuda", 2)) == "triton"


@pytest.mark.parametrize("device", DEVICES)
def test_the_gated_kernel_runs_what_the_choice_says(monkeypatch, device):
    """The registered CUDA kernel dispatches per call on the device of its first tensor (here a state list); called
    directly with the choice forced: "reference" runs the plain-torch op, "triton" the launcher (bit for bit each)."""
    from flashcodec_fx.ops.reference.attention import codec_attention_reference
    from flashcodec_fx.ops.triton.attention import triton_codec_attention

    ck, cv = form("int8"), form("lloyd_rot")
    ks = [t.to(device) for t in stored_state(ck, smooth(1, 2, 21, 16, torch.float32, "cpu", 1), 4)]
    vs = [t.to(device) for t in stored_state(cv, smooth(1, 2, 21, 16, torch.float32, "cpu", 2), 4)]
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(0)).to(device)
    args = (q, ks, vs, ck.spec, cv.spec)
    kernel = triton_gate.gated(triton_codec_attention, codec_attention_reference)
    assert kernel.__qualname__ == "triton_codec_attention"  # the kernel report names the launcher
    monkeypatch.setattr(triton_gate, "kernel_choice", lambda device: "reference")
    assert torch.equal(kernel(*args), codec_attention_reference(*args))
    monkeypatch.setattr(triton_gate, "kernel_choice", lambda device: "triton")
    assert torch.equal(kernel(*args), triton_codec_attention(*args))
    # an op whose first argument is a state list (append) is dispatched on that list's device
    seen = []
    monkeypatch.setattr(triton_gate, "kernel_choice", lambda device: seen.append(device) or "reference")

    def appended(state, new, spec):
        return "triton"

    def appended_reference(state, new, spec):
        return "reference"

    assert triton_gate.gated(appended, appended_reference)(ks, q, ck.spec) == "reference"
    assert [d.type for d in seen] == [torch.device(device).type]  # cuda:0 on a GPU


def _op_args(op: str, d: int, device: str) -> list[tuple]:
    """Calls of ``op`` at head_dim ``d`` (int8 codes: the stored groups' last dimension is packed bytes)."""
    codec = form("int8")
    x = smooth(1, 2, 2 * codec.group, d, torch.float32, "cpu", 3)
    if op == "flashcodec::encode":
        return [(x.to(device), codec.spec, None)]
    if op == "flashcodec::decode":
        return [(*(t.to(device) for t in codec.encode(x)), codec.spec, torch.float32, None)]
    state = [t.to(device) for t in stored_state(codec, x, 3)]
    return [(state, codec.spec), (state, codec.spec, x[:, :, -1:].to(device))]  # read, with and without new tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["flashcodec::encode", "flashcodec::decode", "flashcodec::read"])
def test_each_op_is_gated_on_its_own_head_dim(monkeypatch, device, op):
    """The op has a CUDA kernel (``KERNELS``); the gate reads each op's head_dim where that op holds it (encode:
    x; decode: the stored groups, whose last dimension is packed bytes; read: the state's tail, with or without new
    tokens): head_dim 16 runs the Triton launcher (bit for bit), 12 the reference (the fast kernels take multiples of
    8), and so do a bad spec and a tensor of the wrong rank, which the reference names."""
    from flashcodec_fx.ops.reference.blocks import decode_reference, encode_reference
    from flashcodec_fx.ops.reference.read import read_reference

    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    reference = {"flashcodec::encode": encode_reference, "flashcodec::decode": decode_reference,
                 "flashcodec::read": read_reference}[op]
    launcher = triton_gate.KERNELS[op]
    kernel = triton_gate.gated(launcher, reference, triton_gate.HEAD_DIM[op])
    assert kernel.__qualname__ == launcher.__qualname__
    monkeypatch.setattr(triton_gate, "kernel_choice", lambda device: "triton")
    ran = []

    def recorded(name, fn):
        def call(*args):
            ran.append(name)
            return fn(*args)
        return call

    spy = triton_gate.gated(recorded("triton", launcher), recorded("reference", reference),
                                triton_gate.HEAD_DIM[op])
    for d, want in ((16, "triton"), (12, "reference")):
        for args in _op_args(op, d, device):
            ran.clear()
            got = spy(*args)
            assert ran == [want]
            direct = (launcher if want == "triton" else reference)(*args)
            if op != "flashcodec::encode":
                got, direct = (got,), (direct,)
            assert all(torch.equal(a, b) for a, b in zip(got, direct, strict=True))
    args = _op_args(op, 16, device)[0]
    spec_at = next(i for i, a in enumerate(args) if isinstance(a, str))
    bad_spec = (*args[:spec_at], "jpeg;bad", *args[spec_at + 1:])
    bad_rank = (args[0][:6] if op == "flashcodec::read" else args[0][0, 0], *args[1:])  # 6 state tensors; another rank
    for wrong, match in ((bad_spec, "spec: "), (bad_rank, "must")):
        ran.clear()
        with pytest.raises((ValueError, TypeError), match=match):
            spy(*wrong)
        assert ran == ["reference"]


def _trellis_op_args(op: str, codec, d: int) -> tuple:
    """One call of ``op`` on streams of ``codec`` at head_dim ``d`` (CPU tensors; only the gate reads them)."""
    x = smooth(1, 2, 2 * codec.group + 8, d, torch.float32, "cpu", 3)
    state = stored_state(codec, x, 4)
    q = torch.zeros(1, 4, 1, d)
    return {"flashcodec::codec_attention": (q, state, state, codec.spec, codec.spec),
            "flashcodec::append_attention": (q, state, state, codec.spec, codec.spec, x[:, :, :1], x[:, :, :1]),
            "flashcodec::append": (state, x[:, :, :1], codec.spec),
            "flashcodec::encode": (x[:, :, : 2 * codec.group], codec.spec, None),
            "flashcodec::decode": (*codec.encode(x[:, :, : 2 * codec.group]), codec.spec, torch.float32, None),
            "flashcodec::read": (state, codec.spec)}[op]


@pytest.mark.parametrize("op", sorted(triton_gate.KERNELS))
def test_trellis_codecs_get_triton_in_every_op(monkeypatch, op):
    """The registered CUDA kernels (``gated_kernels``, launchers and references replaced by recorders) run the
    Triton launcher for trellis codes (levels="tcq") in every op, as for scalar codes: no silent fallback to the
    reference; a head_dim the fast kernels do not take still gets the reference."""
    monkeypatch.setattr(triton_gate, "kernel_choice", lambda device: "triton")
    ran = []
    monkeypatch.setitem(triton_gate.KERNELS, op, lambda *args: ran.append("triton"))
    monkeypatch.setattr(triton_gate, "op_kernels", lambda name: {None: lambda *args: ran.append("reference")})
    kernel = triton_gate.gated_kernels()[op]
    for name, d, want in (("tcq3", 16, "triton"), ("tcq_table", 16, "triton"), ("lloyd_rot", 16, "triton"),
                          ("tcq2", 12, "reference")):
        ran.clear()
        kernel(*_trellis_op_args(op, form(name), d))
        assert ran == [want], (name, d)


def test_a_stream_creates_its_kernel_tables_when_it_allocates():
    """The first kernel call inside a CUDA-graph capture must find the kernels' tables (synthesis, rotation, row
    table, level tables) on the device already: the stream creates them with its storage (``ops.warm``), and the
    kernels' lookup returns those very tensors."""
    c = form("lloyd_uniform")
    _tables.cache_clear()
    stream = CodecStream(c, "static", max_length=32)
    assert _tables.cache_info().currsize == 0
    stream.append(smooth(1, 2, 5, 16, torch.float32, "cpu", 0))
    assert _tables.cache_info().currsize == 1
    made = _tables(c.spec, 16, torch.device("cpu"))
    tables = stream_tables(c, 16, "cpu")
    assert all(a is b for a, b in zip(vars(tables).values(), vars(made).values(), strict=True))
    assert _tables.cache_info().misses == 1  # no second creation
    assert tables.rows.tolist() == [[6, 3], [0, 6], [0, 1], [-1, 0], [3, 1]]  # bits, offsets, classes, zeros, kinds
    assert tables.rotation.shape == (16, 16) and tables.levels.shape == (2, 64)


def test_the_lazily_registered_ops_are_the_gates_kernels():
    """``ops.triton.register`` (no Triton import) installs a CUDA kernel for exactly the ops the gate has launchers
    for."""
    from flashcodec_fx.ops import triton as triton_ops

    assert set(triton_ops.OPS) == set(triton_gate.KERNELS) == set(triton_gate.HEAD_DIM)
    assert triton_ops.LAUNCHERS == {op: f"{fn.__module__}.{fn.__qualname__}" for op, fn in triton_gate.KERNELS.items()}
