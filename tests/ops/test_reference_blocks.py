"""`flashcodec::encode` / `flashcodec::decode` reference ops: agree with the codecs, validate their inputs, and decode
is differentiable for the plain (linear, unquantized) codecs."""

from __future__ import annotations

import math

import pytest
import torch
from codec_tiers import kv_like, tier_table

import flashcodec_fx.ops  # noqa: F401  (defines torch.ops.flashcodec)
from flashcodec_fx.codecs import Encoded, make_codec

ops = torch.ops.flashcodec
R = 8
TIERS = tier_table(R, low_keep=3)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def mean_for(codec, x: torch.Tensor) -> torch.Tensor | None:
    return x.float().mean(2) if codec.center else None


def stored(codec, x: torch.Tensor, mean=None):
    """The codec's stored form, made contiguous (what ``flashcodec::encode`` returns)."""
    return Encoded(*(t.contiguous() for t in codec.encode(x, mean)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tier", list(TIERS))
def test_ops_match_codec(tier, dtype):
    codec = TIERS[tier]
    x = kv_like((2, 3, 2 * max(16, codec.group), 16), dtype, seed=1)
    mean = mean_for(codec, x)
    enc = ops.encode(x, codec.spec, mean)
    ref = codec.encode(x, mean)
    for got, want in zip(enc, ref, strict=True):
        assert torch.equal(got, want) and got.dtype == want.dtype and got.is_contiguous()
    out = ops.decode(*enc, codec.spec, dtype, mean)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out, codec.decode(ref, dtype, mean))
    if tier == "jpeg":  # K = r: the round trip gives the tokens back up to rounding
        torch.testing.assert_close(out.float(), x.float(), atol={torch.float32: 1e-5}.get(dtype, 0.1), rtol=0)
    if tier in ("png", "jpeg-int8", "jpeg-table"):  # a different output dtype than the stream's
        assert torch.equal(ops.decode(*enc, codec.spec, torch.float32, mean), codec.decode(ref, torch.float32, mean))


def test_encode_rejects_partial_groups_bad_rank_dtype_and_mean():
    spec = TIERS["jpeg-table"].spec  # groups of 16 tokens
    with pytest.raises(ValueError, match="multiple of the group"):
        ops.encode(torch.randn(1, 1, 24, 8), spec)
    with pytest.raises(ValueError, match="x must be"):
        ops.encode(torch.randn(1, 32, 8), spec)
    with pytest.raises(TypeError, match="floating"):
        ops.encode(torch.ones(1, 1, 16, 8, dtype=torch.int32), spec)
    centered = TIERS["token-lloyd2"].spec
    for mean in (torch.zeros(1, 1, 4), torch.zeros(1, 1, 8, dtype=torch.float16)):
        with pytest.raises(ValueError, match="mean must be"):
            ops.encode(torch.randn(1, 1, 4, 8), centered, mean)
    with pytest.raises(ValueError, match="multiple of"):
        ops.encode(torch.randn(1, 1, 16, 13), spec)


def test_decode_rejects_a_stored_form_of_another_codec():
    enc = ops.encode(torch.randn(1, 1, 16, 8), TIERS["jpeg-k3"].spec)
    with pytest.raises(ValueError, match="archive.data"):
        ops.decode(*enc, TIERS["jpeg"].spec, torch.float32)
    enc = ops.encode(torch.randn(1, 1, 16, 8), TIERS["jpeg-table"].spec)
    with pytest.raises(ValueError, match="archive.scale"):
        ops.decode(enc[0], enc[1][..., :1, :], enc[2], enc[3], TIERS["jpeg-table"].spec, torch.float32)
    with pytest.raises(ValueError, match="archive.zero"):
        ops.decode(enc[0], enc[1], enc[2].float(), enc[3], TIERS["jpeg-table"].spec, torch.float32)
    with pytest.raises(ValueError, match="mean must be"):
        ops.decode(*enc, TIERS["jpeg-table"].spec, torch.float32, torch.zeros(1, 1, 8))  # not a centered codec


def dct_fp64(r: int) -> torch.Tensor:
    """Orthonormal DCT-II analysis matrix computed here in fp64, independently of the package."""
    n = torch.arange(r, dtype=torch.float64)
    m = torch.cos(math.pi / r * (n[None] + 0.5) * n[:, None]) * math.sqrt(2.0 / r)
    m[0] /= math.sqrt(2.0)
    return m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("mode", "keep"), [("jpeg", 8), ("jpeg", 3), ("png", None)])
def test_decode_gradient_is_synthesis_transpose(dtype, mode, keep):
    """grad of decode w.r.t. the stored rows is ``A^T @ grad`` per block, A computed here in fp64."""
    codec = make_codec("jpeg", block_size=8, keep_freqs=keep) if mode == "jpeg" else make_codec("png", block_size=8)
    data, scale, zero, index = stored(codec, torch.randn(2, 2, 32, 8).to(dtype))
    data = data.detach().requires_grad_(True)
    out = ops.decode(data, scale, zero, index, codec.spec, dtype)
    upstream = torch.randn(out.shape).to(dtype)
    (grad,) = torch.autograd.grad(out, data, upstream)
    assert grad.dtype == data.dtype and grad.shape == data.shape
    synth = dct_fp64(8)[:keep].T if mode == "jpeg" else torch.tril(torch.ones(8, 8, dtype=torch.float64))
    expected = synth.T @ upstream.double().unflatten(2, (4, 8))
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[data.dtype]
    torch.testing.assert_close(grad.double(), expected, atol=tol * 8, rtol=tol)


@pytest.mark.parametrize("codec", [make_codec("jpeg", block_size=4, keep_freqs=3), make_codec("png", block_size=4),
                                   make_codec("jpeg", block_size=1, sinks=2, window=3)], ids=["jpeg", "png", "jpeg-r1"])
@pytest.mark.filterwarnings("ignore:Input #0 requires gradient and is not a double")
def test_decode_gradcheck_fp32(codec):
    """The ops compute in fp32 (a float64 input is computed in fp32 too), so gradcheck runs on fp32 inputs with a
    large finite-difference step; decode is linear, so the step adds no truncation error."""
    data, scale, zero, index = stored(codec, torch.randn(1, 2, 8, 3))
    data = data.detach().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: ops.decode(t, scale, zero, index, codec.spec, torch.float32), (data,),
                                    eps=1e-2, atol=1e-3, rtol=1e-3, fast_mode=False)


@pytest.mark.parametrize("tier", ["png-half", "jpeg-rotated", "jpeg-centered"])
def test_decode_backward_refuses_codecs_that_are_not_plain(tier):
    codec = TIERS.get(tier) or {"jpeg-rotated": make_codec("jpeg", block_size=8, rotate=True),
                                "jpeg-centered": make_codec("jpeg", block_size=8, center=True)}[tier]
    x = torch.randn(1, 1, 8, 8)
    mean = mean_for(codec, x)
    data, scale, zero, index = stored(codec, x, mean)
    out = ops.decode(data.requires_grad_(True), scale, zero, index, codec.spec, torch.float32, mean)
    with pytest.raises(RuntimeError, match="differentiable only"):
        out.sum().backward()
