"""Triton append against the plain-torch reference: state, tail, memo and length after a run of appends."""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICES, TIERS, codec, dtypes, smooth, to

from flashcodec_fx.codecs import Encoded
from flashcodec_fx.ops.triton_append import triton_append

# every tier in fp32; the 16-bit dtypes on one tier per storage kind (the interpreter is slow).
HALF = ("jpeg_k8", "jpeg_k8_int8", "png", "png_pruned")
CASES = [(device, tier, dtype) for device in DEVICES for tier in TIERS for dtype in dtypes(device)
         if dtype == torch.float32 or tier in HALF or device == "cuda"]
STEPS = (5, 12, 1)  # a partial block, several blocks completed in one append with an open block, a single token


def _fresh(c, dtype, device, blocks, memo):
    data, scale, index = c.empty_state((2, 1), blocks, 16, dtype, device)
    tail = torch.zeros(2, 1, c.block_size, 16, dtype=dtype, device=device)
    length = torch.zeros((), dtype=torch.int64, device=device)
    return [data, scale, index, tail, length, torch.zeros(2, 1, blocks * c.block_size, 16, dtype=dtype, device=device)
            if memo else None]


@pytest.mark.parametrize(("device", "tier", "dtype"), CASES)
def test_append_matches_reference(device, tier, dtype):
    c = codec(tier)
    blocks = -(-sum(STEPS) // c.block_size) + 1  # static capacity beyond the final length
    x = smooth(2, 1, sum(STEPS), 16, dtype, "cpu", seed=4)
    got, want = _fresh(c, dtype, device, blocks, True), _fresh(c, dtype, "cpu", blocks, True)
    pos = 0
    for t in STEPS:
        triton_append(*got[:5], *to(device, x[:, :, pos: pos + t]), c.spec, got[5])
        torch.ops.flashcodec.append(*want[:5], x[:, :, pos: pos + t], c.spec, want[5])
        pos += t
    got = [t.cpu() for t in got]
    assert int(got[4]) == int(want[4]) == sum(STEPS)
    assert torch.equal(got[3], want[3])  # the raw tail is copied, never computed
    rows_got, rows_want = c.stored_rows(Encoded(*got[:3])), c.stored_rows(Encoded(*want[:3]))
    if c.index_rows and dtype != torch.float32:
        # 16-bit deltas tie in magnitude; a tie may keep another position than torch.topk: same magnitudes kept.
        torch.testing.assert_close(rows_got.abs().sort(-2).values, rows_want.abs().sort(-2).values, atol=0, rtol=0)
        return
    # jpeg: fp32 DCT sums in another order (ulps; int8: a code may round the other way, one quantization step);
    # png: the same fp32 subtractions as the reference, exact.
    step = want[1].amax() if c.quant_bits else 0.0
    tol = 0.0 if c.mode == 1 else {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(rows_got, rows_want, atol=tol + float(step), rtol=tol)
    # memo: decoded archived rows + raw open-block rows; one rounding of the stream dtype (plus one int8 step).
    out_tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got[5].float(), want[5].float(), atol=out_tol + float(step), rtol=out_tol)


@pytest.mark.parametrize("device", DEVICES)
def test_append_without_memo_and_validation(device):
    c = codec("jpeg_k8_int8")
    state = _fresh(c, torch.float32, device, 4, False)
    x = smooth(2, 1, 11, 16, torch.float32, device, seed=5)
    triton_append(*state[:5], x, c.spec)
    ref = _fresh(c, torch.float32, "cpu", 4, False)
    torch.ops.flashcodec.append(*ref[:5], x.cpu(), c.spec)
    assert int(state[4]) == 11 and torch.equal(state[3].cpu(), ref[3])
    before = [t.clone() for t in state[:5]]
    with pytest.raises(ValueError, match="new must be"):
        triton_append(*state[:5], x[:1], c.spec)
    with pytest.raises(ValueError, match="memo must be"):
        triton_append(*state[:5], x, c.spec, torch.zeros(1, device=device))
    assert all(torch.equal(a, b) for a, b in zip(before, state[:5], strict=True))  # nothing changed
