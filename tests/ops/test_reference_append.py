"""`flashcodec::append` (reference): incremental == one-shot fill bitwise, causal safety bitwise, memo == read, the
centering mean, and rejected calls that change nothing."""

from __future__ import annotations

import pytest
import torch
from _op_states import chunks, fill, new_memo, new_state, uncropped_start
from codec_tiers import FAST, grid_data, kv_like, tier_table
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx.ops import StreamState
from flashcodec_fx.ops.reference.append import write_prefix

ops = torch.ops.flashcodec
R = 8
TIERS = tier_table(R, low_keep=3)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PROMPT = 6  # the first append: it sets the centering mean, so every fill of a stream starts with it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tier", list(TIERS))
def test_incremental_equals_one_shot_fill_bitwise(tier, dtype):
    """After the prompt: token by token, random chunks and one chunk store identical bytes in all 9 tensors (zeros
    past the length included) and read identically; without centering, one append of everything too."""
    codec = TIERS[tier]
    total = 37
    x = grid_data((2, 3, total, 16), dtype, seed=len(tier))
    spare = total + 2 * codec.group  # capacity past the length, as a static layout has
    want, _ = fill(codec, x, [PROMPT, total - PROMPT], positions=spare)
    runs = [[PROMPT] + [1] * (total - PROMPT), chunks(total, seed=7, first=PROMPT)]
    if not codec.center:
        runs.append([total])
    for sizes in runs:
        got, _ = fill(codec, x, sizes, positions=spare)
        for name, a, b in zip(StreamState._fields, got, want, strict=True):
            assert torch.equal(a, b), (sizes, name)
        assert torch.equal(ops.read(got, codec.spec), ops.read(want, codec.spec))
    assert int(want.length) == total and int(want.start) == uncropped_start(codec, total)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tier", list(TIERS))
def test_archived_groups_never_change(tier, dtype):
    """Causal safety: after every append, each group archived before, the sinks and the mean are bitwise what they
    were; groups archive exactly when complete and out of the window."""
    codec = TIERS[tier]
    total = 75
    x = kv_like((2, 2, total, 16), dtype, seed=3)
    state = new_state(codec, x, total)
    frozen: list[tuple[int, list[torch.Tensor]]] = []
    sinks = mean = None
    at = 0
    for n in chunks(total, seed=len(tier), largest=2 * codec.group + 3):
        ops.append(state, x[:, :, at: at + n], codec.spec, None)
        at += n
        assert int(state.start) == uncropped_start(codec, at)
        done = (int(state.start) - codec.sinks) // codec.group
        frozen.append((done, [t[:, :, :done].clone() for t in state[:4]]))
        for groups, old in frozen:
            assert all(torch.equal(t[:, :, :groups], o) for t, o in zip(state[:4], old, strict=True))
        assert all(not t[:, :, done:].any() for t in state[:4])  # slots past the archive are never written
        if at >= codec.sinks:  # sinks complete: frozen from now on
            sinks = state.sink.clone() if sinks is None else sinks
            assert torch.equal(state.sink, sinks)
        if at > codec.sinks:  # the mean is set by the first append past the sinks
            mean = state.mean.clone() if mean is None else mean
            assert torch.equal(state.mean, mean)
    assert frozen[-1][0] == (total - codec.sinks - codec.window) // codec.group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tier", list(TIERS))
def test_memo_equals_read_bitwise(tier, dtype):
    codec = TIERS[tier]
    total = 29
    x = kv_like((1, 2, total, 8), dtype, seed=5)
    state, memo = fill(codec, x, chunks(total, seed=5, first=PROMPT), positions=total + codec.group, memo=True)
    plain, _ = fill(codec, x, chunks(total, seed=5, first=PROMPT), positions=total + codec.group)
    view = ops.read(state, codec.spec)
    assert torch.equal(memo, view)  # zeros past the length on both sides
    assert torch.equal(ops.read(plain, codec.spec), view)
    assert all(torch.equal(a, b) for a, b in zip(state, plain, strict=True))  # the memo changes nothing stored


def test_mean_is_set_once_by_the_first_append_past_the_sinks():
    codec = TIERS["token-lloyd2"]  # sinks=2, center
    x = kv_like((1, 2, 12, 8), torch.float32, seed=6)
    state = new_state(codec, x, 12)
    ops.append(state, x[:, :, :1], codec.spec, None)  # still inside the sinks: no mean yet
    assert not state.mean.any()
    ops.append(state, x[:, :, 1:5], codec.spec, None)  # positions 1..4: the mean of 2..4 (the non-sink ones)
    torch.testing.assert_close(state.mean, x[:, :, 2:5].mean(2), atol=1e-6, rtol=0)
    mean = state.mean.clone()
    ops.append(state, x[:, :, 5:12], codec.spec, None)
    assert torch.equal(state.mean, mean)
    assert torch.equal(state.sink, x[:, :, :2])  # the sinks hold the first tokens, raw


def test_append_op_state_after_two_calls():
    """The op with an explicit state: the archive holds the codec's encoding of the complete groups, the tail the
    raw rest (zeros after it), untouched slots stay zero, the length advances by T."""
    codec = TIERS["jpeg-table"]  # sinks=2, groups of 16
    x = kv_like((1, 2, 40, 8), torch.float32, seed=7)
    state = new_state(codec, x, 64)
    ops.append(state, x[:, :, :11], codec.spec, None)
    ops.append(state, x[:, :, 11:], codec.spec, None)
    assert int(state.length) == 40 and int(state.start) == 34
    enc = codec.encode(x[:, :, 2:34])
    for got, want in zip(state[:4], enc, strict=True):
        assert torch.equal(got[:, :, :2], want) and not got[:, :, 2:].any()
    assert torch.equal(state.sink, x[:, :, :2])
    assert torch.equal(state.tail[:, :, :6], x[:, :, 34:]) and not state.tail[:, :, 6:].any()


BAD_APPEND = {
    "new dtype": ({"new": torch.randn(1, 2, 3, 8, dtype=torch.float16)}, "new must be"),
    "new heads": ({"new": torch.randn(1, 3, 3, 8)}, "new must be"),
    "new head_dim": ({"new": torch.randn(1, 2, 3, 16)}, "new must be"),
    "new rank": ({"new": torch.randn(2, 3, 8)}, "new must be"),
    "memo shape": ({"memo": torch.zeros(1, 2, 8, 8)}, "memo must be"),
    "memo dtype": ({"memo": "bf16"}, "memo must be"),
    "spec of another codec": ({"spec": TIERS["jpeg-int8"].spec}, "state."),
    "bad spec": ({"spec": "gif;r=8;sinks=0;window=0"}, "spec"),
}


@pytest.mark.parametrize("case", list(BAD_APPEND))
def test_rejected_append_mutates_nothing(case):
    codec = TIERS["token-lloyd2"]
    x = kv_like((1, 2, 9, 8), torch.float32, seed=8)
    state = new_state(codec, x, 30)
    memo = new_memo(codec, state)
    ops.append(state, x, codec.spec, memo)
    args = {"state": state, "new": torch.randn(1, 2, 3, 8), "spec": codec.spec, "memo": memo}
    changes, match = BAD_APPEND[case]
    args.update(changes)
    if args["memo"] == "bf16":
        args["memo"] = memo.bfloat16()
    before = [t.clone() for t in (*state, memo)]
    with pytest.raises(ValueError, match=match):
        ops.append(**args)
    assert all(torch.equal(a, b) for a, b in zip(before, (*state, memo), strict=True))


def test_capacity_exactly_used():
    """A state of exactly ``sinks + NG * G`` positions takes that many tokens (the window's tokens live in the tail);
    the newest token reads back raw when it is not archived."""
    for codec in TIERS.values():
        for length in (1, codec.sinks + codec.group, 3 * codec.group + codec.sinks + 1):
            x = kv_like((1, 1, length, 8), torch.float32, seed=length)
            state, _ = fill(codec, x, [length])
            view = ops.read(state, codec.spec)
            assert view.shape[2] == codec.sinks + state.data.shape[2] * codec.group >= length
            assert int(state.length) == length
            if length > uncropped_start(codec, length):
                assert torch.equal(view[:, :, length - 1], x[:, :, -1])


def test_sinks_only_state_takes_tokens():
    """A state with no archive group (capacity = sinks: a static cache with max_length <= sinks)."""
    codec = TIERS["token-lloyd2"]  # sinks=2
    x = kv_like((1, 1, 2, 8), torch.float32, seed=9)
    state, _ = fill(codec, x, [1, 1])
    assert state.data.shape[2] == 0
    assert torch.equal(ops.read(state, codec.spec), x)


def rolled_back(state: StreamState, keep: int) -> StreamState:
    """``state`` cut back to ``keep`` tokens inside its raw tail (``start <= keep``): the tail rows from ``keep`` on
    are zeroed and ``length`` moves; the archive and its end (``start``) stay (what a crop inside the tail does)."""
    cut = StreamState(*(t.clone() for t in state))
    cut.tail[:, :, keep - int(cut.start):].zero_()
    cut.length.fill_(keep)
    return cut


@pytest.mark.parametrize("tier", list(TIERS))
def test_rollback_inside_the_tail_then_reappend_is_the_uncut_fill(tier):
    """The explicit archive end: cutting back to any position of the tail, even below the window, and appending the
    same tokens again stores bitwise what never cutting stores."""
    codec = TIERS[tier]
    total, cut_from = 40, 31
    x = grid_data((1, 2, total, 16), torch.bfloat16, seed=11)
    want, _ = fill(codec, x, [PROMPT, total - PROMPT], positions=total + codec.group)
    state, _ = fill(codec, x[:, :, :cut_from], chunks(cut_from, seed=3, first=PROMPT), positions=total + codec.group)
    start = int(state.start)
    for keep in sorted({start, (start + cut_from) // 2, cut_from - 1}):
        cut = rolled_back(state, keep)
        view = ops.read(cut, codec.spec)
        assert torch.equal(view[:, :, :keep], ops.read(state, codec.spec)[:, :, :keep]) and not view[:, :, keep:].any()
        ops.append(cut, x[:, :, keep:], codec.spec, None)
        for name, a, b in zip(StreamState._fields, cut, want, strict=True):
            assert torch.equal(a, b), (keep, name)


@pytest.mark.parametrize("tier", list(TIERS))
def test_overflow_writes_nothing_past_the_capacity(tier):
    """An append past the capacity (which a compiled step cannot check on the host) raises nothing and writes only
    inside the state: the groups that fit and the memo hold what a larger state holds there, the sinks are the first
    tokens, and the length records the overflow."""
    codec = TIERS[tier]
    cap = codec.sinks + 2 * codec.group
    total = cap + 2 * codec.group + codec.window + 3
    x = kv_like((2, 2, total, 8), torch.float32, seed=12)
    state = new_state(codec, x, cap)
    memo = new_memo(codec, state)
    assert state.data.shape[2] == 2 and memo.shape[2] == cap
    sizes = [cap - 3, total - cap + 3]
    for lo, hi in ((0, sizes[0]), (sizes[0], total)):
        ops.append(state, x[:, :, lo:hi], codec.spec, memo)
    big, big_memo = fill(codec, x, sizes, positions=total, memo=True)
    assert int(state.length) == total
    for a, b in zip(state[:4], big[:4], strict=True):
        assert torch.equal(a, b[:, :, :2])
    assert torch.equal(state.sink, big.sink) and torch.equal(state.mean, big.mean)
    assert torch.equal(memo, big_memo[:, :, :cap])


@FAST
@given(slots=st.integers(0, 6), n=st.integers(1, 5), first=st.integers(0, 8), prefix=st.integers(0, 5),
       trailing=st.integers(0, 2))
def test_write_prefix_writes_exactly_the_prefix(slots, n, first, prefix, trailing):
    """``store[:, :, first + j] = values[:, :, j]`` for the True prefix of ``write`` (never past the store), every
    other slot unchanged, whatever the trailing dims."""
    store = torch.arange(2 * slots * 3**trailing, dtype=torch.float32).view(1, 2, slots, *[3] * trailing)
    values = -1 - torch.arange(2 * n * 3**trailing, dtype=torch.float32).view(1, 2, n, *[3] * trailing)
    j = torch.arange(n)
    write = (j < prefix) & (first + j < slots)
    want = store.clone()
    for k in range(n):
        if write[k]:
            want[:, :, first + k] = values[:, :, k]
    write_prefix(store, torch.tensor(first), values, write)
    assert torch.equal(store, want)
