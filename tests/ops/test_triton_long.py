"""Long contexts: a large static capacity holding a short fill, and a (nearly) full one. On CUDA: up to 128k tokens
in a 128k static cache (bf16, H_kv=8, G=4, D=128, the 3-bit preset's codecs), Triton vs the plain-torch reference
on the same device (part of benchmarks/gpu_check.sh). On the CPU interpreter: the same checks at tiny sizes, with the
int8 preset (one encode program per 8 tokens: the interpreter runs every program in Python)."""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICES, preset_codecs, smooth

from flashcodec_fx.codecs import Encoded
from flashcodec_fx.ops import empty_state
from flashcodec_fx.ops.reference.append import append_reference
from flashcodec_fx.ops.reference.attention import codec_attention_reference
from flashcodec_fx.ops.triton.append import triton_append
from flashcodec_fx.ops.triton.attention import triton_codec_attention

# (capacity tokens, stored tokens): a short fill of a large static cache, and a nearly full one
SIZES = {"cuda": [(65536 + 8192, 1000), (131072, 4093), (131072, 131072 - 5)], "cpu": [(1024, 100), (128, 125)]}
PRESET = {"cuda": "3bit", "cpu": "int8"}
SHAPE = {"cuda": dict(hkv=8, group=4, d=128, dtype=torch.bfloat16), "cpu": dict(hkv=2, group=2, d=16, dtype=torch.float32)}
TOL = {torch.float32: 2e-5, torch.bfloat16: 2.5e-2}
CASES = [(device, *size) for device in DEVICES for size in SIZES[device]]


def _filled(codec, device, capacity, length, hkv, d, dtype, seed, fill):
    groups = -(-(capacity - codec.sinks) // codec.group)
    state = list(empty_state(codec, 1, hkv, groups, d, dtype, device))
    x = smooth(1, hkv, length, d, dtype, "cpu", seed).to(device)
    fill(state, x[:, :, : length - 1], codec.spec)  # a prefill, then one decode step
    fill(state, x[:, :, length - 1:], codec.spec)
    return state


@pytest.mark.parametrize(("device", "capacity", "length"), CASES, ids=[f"{c[0]}-cap{c[1]}-L{c[2]}" for c in CASES])
def test_long_static_cache(device, capacity, length):
    shape = SHAPE[device]
    hkv, g, d, dtype = shape["hkv"], shape["group"], shape["d"], shape["dtype"]
    ck, cv = preset_codecs(PRESET[device])
    ks = _filled(ck, device, capacity, length, hkv, d, dtype, 1, triton_append)
    vs = _filled(cv, device, capacity, length, hkv, d, dtype, 2, triton_append)
    # the Triton fill stores what the reference fill stores (a code may land one step apart at a rounding tie)
    for c, got, seed in ((ck, ks, 1), (cv, vs, 2)):
        want = _filled(c, device, capacity, length, hkv, d, dtype, seed, append_reference)
        assert int(got[7]) == int(want[7]) == length and int(got[8]) == int(want[8])
        assert (c.quantizer.codes(got[0], d) == c.quantizer.codes(want[0], d)).float().mean() >= 0.99
        step = float(want[1].float().abs().amax())
        torch.testing.assert_close(c.stored_rows(Encoded(*got[:4]), d), c.stored_rows(Encoded(*want[:4]), d),
                                   atol=2 * step, rtol=TOL[dtype])
        assert torch.equal(got[6], want[6]) and torch.equal(got[5], want[5])
    gen = torch.Generator().manual_seed(length)
    q = torch.randn(1, hkv * g, 1, d, generator=gen).to(dtype).to(device)
    mask = (torch.arange(capacity, device=device) < length).view(1, 1, 1, capacity)
    args = (q, ks, vs, ck.spec, cv.spec, None, None, mask)
    want = codec_attention_reference(*args)
    got = triton_codec_attention(*args)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
