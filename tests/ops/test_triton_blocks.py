"""Triton encode / decode / read against the plain-torch reference (CPU interpreter, and CUDA when present)."""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICES, TIERS, codec, dtypes, smooth, stored_state, to

from flashcodec_fx.codecs import Encoded
from flashcodec_fx.ops.triton_blocks import triton_decode, triton_encode, triton_read

CASES = [(device, tier, dtype) for device in DEVICES for tier in TIERS for dtype in dtypes(device)]


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32: the kernels' DCT sums run in another order than torch's matmul (a few ulp of fp32);
    # 16-bit outputs: one rounding step of the output dtype.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(actual.cpu().float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("device", "tier", "dtype"), CASES)
def test_encode_matches_reference(device, tier, dtype):
    c = codec(tier)
    x = smooth(2, 1, 3 * c.block_size, 16, dtype, "cpu", seed=1)
    got = Encoded(*(t.cpu() for t in triton_encode(*to(device, x), c.spec)))
    want = Encoded(*torch.ops.flashcodec.encode(x, c.spec))
    assert [(t.dtype, t.shape) for t in got] == [(t.dtype, t.shape) for t in want]
    if c.index_rows and dtype != torch.float32:
        # 16-bit deltas tie in magnitude; a tie may keep another position (same magnitude) than torch.topk.
        torch.testing.assert_close(got.data[..., 1:, :].abs().sort(-2).values, want.data[..., 1:, :].abs().sort(-2).values,
                                   atol=0, rtol=0)
        return
    if c.quant_bits:
        # int8 codes: a coefficient within an fp32 rounding of a half-step may round the other way (one step).
        steps = (got.data.int() - want.data.int()).abs()
        assert steps.max() <= 1 and steps.float().mean() < 0.01
        torch.testing.assert_close(got.scale, want.scale, atol=1e-6, rtol=1e-5)  # amax of fp32 sums: ulps
        return
    # jpeg coefficients: fp32 sum order (ulps), then rounded to the stream dtype; png deltas: same fp32 ops, exact.
    tol = 0 if c.mode == 1 else {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(c.stored_rows(got), c.stored_rows(want), atol=tol, rtol=tol)


@pytest.mark.parametrize(("device", "tier", "dtype"), CASES)
def test_decode_and_read_match_reference(device, tier, dtype):
    c = codec(tier)
    r = c.block_size
    x = smooth(2, 1, 3 * r + 3, 16, dtype, "cpu", seed=2)
    state = stored_state(c, x, capacity_blocks=5)  # static capacity beyond the length; length not a multiple of r
    got = triton_decode(*to(device, *state[:3]), c.spec, dtype)
    _close(got, torch.ops.flashcodec.decode(*state[:3], c.spec, dtype), dtype)
    got = triton_read(*to(device, *state), c.spec)
    want = torch.ops.flashcodec.read(*state, c.spec)
    _close(got, want, dtype)
    assert got[:, :, 3 * r + 3:].abs().max() == 0  # nothing past the length


@pytest.mark.parametrize("device", DEVICES)
def test_png_decode_is_exact(device):
    # The lossless tier: 16-bit tokens come back bit-exact (deltas of fp16 values are exact in fp32).
    c = codec("png")
    x = smooth(1, 2, 2 * c.block_size, 16, torch.float16, "cpu", seed=3)
    data, scale, index = triton_encode(*to(device, x), c.spec)
    assert torch.equal(triton_decode(data, scale, index, c.spec, torch.float16).cpu(), x)


@pytest.mark.parametrize("device", DEVICES)
def test_launchers_validate_like_the_reference(device):
    c = codec("jpeg_k2_int8")
    x = smooth(1, 1, 2 * c.block_size, 16, torch.float32, device, seed=0)
    with pytest.raises(ValueError, match="multiple of block_size"):
        triton_encode(x[:, :, 1:], c.spec)
    with pytest.raises(ValueError, match="spec"):
        triton_encode(x, [7, 8, 8, 0])
    data, scale, index = triton_encode(x, c.spec)
    with pytest.raises(ValueError, match="state_scale"):
        triton_decode(data, scale[..., :1], index, c.spec, torch.float32)
    with pytest.raises(ValueError, match="length"):
        triton_read(data, scale, index, x[:, :, : c.block_size], torch.zeros(1, dtype=torch.int64, device=device), c.spec)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["jpeg_k8_int8", "png_pruned"])
def test_encode_takes_any_strides(device, tier):
    """x with head_dim not innermost (a transposed buffer) and with a channel stride of 2 (a slice): encoded as
    its contiguous copy is."""
    c = codec(tier)
    x = smooth(2, 1, 2 * c.block_size, 16, torch.float32, "cpu", seed=7)
    for view in (x.transpose(2, 3).contiguous().transpose(2, 3), torch.stack([x, -x], -1).flatten(-2)[..., ::2]):
        assert view.stride(3) != 1 and torch.equal(view, x)
        got = triton_encode(*to(device, view), c.spec)
        want = triton_encode(*to(device, x), c.spec)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_launchers_name_the_triton_limits(device):
    """Shapes past the Triton path's register tiles fail with a ValueError naming the limit, before any work."""
    from flashcodec_fx.codecs import make_codec
    from flashcodec_fx.ops.triton_append import triton_append
    from flashcodec_fx.ops.triton_common import MAX_BLOCK_SIZE, MAX_HEAD_DIM, MAX_PRUNED_BLOCK_SIZE

    pruned = make_codec("png", block_size=2 * MAX_PRUNED_BLOCK_SIZE, keep_ratio=0.5)
    wide = make_codec("jpeg", block_size=2 * MAX_BLOCK_SIZE, keep_freqs=4)
    x = torch.zeros(1, 1, 2 * MAX_BLOCK_SIZE, 16, device=device)
    with pytest.raises(ValueError, match=f"keep_ratio < 1\\) with block_size <= {MAX_PRUNED_BLOCK_SIZE}"):
        triton_encode(x, pruned.spec)
    with pytest.raises(ValueError, match=f"block_size <= {MAX_BLOCK_SIZE}"):
        triton_encode(x, wide.spec)
    with pytest.raises(ValueError, match=f"head_dim <= {MAX_HEAD_DIM}"):
        triton_encode(torch.zeros(1, 1, 8, 2 * MAX_HEAD_DIM, device=device), codec("jpeg_k8").spec)
    state = [t.to(device) for t in stored_state(pruned, x.cpu()[:, :, :3], 2)]
    with pytest.raises(ValueError, match="block_size <= 16"):
        triton_read(*state, pruned.spec)
    before = [t.clone() for t in state]
    with pytest.raises(ValueError, match="block_size <= 16"):
        triton_append(*state, x[:, :, :1], pruned.spec)
    assert all(torch.equal(a, b) for a, b in zip(before, state, strict=True))  # nothing changed
