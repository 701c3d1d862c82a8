"""End-to-end decode, eager and compiled: raw transformers caches vs the codec cache (and a peer), tok/s and bytes.

For each model, context length and configuration, one subprocess (clean memory figures), ``--threads`` torch threads
(2; ``auto``: the CLI's policy, ``flashcodec_fx/threads.py``, decided in each subprocess):
- the cache is filled with ``context`` random K/V states per layer (prefill cost is not measured; decode cost depends
  on how many tokens are stored, not on their values); greedy single-token steps follow, timed one by one after one
  untimed step (per-step latency median / p90, tok/s = 1 / median);
- compiled configurations run the steps through ``torch.compile(model, fullgraph=True)`` (the first step compiles:
  ``compile_s``; recompiles after it are counted, Dynamo's ``unique_graphs``), on a static cache of capacity
  ``context + new_tokens + 8``;
- memory: process RSS sampled every 0.5 ms by a thread: ``rss_before_decode`` (after the first step),
  ``peak_decode`` (max during the timed steps) and ``steady`` (after them); their deltas show what a step allocates
  on top of the cache. ``kv_bytes``: every byte the cache holds (raw: K and V buffers; codec: archive + scales +
  tail + workspace-free, no memo; quanto: its packed tensors and raw residual) and ``raw_equivalent`` (the stored
  tokens uncompressed). ``view_bytes_per_step``: the K+V view a materialized step builds per layer (from shapes).

Configurations:
- eager (the model as a user runs it, ``attn_implementation="sdpa"``): ``eager_raw`` (transformers
  ``DynamicCache``), ``eager_codec`` (``FlashCodecCache.from_config(config)`` without options: the default preset,
  attention on the stored form through the ``"kvcodec"`` attention function, no memo), ``eager_<preset>`` for each
  lossy preset (``FlashCodecCache.from_config(config, preset=...)``, the same attention), ``eager_quanto``
  (transformers ``QuantizedCache("quanto")`` int4, its defaults: per-token groups of 64, 128 raw tokens; it
  dequantizes its whole history every step);
- compiled: ``raw`` (transformers StaticCache, backend inductor), ``codec_materialized`` (FlashCodecCache static,
  memoize=False, backend inductor: SDPA over ``flashcodec::read`` views), ``codec_pass`` (same cache, backend
  flashcodec, strict: attention on the stored state). Codec tier of the compiled rows: jpeg r=8, all coefficients,
  int8 (the cache's default, not the "int8" preset);
- compiled beside eager, in the eager configurations' interleaved rounds (so that the compiled / eager ratio shares
  the machine's conditions): ``compiled_raw`` (StaticCache, backend inductor) and ``compiled_<preset>`` for each lossy
  preset (``FlashCodecCache.from_config(config, preset=..., layout="static", memoize=False)``, backend flashcodec,
  strict: attention on the stored state); the untimed first round compiles them.

    python benchmarks/bench_e2e.py --models smollm2 --configs eager_raw,eager_int8,eager_4bit,eager_3bit,eager_2.5bit \
        --contexts 4096,16384 --new-tokens 6 --threads 1 --out benchmarks/results/e2e_cpu_eager_1thread.json
    python benchmarks/bench_e2e.py ... --neighbours none,python,omp   # the same decode next to CPU-burning processes
    python benchmarks/bench_e2e.py --models smollm2 --configs raw,codec_pass --contexts 1024,4096 --new-tokens 12 \
        --out benchmarks/results/e2e_cpu_compiled.json
    python benchmarks/bench_e2e.py --quick            # llama-rand (SmolLM2 attention geometry, 2 layers, vocab 8192), 1k/4k/16k
    python benchmarks/bench_e2e.py --device cuda --mode reduce-overhead   # bf16 on the GPU, CUDA graphs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import warnings

import torch
from common import NEIGHBOURS, add_threads_argument, neighbour, write_result

from flashcodec_fx import PRESETS
from flashcodec_fx.evaluate.storage import cache_bytes
from flashcodec_fx.threads import apply_threads

COMPILED = ("raw", "codec_materialized", "codec_pass")
EAGER_PRESETS = {f"eager_{name}": name for name in PRESETS if name != "lossless"}
COMPILED_PRESETS = {f"compiled_{name}": name for name in PRESETS if name != "lossless"}
EAGER = ("eager_raw", "eager_codec", "eager_quanto", *EAGER_PRESETS, "compiled_raw", *COMPILED_PRESETS)
EAGER_CODEC = ("eager_codec", *EAGER_PRESETS)  # attention on the stored form
CONFIGS = COMPILED + EAGER
MODELS = {"smollm2": None, "gemma3": "gemma-3-270m"}  # load_pretrained names; llama-rand: random weights
TIER = dict(mode="jpeg", block_size=8, quant_bits=8)
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class RSSSampler(threading.Thread):
    """Max RSS seen while running (0.5 ms period)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = _rss(), True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, _rss())
            time.sleep(0.0005)

    def stop(self) -> int:
        self.running = False
        self.join()
        return self.peak


def _model(name: str):
    import transformers

    if name in MODELS:
        from flashcodec_fx.pretrained import load_pretrained

        return load_pretrained(MODELS[name])[0]
    # SmolLM2-135M's attention geometry (9 query / 3 KV heads, head_dim 64, hidden 576), 2 layers, random weights,
    # a small vocabulary (8192) so that the lm head does not hide the attention cost.
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                      max_position_embeddings=65536, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _cache(model, config: str, capacity: int):
    from transformers import DynamicCache, QuantizedCache
    from transformers.cache_utils import StaticCache

    from flashcodec_fx.hf import FlashCodecCache

    if config in ("raw", "compiled_raw"):
        return StaticCache(config=model.config, max_cache_len=capacity)
    if config == "eager_raw":
        return DynamicCache(config=model.config)
    if config == "eager_codec":
        return FlashCodecCache.from_config(model.config)  # the defaults: what a user gets
    if config in EAGER_PRESETS:
        return FlashCodecCache.from_config(model.config, preset=EAGER_PRESETS[config])
    if config in COMPILED_PRESETS:
        return FlashCodecCache.from_config(model.config, preset=COMPILED_PRESETS[config], layout="static",
                                           max_cache_len=capacity, memoize=False)
    if config == "eager_quanto":
        return QuantizedCache("quanto", model.config, nbits=4)
    return FlashCodecCache.from_config(model.config, layout="static", max_cache_len=capacity, memoize=False, **TIER)


def _kv_bytes(cache, config: str, raw_equivalent: int) -> dict:
    """Bytes the cache holds (``total``) next to the stored tokens' fp32 K and V (``raw_equivalent``)."""
    if config in ("raw", "compiled_raw"):
        total = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        return {"total": total, "raw_equivalent": raw_equivalent}
    if config in ("eager_raw", "eager_quanto"):  # DynamicCache: exactly its tokens; quanto: packed + residual
        return {"total": cache_bytes(cache)["held"], "raw_equivalent": raw_equivalent}
    parts: dict[str, int] = {}
    for layer in cache.layers:
        for key, value in layer.storage_breakdown().items():
            parts[key] = parts.get(key, 0) + value
    return parts


def run_one(model_name: str, config: str, context: int, new_tokens: int, device: str = "cpu",
            mode: str | None = None, threads: str | int | None = None) -> dict:
    import flashcodec_fx as fx
    from flashcodec_fx.hf import FlashCodecCache  # noqa: F401  (registers the layer types)

    if threads:
        apply_threads(threads)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = _model(model_name).to(device=device, dtype=dtype)
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    capacity = context + new_tokens + 8
    cache = _cache(model, config, capacity)
    with torch.no_grad():
        for idx in range(cfg.num_hidden_layers):
            kv = [torch.randn(1, heads, context, dim, device=device, dtype=dtype) for _ in range(2)]
            cache.update(*kv, idx)
    if config == "codec_pass":
        step = torch.compile(model, fullgraph=True, backend=fx.backend(strict=True, mode=mode))
    else:
        step = torch.compile(model, backend="inductor", fullgraph=True, mode=mode)
    name = "cache" if "cache" in model.forward.__code__.co_varnames else "past_key_values"
    tok = torch.tensor([[42]], device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def decode(pos: int):
        out = step(input_ids=tok, position_ids=torch.tensor([[pos]], device=device), use_cache=True, **{name: cache})
        token = out.logits[:, -1:].argmax(-1)
        sync()
        return token

    counters = torch._dynamo.utils.counters["stats"]
    with torch.no_grad():
        start = time.perf_counter()
        tok = decode(context)
        compile_s = time.perf_counter() - start
        graphs = counters["unique_graphs"]
        rss_before = _rss()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            cuda_before = torch.cuda.memory_allocated()
        sampler = RSSSampler()
        sampler.start()
        times, tokens = [], []
        for i in range(new_tokens):
            start = time.perf_counter()
            tok = decode(context + 1 + i)
            times.append(time.perf_counter() - start)
            tokens.append(int(tok))
        peak = sampler.stop()
        steady = _rss()
    median = statistics.median(times)
    item = torch.empty((), dtype=dtype).element_size()
    raw_equivalent = 2 * cfg.num_hidden_layers * heads * (context + 1 + new_tokens) * dim * item
    view = 0 if config != "codec_materialized" else 2 * heads * capacity * dim * item * cfg.num_hidden_layers
    cuda = {} if device != "cuda" else {
        "cuda_allocated_before_decode_mb": round(cuda_before / 2**20, 1),
        "cuda_peak_delta_decode_mb": round((torch.cuda.max_memory_allocated() - cuda_before) / 2**20, 2)}
    return {"model": model_name, "config": config, "context": context, "new_tokens": new_tokens, "device": device,
            "dtype": str(dtype), "mode": mode, "threads": torch.get_num_threads(), **cuda,
            "capacity": capacity, "layers": cfg.num_hidden_layers, "kv_heads": heads, "head_dim": dim,
            "compile_s": round(compile_s, 2),
            "step_ms_median": round(median * 1e3, 3), "step_ms_min": round(min(times) * 1e3, 3),
            "step_ms_p90": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e3, 3),
            "tok_per_s": round(1.0 / median, 2), "recompiles": counters["unique_graphs"] - graphs,
            "rss_before_decode_mb": round(rss_before / 2**20, 1), "rss_peak_decode_mb": round(peak / 2**20, 1),
            "rss_steady_mb": round(steady / 2**20, 1), "decode_peak_delta_mb": round((peak - rss_before) / 2**20, 2),
            "process_max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10, 1),
            "kv_bytes": _kv_bytes(cache, config, raw_equivalent), "view_bytes_per_step": view, "tokens": tokens}


def run_eager(model_name: str, configs: list[str], context: int, new_tokens: int, threads: str | int,
              neighbour_kind: str = "none") -> list[dict]:
    """The eager configurations (and the compiled ones beside them) on one model in one process, their steps
    interleaved (a round times one step of each), so that their ratios share the machine's conditions; one row per
    configuration."""
    import flashcodec_fx as fx
    from flashcodec_fx.hf import MaterializationFreeFallback, apply_codec_attention, remove_codec_attention

    apply_threads(threads)
    torch.manual_seed(0)
    model = _model(model_name).float()
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    caches, skipped = {}, []
    for config in configs:
        try:
            caches[config] = _cache(model, config, context + new_tokens + 8)
        except (ValueError, NotImplementedError, ImportError) as err:  # quanto: sliding layers, not installed
            skipped.append({"model": model_name, "config": config, "context": context, "neighbour": neighbour_kind,
                            "error": f"{type(err).__name__}: {err}"})
    with torch.no_grad():
        for idx in range(cfg.num_hidden_layers):
            kv = [torch.randn(1, heads, context, dim) for _ in range(2)]
            for config, cache in caches.items():
                cache.update(*kv, idx)
                if config in EAGER_CODEC:  # the fill stands for a prefill the kvcodec attention served (it marks it)
                    cache.layers[idx].attention_bound = True
    warnings.simplefilter("error", MaterializationFreeFallback)  # a layer on the decoded view would time the memo
    steps = {config: model for config in caches}
    for config in caches:
        if config == "compiled_raw":
            steps[config] = torch.compile(model, backend="inductor", fullgraph=True)
        elif config in COMPILED_PRESETS:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # CompiledGenerateWarning: the steps call the wrapper, not generate
                steps[config] = torch.compile(model, fullgraph=True, backend=fx.backend(strict=True))
    first: dict[str, float] = {}
    graphs = torch._dynamo.utils.counters["stats"]
    name = "cache" if "cache" in model.forward.__code__.co_varnames else "past_key_values"
    tokens = {config: [42] for config in configs}
    times: dict[str, list[float]] = {config: [] for config in configs}
    load_before = os.getloadavg()
    with torch.no_grad():
        for i in range(new_tokens + 1):  # step 0 warms up (plans, validation), untimed
            for config, cache in caches.items():
                if config in EAGER_CODEC:
                    apply_codec_attention(model)  # what apply_flash_codec installs: attention on the stored form
                ids = torch.tensor([[tokens[config][-1]]])
                start = time.perf_counter()
                out = steps[config](input_ids=ids, position_ids=torch.tensor([[context + i]]), use_cache=True,
                                    **{name: cache})
                token = int(out.logits[0, -1].argmax())
                elapsed = time.perf_counter() - start
                if config in EAGER_CODEC:
                    remove_codec_attention(model)
                tokens[config].append(token)
                if i:
                    times[config].append(elapsed)
                else:
                    first[config] = elapsed
            if not i:
                compiled_graphs = graphs["unique_graphs"]
    raw_equivalent = 2 * cfg.num_hidden_layers * heads * (context + 1 + new_tokens) * dim * 4
    rows = []
    for config, cache in caches.items():
        median = statistics.median(times[config])
        rows.append({"model": model_name, "config": config, "context": context, "new_tokens": new_tokens,
                     "device": "cpu", "dtype": "torch.float32", "threads": torch.get_num_threads(),
                     "layers": cfg.num_hidden_layers, "kv_heads": heads, "head_dim": dim,
                     "step_ms_median": round(median * 1e3, 3), "step_ms_min": round(min(times[config]) * 1e3, 3),
                     "step_ms_p90": round(sorted(times[config])[int(0.9 * (len(times[config]) - 1))] * 1e3, 3),
                     "tok_per_s": round(1.0 / median, 2), "kv_bytes": _kv_bytes(cache, config, raw_equivalent),
                     "tokens": tokens[config][1:], "timer": "interleaved rounds, one step of each config per round",
                     "neighbour": neighbour_kind, "first_step_s": round(first[config], 2),
                     "load_avg_before": list(load_before), "load_avg_after": list(os.getloadavg())})
    raw = next((r for r in rows if r["config"] == "eager_raw"), None)
    for row in rows:
        if raw is not None:
            row["tok_per_s_vs_raw"] = round(raw["step_ms_median"] / row["step_ms_median"], 3)
            row["tok_per_s_vs_raw_min"] = round(raw["step_ms_min"] / row["step_ms_min"], 3)
        row["kv_total_vs_raw"] = round(row["kv_bytes"]["total"] / raw_equivalent, 4)
        eager = next((r for r in rows if r["config"] == row["config"].replace("compiled_", "eager_")), None)
        if row["config"].startswith("compiled_"):
            row["recompiles_after_first_round"] = graphs["unique_graphs"] - compiled_graphs
            if eager is not None:
                row["step_vs_eager"] = round(row["step_ms_median"] / eager["step_ms_median"], 3)
    return rows + skipped

def _subprocess_rows(cmd: list[str], what: dict) -> list[dict]:
    """The ``ROW`` lines a run prints, or one row with its error (``what`` names the run)."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if not rows:
        rows = [{**what, "error": (proc.stderr or proc.stdout)[-2000:]}]
    for row in rows:
        row.setdefault("load_avg_after", list(os.getloadavg()))
        print({k: row.get(k) for k in ("model", "config", "context", "step_ms_median", "tok_per_s", "tok_per_s_vs_raw",
                                        "recompiles", "decode_peak_delta_mb", "compile_s", "error")}, flush=True)
    return rows

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="llama-rand only, contexts 1k/4k/16k")
    parser.add_argument("--models", default=None, help="comma list of smollm2, gemma3, llama-rand")
    parser.add_argument("--contexts", default=None, help="comma list of context lengths")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--configs", default=",".join(COMPILED), help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: bf16 model and cache")
    parser.add_argument("--mode", default=None, help='torch.compile mode, e.g. "reduce-overhead" (CUDA graphs)')
    add_threads_argument(parser, 2, "torch threads of each run")
    parser.add_argument("--neighbours", default="none",
                        help=f"comma list of {', '.join(NEIGHBOURS)}: each eager run once per kind, next to those "
                             "CPU-burning processes (common.neighbour)")
    parser.add_argument("--neighbour", choices=NEIGHBOURS, default="none", help=argparse.SUPPRESS)  # --run-eager
    parser.add_argument("--out", default=None)
    parser.add_argument("--run", nargs=3, metavar=("MODEL", "CONFIG", "CONTEXT"), help=argparse.SUPPRESS)
    parser.add_argument("--run-eager", nargs=2, metavar=("MODEL", "CONTEXT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_eager:
        for row in run_eager(args.run_eager[0], args.configs.split(","), int(args.run_eager[1]), args.new_tokens,
                             args.threads, args.neighbour):
            print("ROW " + json.dumps(row), flush=True)
        return
    if args.run:
        print("ROW " + json.dumps(run_one(args.run[0], args.run[1], int(args.run[2]), args.new_tokens, args.device,
                                          args.mode, args.threads)), flush=True)
        return
    if args.quick:
        plan = {"llama-rand": [1024, 4096, 16384]}
    else:
        plan = {"smollm2": [1024, 4096], "llama-rand": [1024, 4096, 16384, 32768]}
    if args.models:
        plan = {m: plan.get(m, [1024, 4096]) for m in args.models.split(",")}
    if args.contexts:
        plan = {m: [int(c) for c in args.contexts.split(",")] for m in plan}
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise ValueError(f"--configs: unknown {unknown}; allowed: {list(CONFIGS)}")
    eager = [c for c in configs if c in EAGER]
    neighbours = [n for n in args.neighbours.split(",") if n]
    if sorted(set(neighbours) - set(NEIGHBOURS)):
        raise ValueError(f"--neighbours: unknown {sorted(set(neighbours) - set(NEIGHBOURS))}; allowed: {NEIGHBOURS}")
    if eager and args.device != "cpu":
        raise ValueError("--configs: the eager configurations run on the CPU only")
    rows = []
    for model_name, contexts in plan.items():
        for context in contexts:
            for kind in neighbours if eager else ():
                cmd = [sys.executable, __file__, "--run-eager", model_name, str(context), "--configs", ",".join(eager),
                       "--new-tokens", str(args.new_tokens), "--threads", str(args.threads), "--neighbour", kind]
                with neighbour(kind):
                    rows += _subprocess_rows(cmd, {"model": model_name, "config": ",".join(eager), "context": context,
                                                   "neighbour": kind})
            for config in [c for c in configs if c not in EAGER]:
                cmd = [sys.executable, __file__, "--run", model_name, config, str(context),
                       "--new-tokens", str(args.new_tokens), "--device", args.device, "--threads", str(args.threads)]
                cmd += ["--mode", args.mode] if args.mode else []
                rows += _subprocess_rows(cmd, {"model": model_name, "config": config, "context": context})
    payload = {"tier": TIER, "dtype": "bfloat16" if args.device == "cuda" else "float32", "batch": 1, "mode": args.mode,
               "rows": rows}
    if args.device == "cpu":
        payload["note"] = "shared 2-core CPU machine, other jobs running: absolute times are noisy"
    path = write_result(f"e2e_{args.device}", payload, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
