"""The memory-bound serving parts of bench_vllm.py: the cap, the engine settings, the rows and their table.

Many decode-heavy requests are submitted at once to an engine whose KV space holds only ``stock_seqs`` whole
sequences of stock vLLM's pages, the same bytes for every configuration: a preset's smaller pages fit more of them,
so more run at once, and a decode step (which reads every weight once, whatever the batch) serves more tokens. The
cap is ``kv_cache_memory_bytes``, which vLLM's CPU worker takes to the byte (``VLLM_CPU_KVCACHE_SPACE`` is whole GiB
and must be unset: the CPU platform turns it into ``kv_cache_memory_bytes``, overriding ours);
``num_gpu_blocks_override`` would give every configuration the same number of pages, whatever their size.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

BLOCK_SIZE = 128  # vLLM's CPU default page
LATENCIES = ("ttft", "tpot")  # time to first token, time per output token after the first (seconds)


def is_stock(row: dict[str, Any]) -> bool:
    """A configuration (or its row) of stock vLLM's pages in the model's dtype: no preset, no quantized KV cache
    dtype (bench_vllm's ``stock fp8`` is vLLM too, but not the baseline)."""
    return row.get("preset") is None and row.get("kv_cache_dtype") is None


def model_shape(folder: str) -> tuple[int, int, int]:
    """``(layers, KV heads, head_dim)`` of the model in ``folder`` (its config.json)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


def kv_cap_bytes(shape: tuple[int, int, int], dtype: torch.dtype, seq_tokens: int, stock_seqs: int,
                 block_size: int = BLOCK_SIZE) -> int:
    """Bytes of KV space that hold exactly ``stock_seqs`` whole sequences of ``seq_tokens`` tokens in stock vLLM's
    pages (K and V in ``dtype``, every layer), plus the one page vLLM keeps back (its null block)."""
    layers, kv_heads, head_dim = shape
    page = layers * kv_heads * block_size * 2 * head_dim * torch.empty((), dtype=dtype).element_size()
    return (stock_seqs * math.ceil(seq_tokens / block_size) + 1) * page


def engine_settings(dtype: str, seq_tokens: int, cap: int, max_seqs: int, batched_tokens: int) -> dict[str, Any]:
    """The engine's settings (``LLM`` keyword arguments), the same offline and served."""
    return {"dtype": dtype, "max_model_len": seq_tokens, "block_size": BLOCK_SIZE, "kv_cache_memory_bytes": cap,
            "max_num_seqs": max_seqs, "max_num_batched_tokens": batched_tokens}


def server_args(settings: dict[str, Any]) -> list[str]:
    """:func:`engine_settings` as the OpenAI server's command-line flags (eager, as the offline engine runs)."""
    args = ["--enforce-eager", "--seed", "0"]
    for key, value in settings.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    return args


def summary(values: list[float]) -> dict[str, float]:
    """Median and 90th percentile (linear interpolation between the sorted values)."""
    if not values:
        raise ValueError("values must hold at least one latency")
    ordered = sorted(values)
    position = 0.9 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return {"median": statistics.median(ordered),
            "p90": ordered[low] + (ordered[high] - ordered[low]) * (position - low)}


def load_row(config: dict[str, Any], load: dict[str, Any], blocks: int, seq_tokens: int,
             block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """One configuration's row from its load's figures (``vllm_engine.load`` or ``vllm_server.send_load``):
    output tokens/s, requests/s, TTFT and TPOT (median, p90), the most requests running, the preemptions, and its
    capacity (``blocks`` pages, one of them vLLM's null block: the whole sequences that fit)."""
    requests, seconds = load["requests"], load["seconds"]
    generated = sum(r["generated"] for r in requests)
    row = {"config": config["name"], "preset": config["preset"], "kv_cache_dtype": config.get("kv_cache_dtype"),
           "blocks": blocks, "kv_tokens": blocks * block_size,
           "sequences_fit": (blocks - 1) // math.ceil(seq_tokens / block_size), "seconds": seconds,
           "requests": len(requests), "output_tokens": generated, "output_tokens_per_s": generated / seconds,
           "requests_per_s": len(requests) / seconds, "max_running": load["max_running"],
           "preemptions": load["preemptions"]}
    for name in LATENCIES:
        stats = summary([r[name] for r in requests])
        row[f"{name}_median_s"], row[f"{name}_p90_s"] = stats["median"], stats["p90"]
    return row


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``vs_stock``: each row's output tokens/s over the mean of stock's runs (None without one), and its KV tokens
    over stock's (``capacity_vs_stock``)."""
    stock = [r for r in rows if is_stock(r) and "skipped" not in r]
    for row in rows:
        if "skipped" in row:
            continue
        row["vs_stock"] = row["output_tokens_per_s"] / statistics.mean(r["output_tokens_per_s"] for r in stock) \
            if stock else None
        row["capacity_vs_stock"] = row["kv_tokens"] / stock[0]["kv_tokens"] if stock else None
    return rows


COLUMNS = [("config", "config", "s"), ("KV tokens", "kv_tokens", ",d"), ("fit", "sequences_fit", "d"),
           ("most running", "max_running", "d"), ("preemptions", "preemptions", "d"),
           ("output tok/s", "output_tokens_per_s", ".1f"), ("vs stock", "vs_stock", ".2f"),
           ("req/s", "requests_per_s", ".3f"), ("TTFT median / p90 (s)", "ttft", "s"),
           ("TPOT median / p90 (ms)", "tpot", "s")]


def markdown(part: dict[str, Any], table: Any) -> str:
    """The part's table (``table(rows, columns)`` renders it); one line says the load it served."""
    rows = [{"config": r["config"], "ttft": f"skipped ({r['skipped'].strip().splitlines()[0][:120]})"}
            if "skipped" in r else
            {**r, "ttft": f"{r['ttft_median_s']:.1f} / {r['ttft_p90_s']:.1f}",
             "tpot": f"{1e3 * r['tpot_median_s']:.0f} / {1e3 * r['tpot_p90_s']:.0f}"} for r in part["rows"]]
    head = (f"{part['requests']} requests of {part['prompt_tokens']} prompt tokens + {part['output_tokens']} "
            f"generated, all at once; {part['dtype']}, KV space {part['kv_cache_bytes'] / 2**20:.1f} MiB "
            f"(stock fits {part['stock_seqs']} whole sequences).")
    return head + "\n\n" + table(rows, COLUMNS)
