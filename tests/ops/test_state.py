"""The 10-tensor stream state: layout as documented, positions derived from the device length, clear errors for
state tensors of the wrong shape or dtype (naming the field) through every op."""

from __future__ import annotations

import pytest
import torch
from _op_states import fill, new_state, uncropped_start
from codec_tiers import FAST, tier_table
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx.codecs import make_codec
from flashcodec_fx.ops import StreamState, advance, capacity, completable_groups, empty_state

ops = torch.ops.flashcodec
R = 4
TIERS = tier_table(R, low_keep=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tier", list(TIERS))
def test_empty_state_layout(tier, dtype):
    codec = TIERS[tier]
    st_ = empty_state(codec, 2, 3, 5, 16, dtype, "cpu")
    assert isinstance(st_, StreamState) and len(st_) == 10
    for t, (shape, want) in zip(st_[:4], codec.archive_shapes(16, dtype).values(), strict=True):
        assert t.shape == (2, 3, 5, *shape) and t.dtype == want
    assert st_.mean.shape == (2, 3, 16 if codec.center else 0) and st_.mean.dtype == torch.float32
    assert st_.sink.shape == (2, 3, codec.sinks, 16) and st_.sink.dtype == dtype
    assert st_.tail.shape == (2, 3, codec.window + codec.group, 16) and st_.tail.dtype == dtype
    assert st_.length.shape == () and st_.length.dtype == torch.int64 and int(st_.length) == 0
    assert st_.start.shape == () and st_.start.dtype == torch.int64 and int(st_.start) == codec.sinks
    assert st_.norm.shape == (2, 3, 16 if codec.normalize else 0) and st_.norm.dtype == torch.uint8
    assert all(not t.any() for t in (*st_[:8], st_.norm))
    assert capacity(codec, st_) == codec.sinks + 5 * codec.group


@FAST
@given(sinks=st.integers(0, 5), window=st.integers(0, 9), group=st.sampled_from([1, 2, 4, 8, 16]),
       groups=st.integers(0, 4), behind=st.integers(0, 60))
def test_advance_archives_whole_groups_while_the_window_stays_raw(sinks, window, group, groups, behind):
    """From any archive end ``start`` (a crop may have left the tail short), appending up to ``end`` archives the
    most whole groups that leave at least ``window`` tokens in the tail: fewer than ``window + G`` remain."""
    codec = make_codec("jpeg", block_size=group, sinks=sinks, window=window)
    start = sinks + groups * group
    for end in range(start, start + behind + 1):
        got = advance(codec, start, end)
        assert int(advance(codec, torch.tensor(start), torch.tensor(end))) == got  # device and host agree
        assert (got - start) % group == 0 and got >= start
        assert end - got >= window or got == start
        assert end - got < window + group or end - start < window
    assert advance(codec, sinks, sinks + behind) == uncropped_start(codec, sinks + behind)


@pytest.mark.parametrize(("sinks", "window", "group"), [(0, 0, 2), (0, 0, 8), (2, 3, 4), (4, 16, 8), (1, 0, 3)])
def test_completable_groups_bounds_every_append(sinks, window, group):
    """``ceil(T / G)`` groups at most complete in one append of T tokens, from any archive end, and that bound is
    reached."""
    codec = make_codec("png", block_size=group, sinks=sinks, window=window)
    for t in range(1, 3 * group + 2):
        done = [(advance(codec, start, end + t) - advance(codec, start, end)) // group
                for start in (sinks, sinks + group) for end in range(start, start + 4 * group + window)]
        assert max(done) == completable_groups(t, group) == -(-t // group), (t, done)


def valid_state(codec, dtype=torch.float32):
    x = torch.randn(1, 2, 11, 8).to(dtype)
    state, _ = fill(codec, x, [11], positions=24)
    return state


FIELDS = StreamState._fields


def broken(state, field: str, how: str) -> list[torch.Tensor]:
    """``state`` with one field replaced by a tensor of the wrong dtype or shape."""
    out = list(state)
    i = FIELDS.index(field)
    t = state[i]
    if how == "dtype":
        out[i] = t.to(torch.int32 if t.is_floating_point() else torch.float64)
    else:
        out[i] = t.new_zeros(*t.shape, 1) if t.dim() else t.new_zeros(1)
    return out


CASES = [(f, how) for f in FIELDS for how in ("dtype", "shape") if (f, how) != ("tail", "dtype")]


@pytest.mark.parametrize(("field", "how"), CASES)
@pytest.mark.parametrize("tier", ["jpeg-table", "token-lloyd2", "png-half"])
def test_bad_state_tensor_is_rejected_naming_the_field(tier, field, how):
    """append / read / codec_attention name the broken field; a rejected append changes nothing."""
    codec = TIERS[tier]
    state = valid_state(codec)
    bad = broken(state, field, how)
    before = [t.clone() for t in bad]
    match = f"state.{field}|state must hold" if field != "tail" else "state"
    with pytest.raises(ValueError, match=match):
        ops.append(bad, torch.randn(1, 2, 3, 8), codec.spec, None)
    assert all(torch.equal(a, b) for a, b in zip(before, bad, strict=True))
    with pytest.raises(ValueError, match=match):
        ops.read(bad, codec.spec)
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match=f"v_{match}" if field != "tail" else "v_state"):
        ops.codec_attention(q, state, bad, codec.spec, codec.spec)
    with pytest.raises(ValueError, match=f"k_{match}" if field != "tail" else "k_state"):
        ops.codec_attention(q, bad, state, codec.spec, codec.spec)


def test_tail_dtype_and_state_size_errors():
    codec = TIERS["jpeg-int8"]
    state = valid_state(codec)
    with pytest.raises(TypeError, match="state.tail must be a floating tensor"):
        ops.read(state._replace(tail=state.tail.int()), codec.spec)
    with pytest.raises(ValueError, match="state must hold the 10 tensors"):
        ops.read(state[:8], codec.spec)
    with pytest.raises(ValueError, match=r"state.tail must be \(B, H, window \+ G, D\)"):
        ops.read(state._replace(tail=state.tail[0]), codec.spec)


def test_state_of_another_codec_is_rejected():
    """A state allocated for one codec, read with the spec of another (different rows / bits / sinks)."""
    state = valid_state(TIERS["jpeg-int8"])
    for other in ("jpeg-k2", "jpeg-table", "png-window"):
        with pytest.raises(ValueError, match="state."):
            ops.read(state, TIERS[other].spec)


@pytest.mark.parametrize("spec", ["gif;r=8;sinks=0;window=0", "jpeg;r=8", "png;r=8;kept=7;sinks=0;window=1;x=2"])
def test_bad_spec_is_rejected_naming_the_argument(spec):
    state = new_state(TIERS["png"], torch.zeros(1, 1, 1, 8), 8)
    with pytest.raises(ValueError, match="^spec: "):
        ops.append(state, torch.randn(1, 1, 1, 8), spec, None)
    with pytest.raises(ValueError, match="^spec_v: "):
        ops.codec_attention(torch.randn(1, 1, 1, 8), state, state, TIERS["png"].spec, spec)
