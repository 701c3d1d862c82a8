"""Triton read against the plain-torch reference op, on every stored form and the states a stream can be in.

Tolerance: raw positions (sinks, tail rows, the new tokens, zeros past the length) are copies, equal bit for bit;
archived positions are the Triton decode of the stored groups (fp32 arithmetic in another order, rounded once to
the stream dtype): within ``atol=1e-5`` and one rounding of the stream dtype (``rtol`` 1e-5 fp32, 1e-3 fp16,
8e-3 bf16) of the reference.
"""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICES, FORMS, TRELLIS_FORMS, dtypes, form, groups_for, smooth, stored_state

from flashcodec_fx.ops import empty_state
from flashcodec_fx.ops.reference.read import read_reference
from flashcodec_fx.ops.state import StreamState
from flashcodec_fx.ops.triton.common import MAX_GROUP_TOKENS
from flashcodec_fx.ops.triton.read import triton_read

HALF = ("jpeg_k8", "png_pruned", "int8", "dct_channel")  # as test_triton_blocks: one form per kind of stored form
CASES = [(device, name, dtype) for device in DEVICES for name in FORMS for dtype in dtypes(device)
         if dtype == torch.float32 or name in HALF]
CASES += [(device, name, torch.float32) for device in DEVICES for name in TRELLIS_FORMS]  # trellis codes (fp32)
ROUNDING = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _ids(cases) -> list[str]:
    return [f"{device}-{name}-{str(dtype)[6:]}" for device, name, dtype in cases]


def _check(codec, state, device, new=None) -> torch.Tensor:
    """The Triton read of ``state`` (CPU tensors) on ``device`` against the reference's: exact outside the archived
    positions ``sinks .. start - 1``, within the tolerance inside."""
    got = triton_read([t.to(device) for t in state], codec.spec, None if new is None else new.to(device)).cpu()
    want = read_reference(state, codec.spec, new)
    assert got.shape == want.shape and got.dtype == want.dtype
    start = min(int(state[8]), got.shape[2])
    archived = torch.zeros(got.shape[2], dtype=torch.bool)
    archived[codec.sinks: start] = True
    if new is not None:  # the call's tokens are copies wherever they land
        archived[max(0, int(state[7]) - new.shape[2]): int(state[7])] = False
    archived &= torch.arange(got.shape[2]) < int(state[7])  # zeros from the length
    assert torch.equal(got[:, :, ~archived], want[:, :, ~archived])
    torch.testing.assert_close(got[:, :, archived].float(), want[:, :, archived].float(), atol=1e-5,
                               rtol=ROUNDING[got.dtype])
    return got


@pytest.mark.parametrize(("device", "name", "dtype"), CASES, ids=_ids(CASES))
def test_read_matches_reference(device, name, dtype):
    """A prefill and three single tokens (batch 2, 2 heads, head_dim 16) in an archive with a spare group, read
    without and with the last call's tokens."""
    codec = form(name)
    length = codec.sinks + codec.window + 2 * codec.group + 5
    x = smooth(2, 2, length, 16, dtype, "cpu", seed=2)
    state = stored_state(codec, x, groups_for(codec, length))
    assert int(state[8]) > codec.sinks  # groups were archived
    _check(codec, state, device)
    _check(codec, state, device, x[:, :, -1:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["lloyd_rot", "dct_channel", "midrise_offset"])
def test_read_any_state(device, name):
    """The reference's rules position by position in states a stream passes through: new tokens reaching back into
    the archive (a chunk longer than the tail, any strides), a rollback inside the tail, a length cropped below the
    archive's end, a fresh stream, an overflowed one (length past the capacity), no archive groups (sinks only),
    head_dim 64 (two channel chunks)."""
    codec = form(name)
    length = codec.sinks + codec.window + 2 * codec.group + 5
    x = smooth(1, 2, length, 16, torch.float32, "cpu", seed=4)
    state = stored_state(codec, x, groups_for(codec, length))
    chunk = x[:, :, -(codec.tail_capacity + codec.group):]
    strided = chunk.transpose(2, 3).contiguous().transpose(2, 3)
    assert torch.equal(_check(codec, state, device, chunk), _check(codec, state, device, strided))
    for moved in (length - 2, codec.sinks + codec.group // 2, 0):
        state[7] = torch.tensor(moved)
        _check(codec, state, device)
    _check(codec, list(empty_state(codec, 2, 1, 2, 16, torch.float32, "cpu")), device)
    over = smooth(1, 2, 4 * codec.group + codec.sinks + 3, 16, torch.float32, "cpu", seed=5)
    overflowed = stored_state(codec, over, 2)
    assert int(overflowed[7]) > codec.sinks + 2 * codec.group
    _check(codec, overflowed, device, over[:, :, -1:])
    _check(codec, stored_state(codec, x[:, :, : codec.sinks + 3], 0), device)
    wide = smooth(1, 2, length, 64, torch.float32, "cpu", seed=6)
    _check(codec, stored_state(codec, wide, groups_for(codec, length)), device, wide[:, :, -1:])


@pytest.mark.parametrize("device", DEVICES)
def test_read_validation_and_limits(device):
    """Bad input raises like the reference (the launcher runs its checks); the group limit is named."""
    from flashcodec_fx.codecs import make_codec

    codec = form("int8")
    state = [t.to(device) for t in empty_state(codec, 1, 2, 2, 16, torch.float32, "cpu")]
    with pytest.raises(ValueError, match="new must be"):
        triton_read(state, codec.spec, torch.zeros(1, 2, 1, 8, device=device))
    with pytest.raises(ValueError, match="state.data must be"):
        triton_read(state, form("lloyd_rot").spec)
    wide = make_codec("jpeg", block_size=8, quant_bits=4, scale_axis="channel", group=2 * MAX_GROUP_TOKENS)
    with pytest.raises(ValueError, match=f"groups of <= {MAX_GROUP_TOKENS} tokens"):
        triton_read([t.to(device) for t in empty_state(wide, 1, 1, 1, 16, torch.float32, "cpu")], wide.spec)
    no_heads = [t if field in ("length", "start") else t[:, :0] for field, t in zip(StreamState._fields, state, strict=True)]
    assert triton_read(no_heads, codec.spec).shape == (1, 0, 2 * codec.group, 16)
