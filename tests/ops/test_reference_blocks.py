"""`flashcodec::encode` / `flashcodec::decode` reference ops: agree with the codecs, and decode is differentiable."""

from __future__ import annotations

import math

import pytest
import torch

from flashcodec_fx.codecs import make_codec

ops = torch.ops.flashcodec

CODECS = {
    "jpeg": make_codec("jpeg", block_size=8),
    "jpeg-k3": make_codec("jpeg", block_size=8, keep_freqs=3),
    "jpeg-int8": make_codec("jpeg", block_size=8, quant_bits=8),
    "png": make_codec("png", block_size=8),
    "png-half": make_codec("png", block_size=8, keep_ratio=0.5),
}


def dct_fp64(r: int) -> torch.Tensor:
    """Orthonormal DCT-II analysis matrix computed here in fp64, independently of the package."""
    n = torch.arange(r, dtype=torch.float64)
    m = torch.cos(math.pi / r * (n[None] + 0.5) * n[:, None]) * math.sqrt(2.0 / r)
    m[0] /= math.sqrt(2.0)
    return m


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ops_match_codec(name, dtype):
    codec = CODECS[name]
    x = torch.randn(2, 3, 24, 16).to(dtype)
    data, scale, index = ops.encode(x, codec.spec)
    ref = codec.encode(x)
    for got, want in zip((data, scale, index), ref, strict=True):
        assert torch.equal(got, want) and got.dtype == want.dtype and got.is_contiguous()
    out = ops.decode(data, scale, index, codec.spec, dtype)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, codec.decode(ref, dtype))


def test_encode_rejects_partial_blocks_and_bad_rank():
    spec = CODECS["jpeg"].spec
    with pytest.raises(ValueError, match="block_size"):
        ops.encode(torch.randn(1, 1, 12, 4), spec)
    with pytest.raises(ValueError, match="x must be"):
        ops.encode(torch.randn(1, 16, 4), spec)


def test_decode_rejects_state_of_another_codec():
    data, scale, index = ops.encode(torch.randn(1, 1, 16, 4), CODECS["jpeg-k3"].spec)
    with pytest.raises(ValueError, match="state_data"):
        ops.decode(data, scale, index, CODECS["jpeg"].spec, torch.float32)
    data, scale, index = ops.encode(torch.randn(1, 1, 16, 4), CODECS["jpeg"].spec)
    with pytest.raises(ValueError, match="state_scale"):
        ops.decode(data, scale, index, [0, 8, 8, 8], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("mode", "keep"), [("jpeg", 8), ("jpeg", 3), ("png", None)])
def test_decode_gradient_is_synthesis_transpose(dtype, mode, keep):
    """grad of decode w.r.t. the stored rows is ``A^T @ grad`` per block, A computed here in fp64."""
    codec = make_codec("jpeg", block_size=8, keep_freqs=keep) if mode == "jpeg" else make_codec("png", block_size=8)
    data, scale, index = ops.encode(torch.randn(2, 2, 32, 8).to(dtype), codec.spec)
    data = data.detach().requires_grad_(True)
    out = ops.decode(data, scale, index, codec.spec, dtype)
    upstream = torch.randn(out.shape).to(dtype)
    (grad,) = torch.autograd.grad(out, data, upstream)
    assert grad.dtype == data.dtype and grad.shape == data.shape
    synth = dct_fp64(8)[:keep].T if mode == "jpeg" else torch.tril(torch.ones(8, 8, dtype=torch.float64))
    expected = synth.T @ upstream.double().unflatten(2, (4, 8))
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[data.dtype]
    torch.testing.assert_close(grad.double(), expected, atol=tol * 8, rtol=tol)


@pytest.mark.parametrize("codec", [make_codec("jpeg", block_size=4, keep_freqs=3), make_codec("png", block_size=4)],
                         ids=["jpeg", "png"])
@pytest.mark.filterwarnings("ignore:Input #0 requires gradient and is not a double")
def test_decode_gradcheck_fp32(codec):
    """The ops compute in fp32 (a float64 input is computed in fp32 too), so gradcheck runs on fp32 inputs with a
    large finite-difference step; decode is linear, so the step adds no truncation error."""
    data, scale, index = ops.encode(torch.randn(1, 2, 8, 3), codec.spec)
    data = data.detach().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: ops.decode(t, scale, index, codec.spec, torch.float32), (data,),
                                    eps=1e-2, atol=1e-3, rtol=1e-3, fast_mode=False)


@pytest.mark.parametrize("name", ["png-half"])
def test_decode_backward_refuses_pruned_codecs(name):
    codec = CODECS[name]
    data, scale, index = ops.encode(torch.randn(1, 1, 8, 4), codec.spec)
    out = ops.decode(data.requires_grad_(True), scale, index, codec.spec, torch.float32)
    with pytest.raises(RuntimeError, match="differentiable only"):
        out.sum().backward()
