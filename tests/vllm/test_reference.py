"""The reference store and attention on pages (the spec) against independent plain computations: the codec's own
round trip per token, and masked dense attention (torch's SDPA) over each request's history and own tokens."""

from __future__ import annotations

import pytest
import torch
from _paged_cases import batch_cases, make_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcodec_fx.vllm.page import page_format
from flashcodec_fx.vllm.reference import attention_reference, history, page_view, store_reference


def raw_positions(fmt, block_size: int, length: int, total: int) -> torch.Tensor:
    """``(length,)`` bool: the positions a call that stored up to ``total`` reads raw (the layout's promise, said
    independently of ``page.history_rows``): the sinks; in later pages, the last ``A`` of a complete page, and the
    ``A`` newest before the call in a page the call does not complete."""
    if fmt.raw:
        return torch.ones(length, dtype=torch.bool)
    a, pos = fmt.raw_rows(block_size), torch.arange(length)
    page, offset = pos // block_size, pos % block_size
    complete = (page + 1) * block_size <= total
    newest = (pos >= length - a) & (page == (length - 1) // block_size)
    return torch.where(page == 0, offset < a, (complete & (offset >= block_size - a)) | (~complete & newest))


def key_means(fmt, k: torch.Tensor, block_size: int, pages: int) -> torch.Tensor:
    """``(pages, H, D)``: page ``i``'s key mean, the raw key rows of the page before (the first page: its sinks) in
    row order (a later page's row ``o % A`` holds offset ``o``), added in order and divided by ``A``."""
    a = fmt.raw_rows(block_size)
    means = []
    for i in range(pages):
        before = max(i - 1, 0)
        offsets = list(range(a)) if before == 0 else sorted(range(block_size - a, block_size), key=lambda o: o % a)
        rows = [k[before * block_size + o].float() for o in offsets]
        total = rows[0]
        for row in rows[1:]:
            total = total + row
        means.append(total / a)
    return torch.stack(means)


def expected_history(fmt, k: torch.Tensor, v: torch.Tensor, length: int, total: int, block_size: int):
    """What a page-backed sequence of keys / values ``(>= total, H, D)`` gives back for positions ``0 .. length -
    1`` to a call that stored up to ``total``: raw where promised, else the codec's own round trip (keys centered on
    their page's mean)."""
    raw = raw_positions(fmt, block_size, length, total)
    out = []
    for x, codec in ((k[:length], fmt.key), (v[:length], fmt.value)):
        y = x.float().clone()
        if codec is not None and (~raw).any():
            mean = None
            if codec.center:
                pages = -(-length // block_size)
                mean = key_means(fmt, k, block_size, pages)[torch.arange(length) // block_size][~raw]
            y[~raw] = codec.decode(codec.encode(x[~raw].unsqueeze(-2), mean), torch.float32, mean)[..., 0, :]
        out.append(y)
    return out


def dense_history(batch, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``r``'s keys and values as attention must read them: history from the pages, this call's exact."""
    t = int(batch.query_start_loc[r + 1] - batch.query_start_loc[r])
    length = int(batch.seq_lens[r])
    k, v = batch.keys[r], batch.values[r]
    kh, vh = expected_history(batch.fmt, k, v, length - t, length, batch.block_size)
    return torch.cat([kh, k[length - t:].float()]), torch.cat([vh, v[length - t:].float()])


def sdpa_reference(batch, scale: float) -> torch.Tensor:
    out = []
    for r in range(len(batch.keys)):
        qs, qe = int(batch.query_start_loc[r]), int(batch.query_start_loc[r + 1])
        k, v = dense_history(batch, r)
        q = batch.query[qs:qe].float().transpose(0, 1)
        t, length = qe - qs, k.shape[0]
        mask = torch.arange(length)[None, :] <= (length - t + torch.arange(t))[:, None]
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1))
    return torch.cat(out)


def assert_read_back(fmt, got: tuple, want: tuple, raw: torch.Tensor) -> None:
    """Raw positions bitwise; codes up to the rotation product's rounding (it depends on the batch shape)."""
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g[:, raw], w.transpose(0, 1)[:, raw])
        torch.testing.assert_close(g[:, ~raw], w.transpose(0, 1)[:, ~raw], atol=2e-6, rtol=2e-6)


@settings(max_examples=25, deadline=None)
@given(case=batch_cases())
def test_store_then_read_is_the_layouts_promise(case):
    """After the history, this call's store and its ring phase, every position reads back raw where the layout
    promises it (sinks, the newest tokens, a complete page's last rows) and as the codec's round trip elsewhere;
    pages not written are untouched, padding slots (-1) store nothing."""
    batch = make_batch(case)
    cache = batch.filled_cache(case["seed"])
    before = batch.empty_cache(case["seed"])
    store_reference(batch.fmt, *batch.store_args(cache), "ring")
    pages, bs = page_view(cache), batch.block_size
    used = set()
    for r, length in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_table[r, : -(-length // bs)].long()
        used.update(blocks.tolist())
        got = history(batch.fmt, pages, blocks, bs, length, length)
        want = expected_history(batch.fmt, batch.keys[r], batch.values[r], length, length, bs)
        assert_read_back(batch.fmt, got, want, raw_positions(batch.fmt, bs, length, length))
    unused = torch.tensor(sorted(set(range(batch.num_blocks)) - used), dtype=torch.long)
    assert torch.equal(pages[unused], page_view(before)[unused])


@settings(max_examples=20, deadline=None)
@given(length=st.integers(1, 80), cuts=st.lists(st.integers(1, 79), max_size=6),
       name=st.sampled_from(["3bit", "int8", "4bit", "3bit-tcq"]), anchors=st.sampled_from([None, 1, 4]),
       block_size=st.sampled_from([8, 16]), seed=st.integers(0, 1000))
def test_any_split_into_calls_reads_the_same(length, cuts, name, anchors, block_size, seed):
    """One sequence stored in calls of any sizes (store, attention's read, ring): each call reads its history as the
    layout promises, whatever the earlier calls' sizes were."""
    fmt = page_format(name, seed % 30, 16, torch.float32, anchors)
    if fmt.raw_rows(block_size) >= block_size:
        return
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(length, 2, 16, generator=gen), torch.randn(length, 2, 16, generator=gen)
    pages = -(-length // block_size)
    table = torch.randperm(pages + 2, generator=gen)[:pages].to(torch.int32)[None]
    cache = torch.randint(0, 256, (pages + 2, 2, block_size, fmt.state_content_bytes(block_size)), dtype=torch.uint8,
                          generator=gen)
    bounds = sorted({0, length, *(c for c in cuts if c < length)})
    for start, end in zip(bounds, bounds[1:], strict=False):
        pos = torch.arange(start, end)
        slots = table[0, pos // block_size].long() * block_size + pos % block_size
        args = (k[start:end], v[start:end], cache, slots, table, torch.tensor([end], dtype=torch.int32),
                torch.tensor([0, end - start], dtype=torch.int32))
        store_reference(fmt, *args, "store")
        if start:
            got = history(fmt, page_view(cache), table[0, : -(-start // block_size)].long(), block_size, start, end)
            want = expected_history(fmt, k, v, start, end, block_size)
            assert_read_back(fmt, got, want, raw_positions(fmt, block_size, start, end))
        store_reference(fmt, *args, "ring")


@settings(max_examples=25, deadline=None)
@given(case=batch_cases())
def test_attention_is_masked_dense_attention_on_what_the_pages_hold(case):
    batch = make_batch(case)
    cache = batch.filled_cache(case["seed"])
    scale = batch.query.shape[-1] ** -0.5
    out = attention_reference(batch.fmt, *batch.attention_args(cache), scale)
    want = sdpa_reference(batch, scale)
    assert out.dtype == batch.query.dtype
    tol = {torch.float32: 2e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[batch.query.dtype]
    torch.testing.assert_close(out.float(), want.to(batch.query.dtype).float(), atol=tol, rtol=tol)


def test_sinks_take_probability_mass():
    """With sink logits s (per query head) every output is scaled by 1 - sigmoid(s - logsumexp(logits))."""
    batch = make_batch({"format": "4bit", "dtype": torch.float32, "heads": 2, "group": 2, "head_dim": 64,
                        "block_size": 16, "anchors": None, "contexts": [40, 0], "queries": [1, 5], "padding": 0,
                        "seed": 3})
    cache = batch.filled_cache(3)
    s_aux = torch.tensor([0.5, -1.0, 2.0, 0.0])
    plain = attention_reference(batch.fmt, *batch.attention_args(cache), 0.125)
    sunk = attention_reference(batch.fmt, *batch.attention_args(cache), 0.125, s_aux)
    for r in range(2):
        qs, qe = int(batch.query_start_loc[r]), int(batch.query_start_loc[r + 1])
        k, _ = dense_history(batch, r)
        logits = (batch.query[qs:qe].transpose(0, 1) @ k.repeat_interleave(2, 1).permute(1, 2, 0)) * 0.125
        t, length = qe - qs, k.shape[0]
        visible = torch.arange(length)[None, :] <= (length - t + torch.arange(t))[:, None]
        lse = logits.masked_fill(~visible, float("-inf")).logsumexp(-1)  # (Hq, t)
        keep = 1 - torch.sigmoid(s_aux[:, None] - lse)
        torch.testing.assert_close(sunk[qs:qe], plain[qs:qe] * keep.T[..., None], atol=1e-6, rtol=1e-5)


def test_bad_cache_is_refused_before_writing():
    fmt = page_format("3bit", 0, 64, torch.bfloat16)
    k = torch.randn(2, 1, 64).bfloat16()
    with pytest.raises(ValueError, match="cannot hold format"):
        store_reference(fmt, k, k, torch.zeros(2, 1, 16, 8, dtype=torch.uint8), torch.tensor([0, 1]),
                        torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="uint8"):
        page_view(torch.zeros(2, 1, 16, 64))
