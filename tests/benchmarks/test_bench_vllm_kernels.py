"""benchmarks/bench_vllm_kernels.py on a small call (two requests: a decode and a prefill chunk with history): rows
per configuration with both ops timed, ratios to SDPA, and the bench's pages as the reference store fills them."""

from __future__ import annotations

import bench_vllm_kernels as bench
import torch

from flashcodec_fx.vllm.page import page_format
from flashcodec_fx.vllm.reference import store_reference


def test_rows_per_configuration(monkeypatch):
    monkeypatch.setitem(bench.CALLS, "tiny", [(1, 200), (40, 130)])
    rows = bench.bench_call("tiny", ["3bit"], None, repeats=1)
    assert [r["config"] for r in rows] == ["sdpa", "3bit"]
    sdpa, coded = rows
    assert "store_ms" not in sdpa and coded["store_ms"] > 0 and coded["attention_ms"] > 0
    assert coded["vs_sdpa"] == coded["attention_ms"] / sdpa["attention_ms"] and "vs_stock" not in coded
    assert coded["tokens"] == 41 and "| tiny | 3bit |" in bench.markdown(rows)


def test_the_bench_fills_the_pages_as_the_reference_store_does():
    call = bench.Call([(1, 200), (40, 130)])
    fmt = page_format("3bit", bench.LAYER, bench.HEAD_DIM, torch.float32)
    ref = torch.zeros_like(bench.filled_pages(call, fmt))
    history = (call.block_table, call.seq_lens - torch.tensor([1, 40], dtype=torch.int32), call.hist_starts)
    for phase in ("store", "ring"):
        store_reference(fmt, call.hist_k, call.hist_v, ref, call.hist_slots, *history, phase)
    store_reference(fmt, call.key, call.value, ref, call.slots, call.block_table, call.seq_lens, call.query_start_loc,
                    "store")
    assert torch.equal(bench.filled_pages(call, fmt), ref)
    assert call.hist_starts.tolist() == [0, 200, 330] and call.query_start_loc.tolist() == [0, 1, 41]


def test_the_batch_steps_are_the_throughput_batchs_prefill_as_vllm_schedules_it():
    """Steps of 4,096 tokens (vLLM's budget); their prompt chunks are the batch's prompts but for the last prompt's
    last 14 tokens (scheduled beside the next decodes), and a chunk's history is where its prompt stopped."""
    batch = 8
    lengths = [1024 + (4096 - 1024) * i // (batch - 1) for i in range(batch)]  # bench_vllm.throughput's prompts
    assert [sum(t for t, _ in step) for step in bench.BATCH_STEPS] == [4096] * 5
    chunks = [(t, c) for step in bench.BATCH_STEPS for t, c in step if t > 1]
    assert sum(t for t, _ in chunks) + 14 == sum(lengths)
    starts = {c + t for t, c in chunks}  # where each chunk leaves its prompt
    assert all(c == 0 or c in starts for _, c in chunks)
    assert all(bench.CALLS[f"batch step {i + 1}"] == step for i, step in enumerate(bench.BATCH_STEPS))
