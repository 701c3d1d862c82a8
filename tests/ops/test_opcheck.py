"""`torch.library.opcheck` on every flashcodec op, and fake kernels that match the real outputs."""

from __future__ import annotations

import pytest
import torch
from codec_tiers import tier_table
from torch._subclasses.fake_tensor import FakeTensorMode

ops = torch.ops.flashcodec
R = 4
TIERS = tier_table(R, low_keep=2)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def stream_state(codec, dtype, b=2, h=2, nb=3, d=8, length=7, seed=0):
    """A filled state: ``length`` tokens appended into ``nb`` blocks; returns (data, scale, index, tail, length)."""
    gen = torch.Generator().manual_seed(seed)
    data, scale, index = codec.empty_state((b, h), nb, d, dtype, "cpu")
    tail = torch.zeros(b, h, R, d, dtype=dtype)
    n = torch.zeros((), dtype=torch.int64)
    ops.append(data, scale, index, tail, n, torch.randn(b, h, length, d, generator=gen).to(dtype), codec.spec)
    return data, scale, index, tail, n


# opcheck costs seconds per call (it traces with AOTAutograd), so the cases cover every tier, dtype, GQA group and
# mask kind without taking their full product.
ROTATION = [(tier, DTYPES[i % 3]) for i, tier in enumerate(TIERS)] + [("jpeg", torch.float16), ("jpeg", torch.bfloat16)]


@pytest.mark.parametrize(("tier", "dtype"), ROTATION)
def test_opcheck_encode_decode_read(tier, dtype):
    codec = TIERS[tier]
    x = torch.randn(2, 3, 3 * R, 8).to(dtype)
    torch.library.opcheck(ops.encode.default, (x, codec.spec))
    data, scale, index = ops.encode(x, codec.spec)
    torch.library.opcheck(ops.decode.default, (data, scale, index, codec.spec, dtype))
    torch.library.opcheck(ops.read.default, (*stream_state(codec, dtype), codec.spec))


@pytest.mark.parametrize("memo", [False, True])
@pytest.mark.parametrize(("tier", "dtype"), ROTATION)
def test_opcheck_append(tier, dtype, memo):
    codec = TIERS[tier]
    data, scale, index, tail, n = stream_state(codec, dtype, nb=5, length=6)
    new = torch.randn(2, 2, 7, 8).to(dtype)
    buf = torch.zeros(2, 2, 5 * R, 8, dtype=dtype) if memo else None
    torch.library.opcheck(ops.append.default, (data, scale, index, tail, n, new, codec.spec, buf))


@pytest.mark.parametrize(("k_tier", "v_tier", "dtype", "groups", "mask"), [
    ("jpeg-int8", "png", torch.float32, 1, None),
    ("jpeg-k2", "png-half", torch.float16, 2, "bool"),
    ("jpeg", "jpeg", torch.bfloat16, 4, "additive"),
    ("png", "jpeg-int8", torch.bfloat16, 2, None),
    ("jpeg", "png", torch.float32, 4, "bool"),
    ("jpeg-int8", "jpeg-int8", torch.float16, 1, "additive"),
    ("png-half", "jpeg-k2", torch.float32, 8, "additive"),
])
def test_opcheck_codec_attention(k_tier, v_tier, dtype, groups, mask):
    ck, cv = TIERS[k_tier], TIERS[v_tier]
    k = stream_state(ck, dtype, seed=1)
    v = stream_state(cv, dtype, seed=2)
    t = 2
    q = torch.randn(2, 2 * groups, t, 8).to(dtype)
    if mask == "bool":
        m = torch.rand(2, 1, t, 3 * R) > 0.3
        m[..., 0] = True
    elif mask == "additive":
        m = (torch.rand(1, 2 * groups, t, 3 * R) - 0.5).to(dtype)
    else:
        m = None
    args = (q, *k[:4], *v[:4], k[4], ck.spec, cv.spec, m)
    torch.library.opcheck(ops.codec_attention.default, args if groups % 2 else (*args, 0.25))


def assert_like(fake, real):
    assert fake.shape == real.shape and fake.dtype == real.dtype and fake.stride() == real.stride(), (fake, real)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tier", list(TIERS))
def test_fake_kernels_match_real_outputs(tier, dtype):
    codec = TIERS[tier]
    x = torch.randn(1, 2, 2 * R, 8).to(dtype)
    state = stream_state(codec, dtype)
    q = torch.randn(2, 4, 1, 8).to(dtype)
    real = {
        "encode": ops.encode(x, codec.spec),
        "decode": ops.decode(*state[:3], codec.spec, dtype),
        "read": ops.read(*state, codec.spec),
        "attention": ops.codec_attention(q, *state[:4], *state[:4], state[4], codec.spec, codec.spec),
    }
    mode = FakeTensorMode()
    with mode:
        fx, fstate, fq = mode.from_tensor(x), [mode.from_tensor(t) for t in state], mode.from_tensor(q)
        fake = {
            "encode": ops.encode(fx, codec.spec),
            "decode": ops.decode(*fstate[:3], codec.spec, dtype),
            "read": ops.read(*fstate, codec.spec),
            "attention": ops.codec_attention(fq, *fstate[:4], *fstate[:4], fstate[4], codec.spec, codec.spec),
        }
    for name, want in real.items():
        got = fake[name]
        for g, w in zip(*((got, want) if isinstance(want, tuple) else ((got,), (want,))), strict=True):
            assert_like(g, w)
    assert real["decode"].dtype == dtype and real["read"].dtype == dtype and real["attention"].dtype == dtype
