"""The vLLM plugin's store and attention ops vs stock vLLM's CPU kernels, one layer, prefill / decode / mixed calls.

    python benchmarks/bench_vllm_kernels.py                     # -> results/vllm_kernels.json
    .venv-vllm/bin/python benchmarks/bench_vllm_kernels.py      # the same, stock vLLM's kernels side by side

SmolLM2-135M's attention layer (9 query heads, 3 KV heads, head_dim 64), fp32, 128-token pages (vLLM's CPU
default), ``--threads`` (1). A *call* is what one vLLM forward hands a layer: requests given by ``(tokens in the
call, history)``, their pages scattered over one cache (``batch step k``: the prefill steps of ``bench_vllm.py``'s
throughput batch, ``BATCH_STEPS``). Per call and configuration, timed in interleaved rounds
(each round runs every configuration once), medians of the process's CPU time (steadier than wall time on a shared
machine; both are kept):

- ``store``: this call's K and V into the pages (``kernels.paged_store``, both phases: before attention and the
  rings after it; stock: ``cpu_attn_reshape_and_cache``);
- ``attention``: the call's queries over history and own tokens (``kernels.paged_attention``; stock:
  ``cpu_attention_with_kv_cache`` with the metadata its builder makes: ``cpu_attn_get_scheduler_metadata``);
- ``sdpa`` (attention only): torch's SDPA on the raw K/V of each request, masked where the request has history
  (what a model without a paged cache runs).

Configurations: ``stock`` (only where vLLM's CPU build imports: the vLLM venv), ``sdpa``, and each preset of
``--presets``. ``vs_stock`` divides a configuration's store + attention time by stock's (``vs_sdpa``: attention by
SDPA's). The offline throughput part of ``bench_vllm.py`` times the whole model; this one says where a layer's time
goes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from common import write_result

from flashcodec_fx.vllm import kernels
from flashcodec_fx.vllm.config import VLLM_PRESETS
from flashcodec_fx.vllm.page import PHASES, PageFormat, page_format, store_plan

HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 128  # SmolLM2-135M's layer, vLLM's CPU page size
SCALE = HEAD_DIM**-0.5
LAYER = 5  # the layer whose rotation seeds the presets' codes
# name -> requests (tokens in the call, history): decode steps, prefill chunks, a mixed step
CALLS = {
    "decode 8 x 1 (1k-4k)": [(1, 1024 + 438 * i) for i in range(8)],
    "prefill 512 (0)": [(512, 0)],
    "prefill 512 (2k)": [(512, 2048)],
    "prefill 2048 (0)": [(2048, 0)],
    "prefill 2048 (2k)": [(2048, 2048)],
    "mixed 4 x 1 (2k) + 1024 (1k)": [(1, 2048)] * 4 + [(1024, 1024)],
}
# The five prefill steps of bench_vllm.py's throughput batch (8 prompts of 1,024-4,096 tokens) as vLLM 0.32's
# scheduler makes them (4,096 tokens a step: whole prompts, chunks of the next one over their history, and the
# decodes of the prompts already done), as the engine hands them to every layer.
BATCH_STEPS = [
    [(1024, 0), (1462, 0), (1610, 0)],
    [(1, 1024), (1, 1462), (291, 1610), (2340, 0), (1463, 0)],
    [(1, 1025), (1, 1463), (1, 1901), (1, 2340), (1316, 1463), (2776, 0)],
    [(1, 1026), (1, 1464), (1, 1902), (1, 2341), (1, 2779), (442, 2776), (3649, 0)],
    [(1, 1027), (1, 1465), (1, 1903), (1, 2342), (1, 2780), (1, 3218), (8, 3649), (4082, 0)],
]
CALLS.update({f"batch step {i + 1}": step for i, step in enumerate(BATCH_STEPS)})
QUICK = ("decode 8 x 1 (1k-4k)", "prefill 512 (0)", "prefill 512 (2k)", "mixed 4 x 1 (2k) + 1024 (1k)")


def stock_ops() -> Any:
    """vLLM's CPU ops module, or None where vLLM's CPU build does not import."""
    try:
        from vllm import _custom_ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    _custom_ops.isa = _get_attn_isa(torch.float32, BLOCK, HEAD_DIM)
    return _custom_ops


class Call:
    """One call's tensors: ``query (N, 9, 64)``, ``key`` / ``value (N, 3, 64)`` (this call's tokens),
    ``hist_k`` / ``hist_v`` and slots of every request's history, block table, ``seq_lens``, ``query_start_loc``;
    every request's full raw K / V for SDPA."""

    def __init__(self, requests: list[tuple[int, int]], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        lengths = [t + c for t, c in requests]
        need = [-(-n // BLOCK) for n in lengths]
        self.num_blocks = sum(need)
        physical = torch.randperm(self.num_blocks, generator=gen).to(torch.int32)
        self.block_table = torch.zeros(len(requests), max(need), dtype=torch.int32)
        used = 0
        for r, n in enumerate(need):
            self.block_table[r, :n] = physical[used: used + n]
            used += n
        self.keys = [torch.randn(n, HEADS, HEAD_DIM, generator=gen) for n in lengths]
        self.values = [torch.randn(n, HEADS, HEAD_DIM, generator=gen) for n in lengths]
        self.requests = requests
        slots = [self.block_table[r, torch.arange(n) // BLOCK].long() * BLOCK + torch.arange(n) % BLOCK
                 for r, n in enumerate(lengths)]
        self.hist_k = torch.cat([k[:c] for k, (_, c) in zip(self.keys, requests, strict=True)])
        self.hist_v = torch.cat([v[:c] for v, (_, c) in zip(self.values, requests, strict=True)])
        self.hist_slots = torch.cat([s[:c] for s, (_, c) in zip(slots, requests, strict=True)])
        self.hist_starts = torch.tensor([0] + [sum(c for _, c in requests[: r + 1]) for r in range(len(requests))],
                                        dtype=torch.int32)
        self.key = torch.cat([k[c:] for k, (_, c) in zip(self.keys, requests, strict=True)])
        self.value = torch.cat([v[c:] for v, (_, c) in zip(self.values, requests, strict=True)])
        self.slots = torch.cat([s[c:] for s, (_, c) in zip(slots, requests, strict=True)])
        self.query = torch.randn(self.key.shape[0], HEADS * GROUP, HEAD_DIM, generator=gen)
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32)
        starts = [0]
        for t, _ in requests:
            starts.append(starts[-1] + t)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32)
        self.max_query_len = max(t for t, _ in requests)


def filled_pages(call: Call, fmt: PageFormat) -> torch.Tensor:
    """Pages of ``fmt`` holding the call's history as earlier steps left them and its own tokens as the store
    before attention leaves them."""
    cache = torch.zeros(call.num_blocks, HEADS, BLOCK, fmt.state_content_bytes(BLOCK), dtype=torch.uint8)
    history = (call.block_table, call.seq_lens - (call.query_start_loc[1:] - call.query_start_loc[:-1]),
               call.hist_starts)
    for phase in PHASES:
        kernels.paged_store(fmt, call.hist_k, call.hist_v, cache, call.hist_slots, *history, phase)
    kernels.paged_store(fmt, call.key, call.value, cache, call.slots, call.block_table, call.seq_lens,
                        call.query_start_loc, "store")
    return cache


def plugin_paths(call: Call, preset: str) -> dict[str, Any]:
    """``{"store": fn, "attention": fn}`` of a preset on a cache holding the call's history. ``store``: both phases
    of the call's store (before attention, and the rings after it) with their plans made once (vLLM's impl makes them
    once per step for every layer)."""
    fmt = page_format(preset, LAYER, HEAD_DIM, torch.float32)
    cache = filled_pages(call, fmt)
    meta = (call.block_table, call.seq_lens, call.query_start_loc)
    plans = {phase: store_plan(fmt, BLOCK, call.slots, *meta, phase) for phase in PHASES}
    out = torch.empty_like(call.query)

    def store() -> None:
        for phase in PHASES:
            kernels.paged_store(fmt, call.key, call.value, cache, call.slots, *meta, phase, plans[phase])

    def attention() -> None:
        kernels.paged_attention(fmt, call.query, call.key, call.value, cache, call.block_table, call.seq_lens,
                                call.query_start_loc, SCALE, None, out, call.max_query_len)

    return {"store": store, "attention": attention}


def stock_paths(call: Call, ops: Any) -> dict[str, Any]:
    """Stock vLLM's CPU store and attention on raw fp32 pages ``(blocks, H, block, 2 D)``."""
    cache = torch.zeros(call.num_blocks, HEADS, BLOCK, 2 * HEAD_DIM)
    key_cache, value_cache = cache.view(call.num_blocks, HEADS, 2 * BLOCK, HEAD_DIM).chunk(2, dim=2)

    def store(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, ops.isa)

    store(call.hist_k, call.hist_v, call.hist_slots)
    store(call.key, call.value, call.slots)
    out = torch.empty_like(call.query)

    def attention() -> None:
        meta = ops.cpu_attn_get_scheduler_metadata(len(call.requests), HEADS * GROUP, HEADS, HEAD_DIM, call.seq_lens,
                                                   torch.float32, call.query_start_loc, True, -1, ops.isa, False)
        ops.cpu_attention_with_kv_cache(call.query, key_cache, value_cache, out, call.query_start_loc, call.seq_lens,
                                        SCALE, True, None, -1, call.block_table, 0.0, meta, None)

    return {"store": lambda: store(call.key, call.value, call.slots), "attention": attention}


def sdpa_paths(call: Call) -> dict[str, Any]:
    """Per request: SDPA over its raw K / V (causal, masked where it has history), GQA by ``enable_gqa``."""
    inputs = []
    start = 0
    for (t, c), k, v in zip(call.requests, call.keys, call.values, strict=True):
        q = call.query[start: start + t].transpose(0, 1)[None]
        mask = torch.arange(t + c)[None, :] <= c + torch.arange(t)[:, None] if c and t > 1 else None
        inputs.append((q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, c == 0 and t > 1))
        start += t

    def attention() -> None:
        for q, k, v, mask, causal in inputs:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=SCALE,
                                                             enable_gqa=True)

    return {"attention": attention}


def bench_call(name: str, presets: list[str], ops: Any, repeats: int) -> list[dict[str, Any]]:
    call = Call(CALLS[name])
    configs = {"sdpa": sdpa_paths(call)}
    if ops is not None:
        configs["stock"] = stock_paths(call, ops)
    configs.update({p: plugin_paths(call, p) for p in presets})
    times: dict[tuple[str, str], dict[str, list[float]]] = {}
    for round_ in range(repeats + 1):  # round 0 warms up
        for config, paths in configs.items():
            for op, fn in paths.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                fn()
                wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
                if round_:
                    entry = times.setdefault((config, op), {"wall": [], "cpu": []})
                    entry["wall"].append(wall)
                    entry["cpu"].append(cpu)
    rows = []
    for config, paths in configs.items():
        row: dict[str, Any] = {"call": name, "requests": CALLS[name], "tokens": int(call.query.shape[0]),
                               "config": config}
        for op in paths:
            row[f"{op}_ms"] = 1e3 * statistics.median(times[config, op]["cpu"])
            row[f"{op}_wall_ms"] = 1e3 * statistics.median(times[config, op]["wall"])
        rows.append(row)
    by_config = {r["config"]: r for r in rows}
    for row in rows:
        row["vs_sdpa"] = row["attention_ms"] / by_config["sdpa"]["attention_ms"]
        if "stock" in by_config and "store_ms" in row:
            stock = by_config["stock"]
            row["vs_stock"] = (row["store_ms"] + row["attention_ms"]) / (stock["store_ms"] + stock["attention_ms"])
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| call | config | store ms | attention ms | vs SDPA (attention) | vs stock (store + attention) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        store = f"{r['store_ms']:.2f}" if "store_ms" in r else ""
        stock = f"{r['vs_stock']:.2f}x" if "vs_stock" in r else ""
        lines.append(f"| {r['call']} | {r['config']} | {store} | {r['attention_ms']:.2f} | {r['vs_sdpa']:.2f}x | "
                     f"{stock} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(VLLM_PRESETS), choices=VLLM_PRESETS)
    parser.add_argument("--calls", nargs="+", choices=list(CALLS), help="the calls timed (default: all)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds (after one warm-up round)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/vllm_kernels.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops = stock_ops()
    calls = args.calls or (list(QUICK) if args.quick else list(CALLS))
    rows = []
    with torch.inference_mode():
        kernels.build_kernels()
        for name in calls:
            rows += bench_call(name, args.presets, ops, args.repeats)
            print(markdown([r for r in rows if r["call"] == name]), flush=True)
    path = write_result("vllm_kernels", {"config": {**vars(args), "calls": calls, "stock": ops is not None,
                                                    "shape": {"heads_q": HEADS * GROUP, "heads_kv": HEADS,
                                                              "head_dim": HEAD_DIM, "block_size": BLOCK,
                                                              "dtype": "float32"}},
                                         "rows": rows}, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
