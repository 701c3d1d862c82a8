"""`flashcodec::append` (reference) through `CodecStream`: causal safety, incremental == full fill, memo == read."""

from __future__ import annotations

import random

import pytest
import torch
from codec_tiers import grid_data, tier_table

from flashcodec_fx import CodecStream

ops = torch.ops.flashcodec
R = 8
TIERS = tier_table(R, low_keep=3)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = ["dynamic", "static"]


def chunks(total: int, seed: int, largest: int = 2 * R + 3) -> list[int]:
    rng = random.Random(seed)
    sizes = []
    while sum(sizes) < total:
        sizes.append(min(rng.randint(1, largest), total - sum(sizes)))
    return sizes


def fill(codec, layout, x, sizes, memoize=True) -> CodecStream:
    stream = CodecStream(codec, layout, max_length=x.shape[2] + 5, memoize=memoize)
    at = 0
    for n in sizes:
        stream.append(x[:, :, at: at + n])
        at += n
    return stream


def archived(stream: CodecStream) -> list[torch.Tensor]:
    n = stream.get_seq_length() // R
    return [t[:, :, :n].clone() for t in stream.state]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier", list(TIERS))
def test_archived_bytes_never_change(tier, layout):
    """Causal safety: after every append, all previously archived blocks are bitwise what they were."""
    codec = TIERS[tier]
    torch.manual_seed(0)
    x = torch.randn(2, 2, 150, 16).to(torch.bfloat16 if "png" in tier else torch.float16)
    stream = CodecStream(codec, layout, max_length=160)
    snapshots = []
    at = 0
    for n in chunks(150, seed=len(tier)):
        stream.append(x[:, :, at: at + n])
        at += n
        snapshots.append(archived(stream))
        for old in snapshots:
            nb = old[0].shape[2]
            for now, then in zip(stream.state, old, strict=True):
                assert torch.equal(now[:, :, :nb], then)
    assert len(snapshots[-1][0][0, 0]) == 150 // R


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tier", list(TIERS))
def test_incremental_equals_full_fill_bitwise(tier, dtype, layout):
    """Token by token, random chunks and one full fill archive identical bytes and give identical views."""
    codec = TIERS[tier]
    total = 61
    x = grid_data((2, 3, total, 8), dtype, seed=len(tier))
    full = fill(codec, layout, x, [total])
    nb = total // R
    for sizes in ([1] * total, chunks(total, seed=7)):
        inc = fill(codec, layout, x, sizes)
        for a, b in zip(inc.state, full.state, strict=True):
            assert torch.equal(a[:, :, :nb], b[:, :, :nb])
        assert torch.equal(inc.tail[:, :, : total % R], full.tail[:, :, : total % R])
        assert torch.equal(inc.read(), full.read())
        assert inc.get_seq_length() == full.get_seq_length() == total


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_tiers_reproduce_the_input(dtype, layout):
    x = grid_data((1, 2, 45, 16), dtype, seed=3)
    png = fill(TIERS["png"], layout, x, chunks(45, seed=1))
    assert torch.equal(png.read()[:, :, :45], x)
    noisy = torch.randn(1, 2, 45, 16, generator=torch.Generator().manual_seed(4)).to(dtype)
    jpeg = fill(TIERS["jpeg"], layout, noisy, chunks(45, seed=2))
    tol = {torch.float32: 2e-6, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dtype]  # |x| < 5: ~2 ulp of max|x|
    torch.testing.assert_close(jpeg.read()[:, :, :45], noisy, atol=tol, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tier", list(TIERS))
def test_memoized_read_equals_read_op_bitwise(tier, dtype, layout):
    codec = TIERS[tier]
    x = torch.randn(2, 2, 53, 8, generator=torch.Generator().manual_seed(5)).to(dtype)
    stream = fill(codec, layout, x, chunks(53, seed=5))
    plain = fill(codec, layout, x, chunks(53, seed=5), memoize=False)
    assert stream.memo is not None and plain.memo is None
    full = ops.read(*stream.state, stream.tail, stream.length, stream.spec)
    view = stream.read()
    assert torch.equal(view, full[:, :, : view.shape[2]])
    assert torch.equal(plain.read(), view)
    if layout == "static":
        assert torch.equal(stream.memo, full)  # zeros past the length on both sides
        assert view.shape[2] == stream.capacity_blocks * R


def test_append_op_directly_matches_stream_and_touches_only_its_slots():
    """The op with an explicit state: positions past the new length stay zero, length advances by T."""
    codec = TIERS["jpeg-int8"]
    state = codec.empty_state((1, 2), 4, 8, torch.float32, "cpu")
    tail = torch.zeros(1, 2, R, 8)
    length = torch.zeros((), dtype=torch.int64)
    memo = torch.zeros(1, 2, 4 * R, 8)
    x = torch.randn(1, 2, 19, 8, generator=torch.Generator().manual_seed(6))
    ops.append(*state, tail, length, x[:, :, :11], codec.spec, memo)
    ops.append(*state, tail, length, x[:, :, 11:], codec.spec, memo)
    assert int(length) == 19
    enc = codec.encode(x[:, :, :16])
    for got, want in zip(state, enc, strict=True):
        assert torch.equal(got[:, :, :2], want)
        assert not got[:, :, 2:].any()
    assert torch.equal(tail[:, :, :3], x[:, :, 16:19]) and not tail[:, :, 3:].any()
    assert torch.equal(memo[:, :, :16], codec.decode(enc, torch.float32))
    assert torch.equal(memo[:, :, 16:19], x[:, :, 16:]) and not memo[:, :, 19:].any()


BAD_APPEND = {
    "new dtype": ({"new": torch.randn(1, 2, 3, 8, dtype=torch.float16)}, "new must be"),
    "new heads": ({"new": torch.randn(1, 3, 3, 8)}, "new must be"),
    "new head_dim": ({"new": torch.randn(1, 2, 3, 4)}, "new must be"),
    "memo shape": ({"memo": torch.zeros(1, 2, 3 * R, 8)}, "memo must be"),
    "memo dtype": ({"memo": torch.zeros(1, 2, 4 * R, 8, dtype=torch.bfloat16)}, "memo must be"),
    "spec": ({"spec": [0, R, 3, 8]}, "archive_data"),
    "unknown mode": ({"spec": [5, R, R, 8]}, "spec"),
    "length": ({"length": torch.tensor(3, dtype=torch.int32)}, "length"),
    "tail": ({"tail": torch.zeros(1, 2, R - 1, 8)}, "archive_tail"),
}


@pytest.mark.parametrize("case", list(BAD_APPEND))
def test_rejected_append_op_mutates_nothing(case):
    codec = TIERS["jpeg-int8"]
    data, scale, index = codec.empty_state((1, 2), 4, 8, torch.float32, "cpu")
    args = {"data": data, "scale": scale, "index": index, "tail": torch.zeros(1, 2, R, 8),
            "length": torch.zeros((), dtype=torch.int64), "new": torch.randn(1, 2, 11, 8), "spec": codec.spec,
            "memo": torch.zeros(1, 2, 4 * R, 8)}
    ops.append(**args)
    changes, match = BAD_APPEND[case]
    args.update(changes, new=changes.get("new", torch.randn(1, 2, 3, 8)))
    before = [t.clone() for t in args.values() if isinstance(t, torch.Tensor)]
    with pytest.raises(ValueError, match=match):
        ops.append(**args)
    after = [t for t in args.values() if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("r", [2, 4, 8, 16])
def test_touched_blocks_is_the_exact_bound(r):
    """The blocks an append of T tokens can touch, over every offset: no idle block is encoded or launched
    (a single decode token touches exactly one)."""
    from flashcodec_fx.ops import touched_blocks

    for t in range(1, 3 * r + 2):
        assert touched_blocks(t, r) == max((off + t - 1) // r + 1 for off in range(r))
    assert touched_blocks(1, r) == 1
