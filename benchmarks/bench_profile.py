"""Where a decode step's time goes, per layer: the raw cache against the presets, eager (and compiled), profiled.

SmolLM2-135M (fp32, 30 layers), the cache filled with ``--contexts`` random K/V tokens per layer (as bench_e2e), then
``--steps`` greedy single-token steps under ``torch.profiler`` (CPU activities) after ``--warmup`` unprofiled ones,
one torch thread. Each configuration runs in its own subprocess. Per step and per layer (``/ layers``), from the
profiler's self CPU times and call counts of the operators it records:

- ``model_mm_ms``: the model's matrix products (``aten::mm`` / ``addmm`` / ``bmm`` / ``linear``): the same work in
  every configuration (weights, not cache);
- ``cache_ops_ms``: the cache's and attention's own operators (``flashcodec::*``; raw: ``aten::cat`` and the SDPA
  kernels) and their count per layer (``cache_op_calls_per_layer``);
- ``other_aten_ms``: every other recorded operator (norms, rotary, activations, copies, small host-side reads);
- ``untracked_ms``: the step's wall time minus all recorded operator self time: Python (the model's and the cache's),
  the dispatcher, the profiler's own overhead (a share that is the same per recorded op in every configuration);
- ``allocations_per_step``: calls of ``aten::empty`` / ``empty_strided`` / ``empty_like`` (tensor allocations the
  dispatcher sees).

Wall times under the profiler are inflated by its per-op overhead (unprofiled per-step times: bench_e2e.py); the
split and the counts are what this measures. -> ``results/profile_cpu.json``.

    python benchmarks/bench_profile.py                       # raw, int8, 4bit, 3bit; eager; 256 and 1024 tokens
    python benchmarks/bench_profile.py --configs eager_raw,eager_4bit,compiled_raw,compiled_4bit --contexts 1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

import torch
from common import write_result

from flashcodec_fx.threads import apply_threads

MM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"}
RAW_CACHE_OPS = {"aten::cat", "aten::_scaled_dot_product_flash_attention_for_cpu"}
ALLOCATIONS = {"aten::empty", "aten::empty_strided", "aten::empty_like"}
CONFIGS = ("eager_raw", "eager_int8", "eager_4bit", "eager_3bit", "compiled_raw", "compiled_int8", "compiled_4bit",
           "compiled_3bit")


def _cache(model, config: str, capacity: int):
    from transformers import DynamicCache, StaticCache

    from flashcodec_fx.hf import FlashCodecCache

    kind, preset = config.split("_", 1)
    if preset == "raw":
        return DynamicCache(config=model.config) if kind == "eager" else StaticCache(config=model.config,
                                                                                      max_cache_len=capacity)
    if kind == "eager":
        return FlashCodecCache.from_config(model.config, preset=preset)
    return FlashCodecCache.from_config(model.config, preset=preset, layout="static", max_cache_len=capacity,
                                       memoize=False)


def profile_one(config: str, context: int, steps: int, warmup: int) -> dict:
    """One configuration's profiled decode steps (see the module docstring)."""
    import flashcodec_fx as fx
    from flashcodec_fx.hf import apply_codec_attention
    from flashcodec_fx.pretrained import load_pretrained

    apply_threads(1)
    torch.manual_seed(0)
    model = load_pretrained(None)[0].float().eval()
    cfg = model.config
    layers, heads, dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    cache = _cache(model, config, context + warmup + steps + 8)
    codec = "raw" not in config
    with torch.no_grad():
        for idx in range(layers):
            cache.update(*[torch.randn(1, heads, context, dim) for _ in range(2)], idx)
            if codec and config.startswith("eager"):
                cache.layers[idx].attention_bound = True  # the fill stands for a prefill the kvcodec attention served
    step = model
    if config.startswith("compiled"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CompiledGenerateWarning: the steps call the wrapper
            chosen = fx.backend(strict=True) if codec else "inductor"
            step = torch.compile(model, fullgraph=True, backend=chosen)
    elif codec:
        apply_codec_attention(model)
    tok = torch.tensor([[42]])

    def decode(position: int) -> None:
        nonlocal tok
        out = step(input_ids=tok, position_ids=torch.tensor([[position]]), use_cache=True, past_key_values=cache)
        tok = out.logits[:, -1:].argmax(-1)

    with torch.no_grad():
        for i in range(warmup):
            decode(context + i)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for i in range(steps):
                decode(context + warmup + i)
            wall = time.perf_counter() - start
    return summarize(prof.key_averages(), config, context, steps, layers, wall)


def summarize(averages, config: str, context: int, steps: int, layers: int, wall: float) -> dict:
    """Per-step and per-layer split of the profiler's operator averages (self CPU microseconds, call counts)."""
    split = {"model_mm": 0.0, "cache_ops": 0.0, "other_aten": 0.0}
    cache_calls, allocations, recorded, ops = 0, 0, 0.0, {}
    for event in averages:
        if event.key.startswith(("ProfilerStep", "Torch-Compiled", "## Call", "TorchDynamo", "Pregraph", "AOTDispatcher")):
            recorded += event.self_cpu_time_total
            continue
        if not event.key.startswith(("aten::", "flashcodec::")):
            continue
        self_us = event.self_cpu_time_total
        recorded += self_us
        if event.key in MM_OPS:
            split["model_mm"] += self_us
        elif event.key.startswith("flashcodec::") or ("raw" in config and event.key in RAW_CACHE_OPS):
            split["cache_ops"] += self_us
            cache_calls += event.count
            ops[event.key] = {"calls_per_step": event.count / steps, "us_per_call": round(self_us / event.count, 2)}
        else:
            split["other_aten"] += self_us
        if event.key in ALLOCATIONS:
            allocations += event.count
    step_ms = wall * 1e3 / steps
    row = {"config": config, "context": context, "steps": steps, "layers": layers, "threads": 1,
           "step_ms_profiled": round(step_ms, 3),
           "untracked_ms": round(step_ms - recorded / 1e3 / steps, 3),
           "cache_op_calls_per_layer": round(cache_calls / steps / layers, 2),
           "allocations_per_step": round(allocations / steps, 1), "cache_ops": ops,
           "load_avg_after": list(os.getloadavg())}
    for name, total in split.items():
        row[f"{name}_ms"] = round(total / 1e3 / steps, 3)
        row[f"{name}_us_per_layer"] = round(total / steps / layers, 2)
    row["untracked_us_per_layer"] = round(row["untracked_ms"] * 1e3 / layers, 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="eager_raw,eager_int8,eager_4bit,eager_3bit",
                        help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--run", nargs=2, metavar=("CONFIG", "CONTEXT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print("ROW " + json.dumps(profile_one(args.run[0], int(args.run[1]), args.steps, args.warmup)), flush=True)
        return
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise ValueError(f"--configs: unknown {unknown}; allowed: {list(CONFIGS)}")
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        for config in configs:
            load = list(os.getloadavg())
            proc = subprocess.run([sys.executable, __file__, "--run", config, str(context), "--steps", str(args.steps),
                                   "--warmup", str(args.warmup)], capture_output=True, text=True)
            found = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
            row = found[0] if found else {"config": config, "context": context, "error": proc.stderr[-2000:]}
            row["load_avg_before"] = load
            rows.append(row)
            print({k: row.get(k) for k in ("config", "context", "step_ms_profiled", "model_mm_ms", "cache_ops_ms",
                                            "other_aten_ms", "untracked_ms", "cache_op_calls_per_layer",
                                            "allocations_per_step", "error")}, flush=True)
    write_result("profile_cpu", {"model": "smollm2", "dtype": "float32", "batch": 1, "rows": rows}, out=args.out)


if __name__ == "__main__":
    main()
