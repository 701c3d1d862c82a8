"""benchmarks/bench_vllm_pages.py models bench_vllm's quality protocol: on a tiny Llama, its ring format gives what the
pages' reference store and attention give when a window is read chunk by chunk, as vLLM reads it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import bench_vllm_pages  # noqa: E402
from conftest import fresh_tiny_model, tiny_prompt  # noqa: E402

from flashcodec_fx.evaluate import token_kl  # noqa: E402
from flashcodec_fx.vllm.page import page_format  # noqa: E402
from flashcodec_fx.vllm.reference import attention_reference, store_reference  # noqa: E402

LENGTH, BLOCK = 52, 8


class ChunkedPages:
    """The attention function: each layer's keys and values stored into pages call by call (store, attention on the
    pages, ring), one sequence at a time, through ``flashcodec_fx.vllm.reference``."""

    def __init__(self, preset: str, chunk: int):
        self.preset, self.chunk = preset, chunk

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        b, hq, length, d = query.shape
        heads = key.shape[1]
        fmt = page_format(self.preset, module.layer_idx, d, torch.float32)
        pages = -(-length // BLOCK)
        table = torch.randperm(pages, generator=torch.Generator().manual_seed(module.layer_idx)).to(torch.int32)[None]
        out = torch.empty(b, length, hq, d)
        for i in range(b):
            cache = torch.zeros(pages, heads, BLOCK, fmt.state_content_bytes(BLOCK), dtype=torch.uint8)
            for s in range(0, length, self.chunk):
                e = min(s + self.chunk, length)
                pos = torch.arange(s, e)
                slots = table[0, pos // BLOCK].long() * BLOCK + pos % BLOCK
                meta = (table, torch.tensor([e], dtype=torch.int32), torch.tensor([0, e - s], dtype=torch.int32))
                k, v = key[i, :, s:e].transpose(0, 1), value[i, :, s:e].transpose(0, 1)
                store_reference(fmt, k, v, cache, slots, *meta, "store")
                out[i, s:e] = attention_reference(fmt, query[i, :, s:e].transpose(0, 1), k, v, cache, *meta,
                                                  scaling)
                store_reference(fmt, k, v, cache, slots, *meta, "ring")
        return out, None


@pytest.mark.parametrize(("preset", "chunk"), [("3bit", 6), ("2bit", 5)])
def test_the_ring_format_is_what_the_reference_pages_give(preset, chunk):
    """Calls of 6 (every call that reaches a page's last rows completes it) and of 5 (calls store a page's last rows
    before it is complete, and some complete pages their history filled partly)."""
    model = fresh_tiny_model("llama")
    ids = tiny_prompt(2, LENGTH)
    ref = bench_vllm_pages.logprobs(model, ids, bench_vllm_pages.FakeQuant(None, chunk, chunk), chunk)
    tier = bench_vllm_pages.PageTier("t", preset, block_size=BLOCK, layout="ring", center=True)
    fake = bench_vllm_pages.logprobs(model, ids, bench_vllm_pages.FakePages(tier, chunk), chunk)
    paged = bench_vllm_pages.logprobs(model, ids, ChunkedPages(preset, chunk), chunk)
    want, got = float(token_kl(ref, paged).mean()), float(token_kl(ref, fake).mean())
    assert want > 1e-6 and got == pytest.approx(want, rel=0.01), (got, want)
    torch.testing.assert_close(fake, paged, atol=1e-4, rtol=0)  # (1e-6 seen: the same codes)


def test_a_raw_window_of_every_token_is_the_raw_cache():
    model = fresh_tiny_model("llama")
    ids = tiny_prompt(2, LENGTH)
    ref = bench_vllm_pages.logprobs(model, ids, bench_vllm_pages.FakeQuant(None, 6, 6), 6)
    for window in [(LENGTH, LENGTH), (0, 0)]:
        tier = bench_vllm_pages.PageTier("t", "2bit", block_size=BLOCK, window=window)
        kl = float(token_kl(ref, bench_vllm_pages.logprobs(model, ids, bench_vllm_pages.FakePages(tier, 6), 6)).mean())
        assert (kl < 1e-6) == (window[0] == LENGTH), (window, kl)


def test_bits_count_what_a_request_holds():
    tier = bench_vllm_pages.PageTier("t", "3bit")
    assert tier.bits(1024) == pytest.approx(page_format("3bit", 0, 64, torch.bfloat16).bits_per_value(128))
    windowed = bench_vllm_pages.PageTier("t", "3bit", window=(8, 8))
    assert windowed.bits(1024) - tier.bits(1024) == pytest.approx(16 * 16 / (2 * 1024))
    with pytest.raises(ValueError, match="layout must be one of"):
        bench_vllm_pages.PageTier("t", "3bit", layout="tail")


def test_the_table_shows_a_twin_without_page_bits():
    rows = [{"tier": "raw", "bits": 16.0, "kl": 0.0, "ppl": 20.0, "delta_ppl": 0.0},
            {"tier": "3bit twin", "bits": None, "kl": 0.05, "ppl": 21.0, "delta_ppl": 1.0}]
    table = bench_vllm_pages.markdown({"rows": rows})
    assert "| 3bit twin | - | 5.00e-02 | 21.000 | +1.000 |" in table
