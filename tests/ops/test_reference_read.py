"""`flashcodec::read` (reference): sinks raw, archive decoded, tail raw, zeros past the length; the current call's
tokens exact; png lossless reads back the tokens exactly."""

from __future__ import annotations

import pytest
import torch
from _op_states import chunks, fill, new_state, uncropped_start
from codec_tiers import grid_data, kv_like, tier_table

ops = torch.ops.flashcodec
R = 8
TIERS = tier_table(R, low_keep=3)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tier", list(TIERS))
def test_view_is_sinks_raw_archive_decoded_tail_raw(tier, dtype):
    """Position by position: raw where raw, the codec's decode of the stored groups (with the stream's mean) where
    archived, zeros past the length, over the whole capacity, in the stream dtype."""
    codec = TIERS[tier]
    total = 43
    x = kv_like((2, 2, total, 16), dtype, seed=1)
    state, _ = fill(codec, x, chunks(total, seed=2, first=9), positions=total + 2 * codec.group)
    view = ops.read(state, codec.spec)
    cap = codec.sinks + state.data.shape[2] * codec.group
    assert view.shape == (2, 2, cap, 16) and view.dtype == dtype
    end = int(state.start)
    assert end == uncropped_start(codec, total)
    groups = (end - codec.sinks) // codec.group
    s = codec.sinks
    assert torch.equal(view[:, :, :s], x[:, :, :s])
    mean = state.mean if codec.center else None
    archive = codec.decode(codec.encode(x[:, :, s:end], mean), dtype, mean)
    assert groups > 0 and torch.equal(view[:, :, s:end], archive)
    assert torch.equal(view[:, :, end:total], x[:, :, end:])
    assert not view[:, :, total:].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tier", ["png", "png-window"])
def test_png_reads_back_the_tokens_exactly(tier, dtype):
    codec = TIERS[tier]
    x = grid_data((1, 2, 45, 16), dtype, seed=3)
    state, _ = fill(codec, x, chunks(45, seed=1))
    assert torch.equal(ops.read(state, codec.spec)[:, :, :45], x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jpeg_full_keep_reads_back_within_rounding(dtype):
    codec = TIERS["jpeg"]
    x = torch.randn(1, 2, 45, 16, generator=torch.Generator().manual_seed(4)).to(dtype)
    state, _ = fill(codec, x, chunks(45, seed=2))
    tol = {torch.float32: 2e-6, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dtype]  # |x| < 5: ~2 ulp of max|x|
    torch.testing.assert_close(ops.read(state, codec.spec)[:, :, :45], x, atol=tol, rtol=0)


@pytest.mark.parametrize("tier", ["jpeg-k3", "jpeg-table", "token-lloyd2", "png-half"])
def test_new_tokens_are_read_exactly(tier):
    """``read(state, spec, new)``: the last T positions hold ``new`` itself; every other position is unchanged."""
    codec = TIERS[tier]
    x = kv_like((2, 2, 40, 8), torch.float32, seed=5)
    for t in (1, 5, 17):
        state, _ = fill(codec, x, [40 - t, t], positions=48)
        plain, exact = ops.read(state, codec.spec), ops.read(state, codec.spec, x[:, :, -t:])
        assert torch.equal(exact[:, :, 40 - t: 40], x[:, :, -t:])
        assert torch.equal(exact[:, :, : 40 - t], plain[:, :, : 40 - t]) and not exact[:, :, 40:].any()
    assert not torch.equal(plain[:, :, 40 - t: 40], x[:, :, -t:])  # lossy archive: the exact read is a real change


def test_empty_state_reads_zeros():
    for codec in TIERS.values():
        state = new_state(codec, torch.zeros(1, 2, 1, 8), 20)
        view = ops.read(state, codec.spec)
        assert view.shape == (1, 2, codec.sinks + state.data.shape[2] * codec.group, 8) and not view.any()


def test_bad_new_is_rejected():
    codec = TIERS["jpeg-int8"]
    state, _ = fill(codec, torch.randn(1, 2, 10, 8), [10])
    for new in (torch.randn(1, 2, 2, 8, dtype=torch.float16), torch.randn(1, 3, 2, 8), torch.randn(2, 2, 8)):
        with pytest.raises(ValueError, match="new must be"):
            ops.read(state, codec.spec, new)
