"""Triton ``flashcodec::append_attention`` (the append launcher twice, then the attention launcher) against the
reference: the states as Triton's append stores them (same tolerance as tests/ops/test_triton_append.py), the output
within the attention launcher's tolerance of the reference on those states; bit for bit the three launchers called in
turn; checks before any state changes; the gate serves it where the fast kernels know the codecs."""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICES, form, groups_for, preset_codecs, same_archive, smooth, to

from flashcodec_fx.ops import empty_state
from flashcodec_fx.ops.reference.append import append_reference
from flashcodec_fx.ops.reference.append_attention import append_attention_reference
from flashcodec_fx.ops.reference.attention import codec_attention_reference
from flashcodec_fx.ops.triton import gate as triton_gate
from flashcodec_fx.ops.triton.append import triton_append
from flashcodec_fx.ops.triton.attention import triton_codec_attention
from flashcodec_fx.ops.triton.fused import triton_append_attention

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
# (key codec, value codec, dtype, GQA group, prompt, new tokens per call, mask, variants)
CASES = [
    ("preset:4bit", "preset:4bit", torch.float32, 3, 40, 1, None, False),
    ("preset:int8", "preset:int8", torch.float16, 2, 9, 2, "causal", True),
    ("lloyd_rot", "int8", torch.float32, 1, 21, 1, "causal", False),
    ("tcq3", "tcq_table", torch.float32, 2, 21, 1, "causal", False),  # trellis codes (levels="tcq")
]


def _codec(name: str, which: int):
    return preset_codecs(name.split(":")[1])[which] if name.startswith("preset:") else form(name)


def _states(ck, cv, k, v, prompt, device, capacity):
    b, h, _, d = k.shape
    ks = list(empty_state(ck, b, h, groups_for(ck, capacity), d, k.dtype, device))
    vs = list(empty_state(cv, b, h, groups_for(cv, capacity), d, v.dtype, device))
    append_reference(ks, k[:, :, :prompt].to(device), ck.spec)
    append_reference(vs, v[:, :, :prompt].to(device), cv.spec)
    return ks, vs


def _mask(kind, length, t, width):
    if kind is None:
        return None
    return (torch.arange(width)[None] <= (length - t + torch.arange(t))[:, None])[None, None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{str(c[2])[6:]}-T{c[5]}" for c in CASES])
def test_steps_match_the_reference(device, case):
    k_name, v_name, dtype, group, prompt, t, mask_kind, variants = case
    ck, cv = (_codec(k_name, 0), _codec(v_name, 1))
    b, hkv, d, steps = 2, 2, 16, 3
    k = smooth(b, hkv, prompt + steps * t, d, dtype, "cpu", 1)
    v = smooth(b, hkv, prompt + steps * t, d, dtype, "cpu", 2)
    capacity = prompt + steps * t
    got_k, got_v = _states(ck, cv, k, v, prompt, device, capacity)
    want_k, want_v = _states(ck, cv, k, v, prompt, "cpu", capacity)
    alt_k, alt_v = _states(ck, cv, k, v, prompt, device, capacity)
    gen = torch.Generator().manual_seed(3)
    hq = hkv * group
    kw = {}
    if variants:
        kw = {"softcap": 1.5, "sinks": (2 + torch.randn(hq, generator=gen)).to(dtype),
              "alibi": 2.0 ** (-8.0 * torch.arange(1, hq + 1) / hq)}
    for step in range(steps):
        at = prompt + step * t
        q = torch.randn(b, hq, t, d, generator=gen).to(dtype)
        kn, vn = k[:, :, at: at + t], v[:, :, at: at + t]
        width = max(ck.sinks + got_k[0].shape[2] * ck.group, cv.sinks + got_v[0].shape[2] * cv.group)
        m = _mask(mask_kind, at + t, t, width)
        on = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
        got = triton_append_attention(*to(device, q), got_k, got_v, ck.spec, cv.spec, *to(device, kn, vn),
                                      None if m is None else m.to(device), None, **on).cpu()
        want = append_attention_reference(q, want_k, want_v, ck.spec, cv.spec, kn, vn, m, None, **kw)
        # the three launchers in turn: the same bits
        triton_append(alt_k, kn.to(device), ck.spec)
        triton_append(alt_v, vn.to(device), cv.spec)
        alt = triton_codec_attention(*to(device, q), alt_k, alt_v, ck.spec, cv.spec, *to(device, kn, vn),
                                     None if m is None else m.to(device), None, **on).cpu()
        assert torch.equal(got, alt)
        assert all(torch.equal(a.cpu(), c.cpu()) for a, c in zip(got_k + got_v, alt_k + alt_v, strict=True))
        # the states as Triton's append stores them; the output as the reference reads those states
        for codec, mine, ref in ((ck, got_k, want_k), (cv, got_v, want_v)):
            mine = [x.cpu() for x in mine]
            for i in (5, 6, 7, 8, 9):
                assert torch.equal(mine[i], ref[i])
            same_archive(codec, mine[:4], ref[:4], d, dtype)
        on_mine = codec_attention_reference(q, [x.cpu() for x in got_k], [x.cpu() for x in got_v], ck.spec, cv.spec,
                                            kn, vn, m, None, **kw)
        torch.testing.assert_close(got.float(), on_mine.float(), atol=TOL[dtype], rtol=TOL[dtype])
        assert got.shape == want.shape and got.dtype == want.dtype


@pytest.mark.parametrize("device", DEVICES)
def test_checks_run_before_any_state_changes(device):
    ck, cv = preset_codecs("3bit")
    k = smooth(1, 2, 12, 16, torch.float32, "cpu", 4)
    ks, vs = _states(ck, cv, k, k, 10, device, 12)
    before = [x.clone() for x in ks + vs]
    q = torch.randn(1, 4, 1, 16, device=device)
    bad = [((q, ks, vs, ck.spec, cv.spec, k[:, :, 10:11].to(device), k[:, :, 10:11, :8].to(device)), "v_new must be"),
           ((q, ks, vs, ck.spec, cv.spec, k[:, :, 10:11].to(device), k[:, :, 10:11].to(device), None, None, 0.0),
            "softcap must be a positive")]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            triton_append_attention(*args)
        assert all(torch.equal(a, c) for a, c in zip(ks + vs, before, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_the_gate_serves_it(monkeypatch, device):
    """The gated CUDA kernel runs the Triton launcher where the fast kernels know the codecs and the head_dim, the
    reference otherwise (head_dim 12)."""
    monkeypatch.setattr(triton_gate, "kernel_choice", lambda device: "triton")
    ran = []
    launcher = triton_gate.KERNELS["flashcodec::append_attention"]
    assert launcher is triton_append_attention

    def recorded(name, fn):
        def call(*args):
            ran.append(name)
            return fn(*args)
        return call

    spy = triton_gate.gated(recorded("triton", launcher), recorded("reference", append_attention_reference),
                            triton_gate.HEAD_DIM["flashcodec::append_attention"])
    c = form("lloyd_rot")
    for d, want in ((16, "triton"), (12, "reference")):
        x = smooth(1, 1, 14, d, torch.float32, "cpu", 5)
        ks, vs = _states(c, c, x, x, 12, device, 14)
        ran.clear()
        spy(torch.randn(1, 2, 1, d).to(device), ks, vs, c.spec, c.spec, *to(device, x[:, :, 12:13], x[:, :, 12:13]))
        assert ran == [want]

