"""Long contexts: a large static capacity holding a short fill, and a (nearly) full one. On CUDA: up to 128k tokens
in a 128k static cache (bf16, H_kv=8, G=4, D=128), Triton vs the plain-torch reference on the same device (part of
benchmarks/gpu_check.sh). On the CPU interpreter: the same checks at tiny sizes."""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICES, codec, smooth

from flashcodec_fx import _compat
from flashcodec_fx.codecs import Encoded
from flashcodec_fx.ops.triton_append import triton_append
from flashcodec_fx.ops.triton_attention import triton_codec_attention

REFERENCE = {op: _compat.custom_op_kernels(f"flashcodec::{op}")[None] for op in ("append", "codec_attention")}
# (capacity tokens, stored tokens): a short fill of a large static cache, and a nearly full one
SIZES = {"cuda": [(65536 + 8192, 1000), (131072, 4093), (131072, 131072 - 5)], "cpu": [(2048, 100), (256, 253)]}
SHAPE = {"cuda": dict(hkv=8, group=4, d=128, dtype=torch.bfloat16), "cpu": dict(hkv=2, group=2, d=16, dtype=torch.float32)}
TOL = {torch.float32: 2e-5, torch.bfloat16: 2.5e-2}
CASES = [(device, *size) for device in DEVICES for size in SIZES[device]]


def _filled(c, device, capacity, length, hkv, d, dtype, seed, fill):
    r = c.block_size
    data, scale, index = c.empty_state((1, hkv), capacity // r, d, dtype, device)
    state = [data, scale, index, torch.zeros(1, hkv, r, d, dtype=dtype, device=device),
             torch.zeros((), dtype=torch.int64, device=device)]
    x = smooth(1, hkv, length, d, dtype, "cpu", seed).to(device)
    fill(*state, x, c.spec)
    return state


@pytest.mark.parametrize(("device", "capacity", "length"), CASES, ids=[f"{c[0]}-cap{c[1]}-L{c[2]}" for c in CASES])
def test_long_static_cache(device, capacity, length):
    shape = SHAPE[device]
    hkv, g, d, dtype = shape["hkv"], shape["group"], shape["d"], shape["dtype"]
    ck, cv = codec("jpeg_k2_int8"), codec("jpeg_k8_int8")
    ks = _filled(ck, device, capacity, length, hkv, d, dtype, 1, triton_append)
    vs = _filled(cv, device, capacity, length, hkv, d, dtype, 2, triton_append)
    # the Triton fill stores what the reference fill stores (int8: one code step at a rounding tie)
    for c, got, seed in ((ck, ks, 1), (cv, vs, 2)):
        want = _filled(c, device, capacity, length, hkv, d, dtype, seed, REFERENCE["append"])
        assert int(got[4]) == int(want[4]) == length
        step = float(want[1].amax())
        torch.testing.assert_close(c.stored_rows(Encoded(*got[:3])), c.stored_rows(Encoded(*want[:3])),
                                   atol=step + TOL[dtype], rtol=TOL[dtype])
        assert torch.equal(got[3], want[3])
    gen = torch.Generator().manual_seed(length)
    q = torch.randn(1, hkv * g, 1, d, generator=gen).to(dtype).to(device)
    mask = (torch.arange(capacity, device=device) < length).view(1, 1, 1, capacity)
    args = (q, *ks[:4], *vs[:4], ks[4], ck.spec, cv.spec, mask)
    want = REFERENCE["codec_attention"](*args)
    got = triton_codec_attention(*args)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
