"""Triton encode / decode against the plain-torch reference ops, on every stored form.

Tolerances: **encode** is the append's group encode, bounded as the append test bounds a stored form
(:func:`same_archive`: quantized codes and scales equal in >= 99% of places, a code one step off at an fp32 rounding
tie, every dense stored row within one quantization step; float jpeg coefficients within a rounding of the stream
dtype, png deltas exactly, pruned png as sorted magnitudes). **decode** of a given stored form (the reference's
encode) is fp32 arithmetic in another order, rounded once to the output dtype: within ``atol=1e-5`` (fp32 sums of
unit-scale values over a rotation's 64 channels, where the result cancels to near zero) and one rounding of that
dtype (``rtol`` 1e-5 fp32, 1e-3 fp16, 8e-3 bf16) of the reference.
"""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICES, FORMS, TRELLIS_FORMS, dtypes, form, same_archive, smooth, to

from flashcodec_fx.codecs import make_codec
from flashcodec_fx.ops.reference.blocks import decode_reference, encode_reference
from flashcodec_fx.ops.triton.blocks import triton_decode, triton_encode
from flashcodec_fx.ops.triton.common import MAX_GROUP_TOKENS, MAX_HEAD_DIM

# every form in fp32; 16-bit dtypes (bf16 on CUDA) on one form per kind of stored form: float jpeg, pruned png,
# token-axis codes, channel-axis codes with the rotation and the clipping search
HALF = ("jpeg_k8", "png_pruned", "int8", "dct_channel")
CASES = [(device, name, dtype) for device in DEVICES for name in FORMS for dtype in dtypes(device)
         if dtype == torch.float32 or name in HALF]
ROUNDING = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # one rounding of the output dtype


def _ids(cases) -> list[str]:
    return [f"{device}-{name}-{str(dtype)[6:]}" for device, name, dtype in cases]


def mean_for(codec, x: torch.Tensor) -> torch.Tensor | None:
    return x.float().mean(2) if codec.center else None


def _on(device: str, t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _check_decode(codec, enc, dtype, mean, device) -> None:
    """The Triton decode of ``enc`` (CPU tensors) on ``device`` against the reference's."""
    got = triton_decode(*to(device, *enc), codec.spec, dtype, _on(device, mean))
    want = decode_reference(*enc, codec.spec, dtype, mean)
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-5, rtol=ROUNDING[dtype])


def _fp32_round_trip(codec, d: int, seed: int, device: str) -> tuple:
    """Two groups of a smooth fp32 stream (batch 1, 2 heads, head_dim ``d``): the Triton encode within
    :func:`same_archive` of the reference's, the Triton decode of the reference's codes within the decode tolerance;
    returns (the reference's stored groups, the mean)."""
    x = smooth(1, 2, 2 * codec.group, d, torch.float32, "cpu", seed=seed)
    mean = mean_for(codec, x)
    got = triton_encode(x.to(device), codec.spec, _on(device, mean))
    want = encode_reference(x, codec.spec, mean)
    same_archive(codec, [t.cpu() for t in got], want, d, torch.float32)
    _check_decode(codec, want, torch.float32, mean, device)
    return want, mean


@pytest.mark.parametrize(("device", "name", "dtype"), CASES, ids=_ids(CASES))
def test_encode_and_decode_match_reference(device, name, dtype):
    """Two groups per head, batch 2, 2 heads, head_dim 16 (the stream's mean where the codec centers)."""
    codec = form(name)
    x = smooth(2, 2, 2 * codec.group, 16, dtype, "cpu", seed=3)
    mean = mean_for(codec, x)
    got = triton_encode(x.to(device), codec.spec, _on(device, mean))
    want = encode_reference(x, codec.spec, mean)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous()
    same_archive(codec, [t.cpu() for t in got], want, 16, dtype)
    _check_decode(codec, want, dtype, mean, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["dct_channel", "lloyd_rot", "png_pruned", "jpeg_k3"])
def test_head_dim_in_channel_chunks(device, name):
    """head_dim 64: per-channel forms run two programs of 32 channels per group (the rotation summed over every
    input chunk), token-axis codes one program over head_dim; another output dtype than the stream's."""
    codec = form(name)
    want, mean = _fp32_round_trip(codec, 64, 5, device)
    if codec.quantizer is not None:
        _check_decode(codec, want, torch.float16, mean, device)


@pytest.mark.parametrize("device", DEVICES)
def test_any_layout_and_an_uncentered_call(device):
    """x of any strides encodes as its contiguous copy does (bit for bit); a non-contiguous archive (a slice of its
    groups) decodes as its contiguous copy; a centering codec called without a mean neither subtracts nor adds one,
    as the reference."""
    codec = form("lloyd_rot")
    x = smooth(2, 2, 3 * codec.group, 16, torch.float32, "cpu", seed=7).to(device)
    strided = x.transpose(2, 3).contiguous().transpose(2, 3)
    assert strided.stride(2) == 1
    dense = triton_encode(x, codec.spec)
    for a, b in zip(dense, triton_encode(strided, codec.spec), strict=True):
        assert torch.equal(a, b)
    same_archive(codec, [t.cpu() for t in dense], encode_reference(x.cpu(), codec.spec), 16, torch.float32)
    sliced = [t[:, :, 1:] for t in dense]
    assert not sliced[0].is_contiguous()
    assert torch.equal(triton_decode(*sliced, codec.spec, torch.float32),
                       triton_decode(*(t.contiguous() for t in sliced), codec.spec, torch.float32))
    _check_decode(codec, [t.cpu() for t in sliced], torch.float32, None, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(TRELLIS_FORMS))
def test_trellis_encode_and_decode_match_reference(device, name):
    """Trellis codes (levels="tcq"): the encode within the bounds above (bit for bit where its rows are the
    reference's: tests/ops/test_triton_append.py::test_trellis_encoder_is_the_reference_bit_for_bit), the decode of
    the reference's codes within the decode tolerance; batch 1 (the interpreter runs the Viterbi search slowly)."""
    _fp32_round_trip(form(name), 16, 3, device)


@pytest.mark.parametrize("device", DEVICES)
def test_validation_limits_and_empty_inputs(device):
    """Bad input raises like the reference (the launchers run its checks); the Triton limits are named; no groups
    (or no heads) give empty outputs shaped like the reference's."""
    codec = form("int8")
    x = torch.zeros(1, 2, 16, 16, device=device)
    with pytest.raises(ValueError, match="multiple of the group"):
        triton_encode(x[:, :, :12], codec.spec)
    with pytest.raises(ValueError, match="mean must be"):
        triton_encode(x, form("lloyd_rot").spec, torch.zeros(1, 2, 8, device=device))
    enc = triton_encode(x, codec.spec)
    with pytest.raises(ValueError, match="archive.scale must be"):
        triton_decode(enc[0], enc[1][..., :1], *enc[2:], codec.spec, torch.float32)
    with pytest.raises(ValueError, match="spec: "):
        triton_decode(*enc, "jpeg;bad", torch.float32)
    wide = make_codec("jpeg", block_size=8, quant_bits=4, scale_axis="channel", group=2 * MAX_GROUP_TOKENS)
    with pytest.raises(ValueError, match=f"groups of <= {MAX_GROUP_TOKENS} tokens"):
        triton_encode(torch.zeros(1, 1, wide.group, 16, device=device), wide.spec)
    with pytest.raises(ValueError, match=f"head_dim <= {MAX_HEAD_DIM}"):
        triton_encode(torch.zeros(1, 1, 8, 2 * MAX_HEAD_DIM, device=device), codec.spec)
    for empty in (x[:, :, :0], x[:, :0]):
        got, want = triton_encode(empty, codec.spec), encode_reference(empty.cpu(), codec.spec)
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
        assert triton_decode(*got, codec.spec, torch.float16).shape == (*empty.shape[:3], 16)
