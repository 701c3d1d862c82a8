"""Triton append against the plain-torch reference: every state tensor and the memo after a run of appends."""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICES, FORMS, dtypes, form, groups_for, same_archive, smooth, to

from flashcodec_fx.codecs import make_codec
from flashcodec_fx.ops import StreamState, empty_state
from flashcodec_fx.ops.plan import stored_form_plan
from flashcodec_fx.ops.reference.append import append_reference, completable_groups
from flashcodec_fx.ops.reference.read import read_reference
from flashcodec_fx.ops.triton import append as module
from flashcodec_fx.ops.triton.append import E_D, E_DP, E_RP, E_SEARCH, EncodeTiles, trellis_encode, triton_append
from flashcodec_fx.ops.triton.common import StreamForm, stream_tables

triton = pytest.importorskip("triton")  # (present: _triton_cases skips the module otherwise)
tl = triton.language

# every form in fp32; the 16-bit dtypes (bf16 on CUDA) on one form per kind of encode (the interpreter is slow, and
# on a GPU each variant is a compile): float jpeg, pruned png, token-axis codes, channel-axis codes with the rotation
# and the clipping search (the Lloyd-Max search runs in fp32 whatever the dtype: fp32 only, ~25 s per dtype here).
HALF = ("jpeg_k8", "png_pruned", "int8", "dct_channel")
CASES = [(device, name, dtype) for device in DEVICES for name in FORMS for dtype in dtypes(device)
         if dtype == torch.float32 or name in HALF]
# trellis codes (levels="tcq"): a table of trellis rows (per-token trellis appends: test_triton_append_attention.py;
# the interpreter's Viterbi search takes ~1 s per program)
CASES += [(device, "tcq_table", torch.float32) for device in DEVICES]
# a prefill, single tokens across a group boundary, a chunk completing several groups with an open one
CHUNKS = {"short": (13, 1, 1, 8, 1), "grouped": (70, 1, 1, 9, 1, 40)}


def _chunks(codec) -> tuple[int, ...]:
    return CHUNKS["grouped" if codec.group > 8 else "short"]


def _fresh(codec, x, device, memo: bool, spare: int = 1):
    b, h, length, d = x.shape
    groups = groups_for(codec, length, spare)  # static capacity beyond the final length
    state = list(empty_state(codec, b, h, groups, d, x.dtype, device))
    cap = codec.sinks + groups * codec.group
    return state, torch.zeros(b, h, cap, d, dtype=x.dtype, device=device) if memo else None


def _run(codec, x, device, chunks, memo=True, spare=1):
    """(Triton state, memo) on ``device`` and (reference state, memo) on CPU after the same appends."""
    got, got_memo = _fresh(codec, x, device, memo, spare)
    want, want_memo = _fresh(codec, x, "cpu", memo, spare)
    pos = 0
    for t in chunks:
        triton_append(got, *to(device, x[:, :, pos: pos + t]), codec.spec, got_memo)
        append_reference(want, x[:, :, pos: pos + t].contiguous(), codec.spec, want_memo)
        pos += t
    got = [t.cpu() for t in got]
    return got, None if got_memo is None else got_memo.cpu(), want, want_memo


def _same_store(codec, got, want, d, dtype):
    """The stored states agree: raw parts and lengths exactly, the mean within fp32 rounding, the archive as
    :func:`same_archive` bounds it."""
    for i in (5, 6, 7, 8):  # sink, tail, length, start: copies and integer arithmetic
        assert torch.equal(got[i], want[i]), ("sink", "tail", "length", "start")[i - 5]
    torch.testing.assert_close(got[4], want[4], atol=1e-6, rtol=1e-6)  # the mean: fp32 sums in another order
    same_archive(codec, got[:4], want[:4], d, dtype)


@pytest.mark.parametrize(("device", "name", "dtype"), CASES)
def test_append_matches_reference(device, name, dtype):
    codec = form(name)
    chunks = _chunks(codec)
    x = smooth(2, 2, sum(chunks), 16, dtype, "cpu", seed=4)
    got, got_memo, want, want_memo = _run(codec, x, device, chunks)
    assert int(got[7]) == sum(chunks) and int(got[8]) > codec.sinks  # groups were archived
    _same_store(codec, got, want, 16, dtype)
    # memo: raw new tokens and decoded archived groups, i.e. what reading the stored state gives (fp32 sums in
    # another order: one rounding of the stream dtype apart at most)
    length = int(got[7])
    view = read_reference(got, codec.spec)
    ulp = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got_memo[:, :, :length].float(), view[:, :, :length].float(), atol=1e-6, rtol=ulp)
    if codec.index_rows and dtype != torch.float32:
        return  # 16-bit deltas tie in magnitude: which of two equal deltas is kept (and decoded) may differ
    out_tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    step = float(want[1].float().abs().amax()) if codec.quantizer is not None else 0.0
    torch.testing.assert_close(got_memo.float(), want_memo.float(), atol=out_tol + 2 * step, rtol=out_tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["dct_channel", "png_pruned", "jpeg_k3"])
def test_append_encodes_head_dim_in_channel_chunks(device, name):
    """head_dim 64: per-channel stored forms encode in programs of 32 channels each (the rotation's inputs read
    whole); stored form and memo as the reference's, at the tolerances of the D = 16 cases."""
    from flashcodec_fx.ops.triton.append import EncodeTiles

    codec = form(name)
    assert EncodeTiles.of(stored_form_plan(codec.spec, 64), True).dc == 32  # two channel chunks per group
    chunks = _chunks(codec)
    x = smooth(1, 2, sum(chunks), 64, torch.float32, "cpu", seed=6)
    got, got_memo, want, want_memo = _run(codec, x, device, chunks)
    assert int(got[8]) > codec.sinks  # groups were archived
    _same_store(codec, got, want, 64, torch.float32)
    step = float(want[1].float().abs().amax()) if codec.quantizer is not None else 0.0
    torch.testing.assert_close(got_memo, want_memo, atol=1e-5 + 2 * step, rtol=1e-5)


# scale_search="fit" on each path of search_scales: token-axis rows of every level set (one DCT block), Lloyd-Max rows
# of 4 and 1 bits per token (the presets' kind), channel-axis classes with a zero point, Lloyd-Max per channel.
FIT_FORMS = {
    "token_table_fit": dict(block_size=4, quant_bits=(6, 4, 3, 2), levels=("int", "uniform", "midrise", "lloyd"),
                            scale_search="fit", window=2),
    "lloyd4_fit": dict(block_size=1, quant_bits=4, levels="lloyd", rotate=True, center=True, scale_search="fit",
                       sinks=4, window=8),
    "lloyd1_fit": dict(block_size=1, quant_bits=1, levels="lloyd", rotate=True, scale_search="fit"),
    "dct_channel_fit": dict(block_size=8, quant_bits=(5, 3, 3, 2, 2, 2, 2, 2), levels=("uniform", "midrise"),
                            scale_axis="channel", group=16, rotate=True, sinks=4, scale_search="fit"),
    "channel_lloyd_fit": dict(block_size=2, quant_bits=3, levels="lloyd", scale_axis="channel", group=4,
                              scale_search="fit"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FIT_FORMS)
def test_fit_search_matches_reference(device, name):
    """The "fit" scale search (its start line, two least-squares passes, the codes of the last pass): the stored form
    as the reference's within :func:`same_archive`'s bounds (its sums run in another order)."""
    codec = make_codec("jpeg", **FIT_FORMS[name])
    chunks = (30, 1, 1, 9, 19)
    x = smooth(2, 2, sum(chunks), 16, torch.float32, "cpu", seed=4)
    got, _, want, _ = _run(codec, x, device, chunks, memo=False)
    assert int(got[8]) > codec.sinks  # groups were archived
    _same_store(codec, got, want, 16, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_append_without_memo_any_strides_and_validation(device):
    """No memo; new tokens of any strides (head_dim stride 2, seq innermost) store what contiguous ones do; bad input
    raises like the reference and changes nothing."""
    codec = form("dct_channel")
    x = smooth(2, 2, 75, 16, torch.float32, "cpu", seed=5)
    contiguous, _ = _fresh(codec, x, device, memo=False)
    strided, _ = _fresh(codec, x, device, memo=False)
    transposed, _ = _fresh(codec, x, device, memo=False)
    x_dev = x.to(device)
    views = (torch.stack([x_dev, -x_dev], -1).flatten(-2)[..., ::2], x_dev.transpose(2, 3).contiguous().transpose(2, 3))
    assert views[0].stride(3) == 2 and views[1].stride(2) == 1
    for lo, hi in ((0, 70), (70, 75)):
        triton_append(contiguous, x_dev[:, :, lo:hi].contiguous(), codec.spec)
        triton_append(strided, views[0][:, :, lo:hi], codec.spec)
        triton_append(transposed, views[1][:, :, lo:hi], codec.spec)
    for a, b, c in zip(contiguous, strided, transposed, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    want, _ = _fresh(codec, x, "cpu", memo=False)
    for lo, hi in ((0, 70), (70, 75)):
        append_reference(want, x[:, :, lo:hi].contiguous(), codec.spec)
    _same_store(codec, [t.cpu() for t in contiguous], want, 16, torch.float32)
    before = [t.clone() for t in contiguous]
    with pytest.raises(ValueError, match="new must be"):
        triton_append(contiguous, x_dev[:1, :, :1], codec.spec)
    with pytest.raises(ValueError, match="memo must be"):
        triton_append(contiguous, x_dev[:, :, :1], codec.spec, torch.zeros(1, device=device))
    assert all(torch.equal(a, b) for a, b in zip(before, contiguous, strict=True))  # nothing changed


def test_append_names_the_triton_limits():
    from flashcodec_fx.ops.triton.common import MAX_GROUP_TOKENS, MAX_PRUNED_BLOCK_SIZE

    wide = make_codec("jpeg", block_size=8, quant_bits=4, scale_axis="channel", group=2 * MAX_GROUP_TOKENS)
    pruned = make_codec("png", block_size=2 * MAX_PRUNED_BLOCK_SIZE, keep_ratio=0.5)
    x = torch.zeros(1, 1, 3, 16)
    for codec, match in ((wide, f"groups of <= {MAX_GROUP_TOKENS} tokens"),
                         (pruned, f"block_size <= {MAX_PRUNED_BLOCK_SIZE}")):
        state = list(empty_state(codec, 1, 1, 2, 16, torch.float32, "cpu"))
        before = [t.clone() for t in state]
        with pytest.raises(ValueError, match=match):
            triton_append(state, x, codec.spec)
        assert all(torch.equal(a, b) for a, b in zip(before, state, strict=True))
    codec = form("int8")
    state = list(empty_state(codec, 1, 1, 2, 16, torch.float32, "cpu"))
    state[6] = torch.zeros(1, 1, 8, 2 * 16)[..., :16]
    with pytest.raises(ValueError, match="state.tail must be contiguous"):
        triton_append(state, x, codec.spec)


@pytest.mark.parametrize("device", DEVICES)
def test_each_step_launches_the_same_grids_and_only_completable_groups(device, monkeypatch):
    """Every decode step makes the same launches (grids from shapes only: CUDA-graph safe); the encode grid has
    ``completable_groups(T, G) = ceil(T / G)`` programs (its first axis) per head (its second), which is the exact
    bound on the groups one append can archive (a single decode token: one), times the channel chunks (channel-axis
    codes: ``D / 32``, here one)."""
    grids = []

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            grids.append((self.kernel.__name__, grid))
            return self.kernel[grid]

    for name in ("_intake_kernel", "_encode_kernel", "_tail_kernel", "_advance_kernel"):
        monkeypatch.setattr(module, name, Recording(getattr(module, name)))
    codec = form("dct_channel")  # G = 64, window 0, 4 sinks
    x = smooth(1, 2, 4 + 64 + 3, 16, torch.float32, device, seed=1)
    state, _ = _fresh(codec, x, device, memo=False)
    triton_append(state, x[:, :, :63], codec.spec)
    grids.clear()
    for i in range(63, 70):  # across the first group's completion
        triton_append(state, x[:, :, i: i + 1], codec.spec)
    steps = [tuple(grids[i: i + 4]) for i in range(0, len(grids), 4)]
    assert len(steps) == 7 and all(s == steps[0] for s in steps)
    assert dict(steps[0])["_encode_kernel"] == (completable_groups(1, codec.group), 2, 1) == (1, 2, 1)
    assert int(StreamState(*state).start) == 4 + 64  # the group completed on the way and was archived
    for g in (1, 8, 64):
        for t in range(1, 3 * g + 2):
            # archived groups = (tail tokens + T - window) // G over every tail fill h in [window, window + G)
            assert completable_groups(t, g) == max((h + t) // g for h in range(g))


def _overflow(codec, device, batch: int, guard: bool):
    """Two appends into a ``batch x 1`` head static archive of 2 groups, the second past the capacity. With ``guard``
    the archive tensors and the memo are views of buffers one group longer, filled with a sentinel."""
    d, groups, extra = 16, 2, 1 if guard else 0
    bufs = list(codec.empty_archive((batch, 1), groups + extra, d, torch.float32, device))
    cap = codec.sinks + groups * codec.group
    bufs.append(torch.zeros(batch, 1, cap + extra * codec.group, d, device=device))
    for t in bufs:
        t.fill_(7)
    views = [t[:, :, :groups] for t in bufs[:4]] + [bufs[4][:, :, :cap]]
    for t in views:
        t.zero_()
    guard_before = [t[:, :, v.shape[2]:].clone() for t, v in zip(bufs, views, strict=True)]
    state = list(empty_state(codec, batch, 1, groups, d, torch.float32, device))
    state[:4] = views[:4]
    got = (state, views[4])
    want = (list(empty_state(codec, batch, 1, groups, d, torch.float32, "cpu")), torch.zeros(batch, 1, cap, d))
    x = smooth(batch, 1, 2 * cap + 5, d, torch.float32, "cpu", seed=6)
    for lo, hi in ((0, cap - 3), (cap - 3, x.shape[2])):
        triton_append(got[0], *to(device, x[:, :, lo:hi]), codec.spec, got[1])
        append_reference(want[0], x[:, :, lo:hi].contiguous(), codec.spec, want[1])
    guard_after = [t[:, :, v.shape[2]:] for t, v in zip(bufs, views, strict=True)]
    return got, want, guard_before, guard_after, x.shape[2]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["int8", "png_pruned", "dct_channel"])
@pytest.mark.parametrize("batch", [1, 2])
def test_overflow_writes_nothing_past_capacity(device, name, batch):
    """Appending past a static capacity (a compiled step skips the host check): no store lands past the buffers
    (batch 1: a sentinel group after each) or in the next head's groups (batch 2: the reference agrees), and the
    length records the overflow."""
    codec = form(name)
    (got, got_memo), (want, want_memo), guard_before, guard_after, total = _overflow(codec, device, batch,
                                                                                    guard=batch == 1)
    got = [t.cpu() for t in got]
    assert int(got[7]) == int(want[7]) == total > codec.sinks + 2 * codec.group  # recorded in the length
    _same_store(codec, got, want, 16, torch.float32)
    step = float(want[1].float().abs().amax()) if codec.quantizer is not None else 0.0
    torch.testing.assert_close(got_memo.cpu(), want_memo, atol=1e-5 + 2 * step, rtol=1e-5)
    for before, after in zip(guard_before, guard_after, strict=True):
        assert torch.equal(after.cpu(), before.cpu())


def test_grid_rows_bound_batch_heads_not_groups():
    """The per-group kernels put the archive's groups on the grid's first axis (a 128k stream of one-token groups
    passes CUDA's 65,535 on the others: seen on an H200) and batch * heads on the second, which is checked."""
    from flashcodec_fx.ops.triton.common import MAX_GRID_ROWS, grid_rows

    assert grid_rows(MAX_GRID_ROWS) == MAX_GRID_ROWS == 65535
    with pytest.raises(ValueError, match="batch \\* heads must be at most 65535"):
        grid_rows(MAX_GRID_ROWS + 1)


@triton.jit
def _trellis_rows_kernel(x_ptr, codes_ptr, scale_ptr, rows_t, levels, factors, N, F: tl.constexpr, E: tl.constexpr):
    """``trellis_encode`` of the ``N`` rows of ``x (N, D)`` (row 0 of a per-token trellis codec): codes and scales."""
    D: tl.constexpr = E[E_D]
    r = tl.arange(0, E[E_RP])
    dd = tl.arange(0, E[E_DP])[None, :]
    row_ok = r < N
    ok = row_ok[:, None] & (dd < D)
    x = tl.load(x_ptr + r[:, None] * D + dd, mask=ok, other=0.0)
    j = tl.zeros(r.shape, tl.int32)
    codes, scale = trellis_encode(x, row_ok, tl.load(rows_t + j), j, levels, factors, dd, F, D, E[E_SEARCH])
    tl.store(codes_ptr + r[:, None] * D + dd, codes, mask=ok)
    tl.store(scale_ptr + r, scale, mask=row_ok)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("bits", "search", "d"), [(1, True, 16), (2, False, 16), (3, "fit", 16), (4, True, 16),
                                                   (3, True, 64)])
def test_trellis_encoder_is_the_reference_bit_for_bit(device, bits, search, d):
    """The Triton Viterbi encoder (``append.trellis_encode``) on the reference's rows: codes and scales bit for bit
    ``codecs.trellis.encode``'s (its sums in the same order, FMA contraction off), on Gaussian rows of mixed
    scales, a zero row and a row of equal values (ties)."""
    from flashcodec_fx.codecs import trellis

    codec = make_codec("jpeg", block_size=1, quant_bits=bits, levels="tcq", scale_search=search)
    plan = stored_form_plan(codec.spec, d)
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(12, d, generator=gen) * torch.logspace(-3, 3, 12)[:, None]
    x[3] = 0.0
    x[7] = 0.5
    codes = torch.empty(12, d, dtype=torch.int32, device=device)
    scale = torch.empty(12, dtype=torch.float32, device=device)
    tab = stream_tables(codec, d, device)
    _trellis_rows_kernel[(1,)](x.to(device), codes, scale, tab.rows, tab.levels, tab.factors, 12,
                               F=StreamForm.of(plan).constexpr(), E=EncodeTiles.of(plan, False).constexpr(),
                               enable_fp_fusion=False)
    want_codes, want_scale = trellis.encode(x, bits, search)
    assert torch.equal(codes.cpu(), want_codes) and torch.equal(scale.cpu(), want_scale)
