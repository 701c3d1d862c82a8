"""The reference store and attention on pages (the spec) against independent plain computations: the codec's own
round trip per token, and masked dense attention (torch's SDPA) over each request's history and own tokens."""

from __future__ import annotations

import pytest
import torch
from _paged_cases import batch_cases, make_batch
from hypothesis import given, settings

from flashcodec_fx.vllm.page import page_format
from flashcodec_fx.vllm.reference import attention_reference, decode_pages, page_view, store_reference


def codec_round_trip(fmt, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, block_size: int):
    """What a page gives back for tokens ``k``, ``v (n, H, D)`` at ``positions``: raw rows as stored (the model's
    dtype), other tokens through the codec's own encode / decode."""
    raw = (positions % block_size) < fmt.raw_rows(block_size)
    out = []
    for x, codec in ((k, fmt.key), (v, fmt.value)):
        y = x.float().clone()
        if codec is not None and (~raw).any():
            y[~raw] = codec.decode(codec.encode(x[~raw].unsqueeze(-2)), torch.float32)[..., 0, :]
        out.append(y)
    return out


def dense_history(batch, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``r``'s keys and values as attention must read them: history round-tripped, this call's exact."""
    t = int(batch.query_start_loc[r + 1] - batch.query_start_loc[r])
    length = int(batch.seq_lens[r])
    k, v = batch.keys[r], batch.values[r]
    kh, vh = codec_round_trip(batch.fmt, k[: length - t], v[: length - t], torch.arange(length - t), batch.block_size)
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


@settings(max_examples=25, deadline=None)
@given(case=batch_cases())
def test_store_then_decode_is_the_codecs_round_trip(case):
    """Every stored token reads back as its codec round trip (raw rows bitwise; codes up to the rotation product's
    rounding, which depends on the batch shape); pages not written are untouched, padding slots (-1) store nothing."""
    batch = make_batch(case)
    cache = batch.empty_cache(case["seed"])
    before = cache.clone()
    n = batch.query.shape[0]
    store_reference(batch.fmt, batch.key, batch.value, cache, batch.slot_mapping)
    pages = page_view(cache)
    k, v = decode_pages(batch.fmt, pages, batch.block_size)  # (blocks, H, bs, D)
    slots = batch.slot_mapping[:n]
    blocks, offsets = slots // batch.block_size, slots % batch.block_size
    positions = torch.cat([torch.arange(int(L) - (int(e) - int(s)), int(L)) for L, s, e in
                           zip(batch.seq_lens, batch.query_start_loc[:-1], batch.query_start_loc[1:], strict=True)])
    want_k, want_v = codec_round_trip(batch.fmt, batch.key[:n], batch.value[:n], positions, batch.block_size)
    raw = offsets < batch.fmt.raw_rows(batch.block_size)
    for got, want in ((k[blocks, :, offsets], want_k), (v[blocks, :, offsets], want_v)):
        assert torch.equal(got[raw], want[raw])
        torch.testing.assert_close(got[~raw], want[~raw], atol=2e-6, rtol=2e-6)
    fmt, bs = batch.fmt, batch.block_size
    written = torch.zeros(page_view(cache).shape, dtype=torch.bool)  # every byte a stored token may own
    a = fmt.raw_rows(bs)
    for b, o in zip(blocks.tolist(), offsets.tolist(), strict=True):
        start = o * fmt.raw_row_bytes if o < a else a * fmt.raw_row_bytes + (o - a) * fmt.code_slot_bytes
        written[b, :, start: start + (fmt.raw_row_bytes if o < a else fmt.code_slot_bytes)] = True
    assert torch.equal(page_view(cache)[~written], page_view(before)[~written])

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
        store_reference(fmt, k, k, torch.zeros(2, 1, 16, 8, dtype=torch.uint8), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="uint8"):
        page_view(torch.zeros(2, 1, 16, 64))
