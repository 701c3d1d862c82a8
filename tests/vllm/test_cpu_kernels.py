"""The fused C++ kernels of the vLLM plugin against the reference (the spec) on random paged layouts: the store
bitwise (every byte of the cache), attention within the tolerances of ``flashcodec_fx.vllm.kernels``."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from _paged_cases import batch_cases, make_batch
from hypothesis import given, settings

from flashcodec_fx.vllm import kernels
from flashcodec_fx.vllm.reference import attention_reference, store_reference

# fp32: both accumulate in fp32 in different orders (the kernel folds the scale into q, its exp is a polynomial within
# 2 ulp); unit-scale data. fp16 / bf16: both round an fp32 result once: at most one ulp of the output apart.
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 1e-5}, torch.float16: {"atol": 1e-5, "rtol": 2.0**-10},
             torch.bfloat16: {"atol": 1e-5, "rtol": 2.0**-7}}


@pytest.fixture(scope="module")
def paged_kernels():
    """The compiled paged kernels (built once per machine). Skips only where no C++ compiler exists."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the vLLM plugin's kernels fall back to the reference")
    module = kernels.EXTENSION.module()
    assert module is not None, f"the vLLM plugin's CPU kernels failed to build: {kernels.EXTENSION.error}"
    return module


@pytest.fixture(autouse=True)
def _auto_kernels(monkeypatch):
    monkeypatch.setenv("FLASHCODEC_KERNELS", "fast")


@settings(max_examples=30, deadline=None)
@given(case=batch_cases())
def test_store_is_bitwise_the_reference(paged_kernels, case):
    """Every format, dtype, head count and dim, block size, anchor count; history and this call's tokens scattered
    over random pages of a cache of random bytes, padding slots: the two caches are equal byte for byte."""
    batch = make_batch(case)
    assert torch.equal(batch.filled_cache(case["seed"], kernels.paged_store), batch.filled_cache(case["seed"]))


@settings(max_examples=30, deadline=None)
@given(case=batch_cases())
def test_attention_matches_the_reference(paged_kernels, case):
    """Decodes and prefill chunks of different lengths in one batch (a request with no history, chunks longer than
    a page, chunks longer than FUSED_TOKENS: the tiled kernel), GQA groups 1-4, scattered block tables."""
    batch = make_batch(case)
    cache = batch.filled_cache(case["seed"])
    scale = batch.query.shape[-1] ** -0.5
    ref = attention_reference(batch.fmt, *batch.attention_args(cache), scale)
    out = torch.full_like(batch.query, float("nan"))
    kernels.paged_attention(batch.fmt, *batch.attention_args(cache), scale, None, out)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[batch.query.dtype])


@pytest.mark.parametrize("queries", [[1, 9, 4], [1, 40, 35]], ids=["per-token", "tiled"])
def test_attention_with_sinks_matches_the_reference(paged_kernels, queries):
    """Sink logits on both paths: the per-token kernel's, and the tiled one of chunks longer than FUSED_TOKENS."""
    batch = make_batch({"format": "3bit", "dtype": torch.float32, "heads": 2, "group": 3, "head_dim": 64,
                        "block_size": 16, "anchors": None, "contexts": [70, 20, 33], "queries": queries,
                        "padding": 1, "seed": 11})
    assert (max(queries) > kernels.FUSED_TOKENS) == (queries[1] == 40)
    cache = batch.filled_cache(11)
    s_aux = torch.linspace(-2, 3, 6)
    ref = attention_reference(batch.fmt, *batch.attention_args(cache), 0.2, s_aux)
    out = torch.empty_like(batch.query)
    kernels.paged_attention(batch.fmt, *batch.attention_args(cache), 0.2, s_aux, out)
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("fmt", "dtype", "head_dim"), [("3bit", torch.float32, 64), ("int8", torch.bfloat16, 128),
                                                        ("raw", torch.float32, 64), ("2bit", torch.float32, 40),
                                                        ("3bit-tcq", torch.float32, 64), ("2bit-tcq", torch.float16, 40)])
def test_long_chunks_match_the_reference(paged_kernels, threads, fmt, dtype, head_dim):
    """Chunks longer than the tiled kernel's tiles (own tokens over several key tiles, a history of several groups of
    pages, split among threads) beside a decode and a short chunk; head_dim 40 (not a multiple of
    PREFILL_DIM_MULTIPLE) runs every request in the per-token kernel; trellis pages in both (the tiled kernel decodes
    their history rows, the per-token kernel attends on their codes)."""
    batch = make_batch({"format": fmt, "dtype": dtype, "heads": 2, "group": 3, "head_dim": head_dim,
                        "block_size": 16, "anchors": None, "contexts": [1100, 37, 0, 5], "queries": [300, 1, 150, 20],
                        "padding": 2, "seed": 3})
    cache = batch.filled_cache(3)
    s_aux = torch.linspace(-1, 2, 6)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full_like(batch.query, float("nan"))
        kernels.paged_attention(batch.fmt, *batch.attention_args(cache), 0.125, s_aux, out)
    finally:
        torch.set_num_threads(before)
    ref = attention_reference(batch.fmt, *batch.attention_args(cache), 0.125, s_aux)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[dtype])


def test_strided_rows_as_vllm_passes_them(paged_kernels):
    """vLLM's key / value are column slices of the qkv projection (row stride > H * D); out a view of its buffer."""
    batch = make_batch({"format": "4bit", "dtype": torch.bfloat16, "heads": 3, "group": 3, "head_dim": 64,
                        "block_size": 32, "anchors": None, "contexts": [50, 7], "queries": [3, 1], "padding": 0,
                        "seed": 5})
    n, h, d = batch.key.shape
    qkv = torch.cat([batch.query.reshape(n, -1), batch.key.reshape(n, -1), batch.value.reshape(n, -1)], dim=1)
    q, k, v = qkv.split([3 * h * d, h * d, h * d], dim=1)
    q, k, v = q.view(n, 3 * h, d), k.view(n, h, d), v.view(n, h, d)
    assert not k.is_contiguous()
    cache = batch.empty_cache(5)
    history = batch.history_call()
    store_reference(batch.fmt, *batch.store_args(cache, history), "store")
    store_reference(batch.fmt, *batch.store_args(cache, history), "ring")
    meta = (batch.block_table, batch.seq_lens, batch.query_start_loc)
    kernels.paged_store(batch.fmt, k, v, cache, batch.slot_mapping, *meta)
    ref_cache = batch.filled_cache(5)
    assert torch.equal(cache, ref_cache)
    buffer = torch.zeros(n + 2, 3 * h * d, dtype=torch.bfloat16)
    out = buffer[:n].view(n, 3 * h, d)
    kernels.paged_attention(batch.fmt, q, k, v, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                            0.125, None, out)
    ref = attention_reference(batch.fmt, batch.query, batch.key, batch.value, ref_cache, batch.block_table,
                              batch.seq_lens, batch.query_start_loc, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[torch.bfloat16])
    assert torch.equal(buffer[n:], torch.zeros(2, 3 * h * d, dtype=torch.bfloat16))


def test_bad_arguments_are_refused_before_writing(paged_kernels):
    batch = make_batch({"format": "3bit", "dtype": torch.bfloat16, "heads": 2, "group": 1, "head_dim": 64,
                        "block_size": 16, "anchors": None, "contexts": [5], "queries": [2], "padding": 0, "seed": 1})
    cache = batch.empty_cache(1)
    before = cache.clone()
    meta = (batch.block_table, batch.seq_lens, batch.query_start_loc)
    with pytest.raises(ValueError, match="key must be"):
        kernels.paged_store(batch.fmt, batch.key.float(), batch.value, cache, batch.slot_mapping, *meta)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.paged_store(batch.fmt, batch.key, batch.value, cache, batch.slot_mapping[:1], *meta)
    with pytest.raises(ValueError, match="query must be"):
        kernels.paged_attention(batch.fmt, batch.query[:, :1, :32], batch.key, batch.value, cache, batch.block_table,
                                batch.seq_lens, batch.query_start_loc, 0.1, None, batch.query)
    assert torch.equal(cache, before)
