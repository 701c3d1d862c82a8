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



def _overflow(c, device, batch: int, guard: bool):
    """Two appends into a ``batch x 1`` head static archive of 2 blocks, the second past the capacity. With
    ``guard`` the state tensors are views of buffers one block longer, filled with a sentinel."""
    r, blocks, d = c.block_size, 2, 16
    extra = 1 if guard else 0
    bufs = list(c.empty_state((batch, 1), blocks + extra, d, torch.float32, device))
    bufs.append(torch.zeros(batch, 1, (blocks + extra) * r, d, device=device))
    for t in bufs:
        t.fill_(7)
    state = [t[:, :, :blocks] for t in bufs[:3]] + [bufs[3][:, :, : blocks * r]]
    for t in state:
        t.zero_()
    guard_before = [t[:, :, s.shape[2]:].clone() for t, s in zip(bufs, state, strict=True)]
    data, scale, index, memo = state
    tail = torch.zeros(batch, 1, r, d, device=device)
    length = torch.zeros((), dtype=torch.int64, device=device)
    got = [data, scale, index, tail, length, memo]
    want = _fresh(c, torch.float32, "cpu", blocks, True) if batch == 2 else None
    if want is None:
        want = [t[:1] if t.dim() else t for t in _fresh(c, torch.float32, "cpu", blocks, True)]
    x = smooth(batch, 1, 2 * blocks * r + 5, d, torch.float32, "cpu", seed=6)
    for lo, hi in ((0, blocks * r - 3), (blocks * r - 3, x.shape[2])):
        triton_append(*got[:5], *to(device, x[:, :, lo:hi]), c.spec, got[5])
        torch.ops.flashcodec.append(*want[:5], x[:, :, lo:hi], c.spec, want[5])
    guard_after = [t[:, :, s.shape[2]:] for t, s in zip(bufs, state, strict=True)]
    return got, want, guard_before, guard_after, x.shape[2]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["jpeg_k8_int8", "png_pruned", "png_r4"])
@pytest.mark.parametrize("batch", [1, 2])
def test_overflow_writes_nothing_past_capacity(device, tier, batch):
    """Appending past a static capacity (a compiled step skips the host check): no store lands past the buffers
    (batch 1: a sentinel block after each) or in the next head's blocks (batch 2: the reference agrees), the
    reference writes nothing out of range either, and the length records the overflow."""
    c = codec(tier)
    got, want, guard_before, guard_after, total = _overflow(c, device, batch, guard=batch == 1)
    assert int(got[4]) == int(want[4]) == total > 2 * c.block_size  # the overflow is recorded in the length
    rows_got = c.stored_rows(Encoded(*(t.cpu() for t in got[:3])))
    rows_want = c.stored_rows(Encoded(*want[:3]))
    step = float(want[1].amax()) if c.quant_bits else 0.0
    torch.testing.assert_close(rows_got, rows_want, atol=1e-5 + step, rtol=1e-5)
    torch.testing.assert_close(got[5].cpu(), want[5], atol=1e-5 + step, rtol=1e-5)
    assert torch.equal(got[3].cpu(), want[3])
    for before, after in zip(guard_before, guard_after, strict=True):
        assert torch.equal(after, before)
