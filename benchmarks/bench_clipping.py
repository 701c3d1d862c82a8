"""The quantizer's clipping choice (issue 41): ``scale_search="trials"`` (one pass per clipping factor) against
``"fit"`` (a closed-form start and two least-squares passes), measured.

    python benchmarks/bench_clipping.py fit                  # "fit"'s start lines on Gaussian slices (quant.FIT_LINES)
    python benchmarks/bench_clipping.py mse                  # squared error of False / trials / fit -> results/clipping.json
    python benchmarks/bench_clipping.py tiers > benchmarks/data/clipping_tiers.json   # bench_ppl tiers: each lossy
    python benchmarks/bench_ppl.py --model smollm2 --tiers --tier-file benchmarks/data/clipping_tiers.json \\
        --out benchmarks/results/clipping_ppl.json       # preset with trials / fit, at two rotation seeds
    python benchmarks/bench_clipping.py kl --ppl benchmarks/results/clipping_ppl.json    # paired summary -> clipping.json
    python benchmarks/bench_clipping.py speed                # encode cost, trials vs fit, interleaved -> clipping.json

``fit``: for every level set and bit width of a :class:`~flashcodec_fx.codecs.quant.Quantizer` and slice sizes
``quant.FIT_SIZES``, unit-Gaussian slices (2**18 values, seeded): Lloyd-Max levels get the least-squares line of the
best factor (a grid of 0.01 over ``quant.FIT_RANGE``, fp16 scales rounded up as the trials round them) against the
slice's largest magnitude over its RMS; the other level sets one constant start factor, the one whose "fit" errs
least in total. Prints the table ``quant.FIT_LINES`` holds (and writes nothing).

``mse``: total squared error of each mode over the trials' (the quantizer's own encode and decode) on unit-Gaussian
slices of 64 / 128 / 256 values, heavy-tailed ones (Student-t with 3 and 5 degrees of freedom, Laplace) and the rows
each lossy preset quantizes on SmolLM2-135M (the package's encode hooked while ``bench_fakequant`` runs one window of
the streaming protocol: centered, normalized, rotated keys and values).

``kl``: bench_ppl's streaming protocol (the committed quality protocol: 6 windows x 1024 tokens, fp32, the real
cache) per lossy preset with ``scale_search`` ``"trials"`` and ``"fit"`` on both streams, each at the presets' own
rotations (seed = layer index) and at one other rotation (seed 1000 in every layer). Noise: how far two equally good
quantizers (the same recipe at another rotation) land apart; a preset's "fit" is within noise where its KL is within
that spread of the trials', per window too.

``speed``: the encode on the hot paths, one thread, rounds interleaved (load recorded before each): the C++ ``append``
of one decode token (B=1, 3 KV heads, head_dim 64: SmolLM2's layer) and of a 2,048-token prefill, and the vLLM
plugin's store of 2,048 prompt tokens (``kernels.paged_store``, both phases), each preset with ``"trials"`` and
``"fit"`` (and ``False``: the encode without any search, the floor); medians of the process's CPU time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import RESULTS_DIR, write_result

from flashcodec_fx.codecs.levels import LEVELS, LLOYD_MAX_BITS, MAX_BITS
from flashcodec_fx.codecs.quant import Quantizer, fp16_toward
from flashcodec_fx.ops.state import StreamState
from flashcodec_fx.presets import preset_options

LOSSY = ("4bit", "3bit", "2.5bit", "2bit")  # the presets that search (int8: mid-rise, no search)
MODES = (False, "trials", "fit")
FIT_VALUES = 1 << 18  # values per (level set, bits, size) in ``fit``
OTHER_SEED = 1000  # the second rotation of ``kl``
OUT = RESULTS_DIR / "clipping.json"
LENGTH, START, TAIL = (StreamState._fields.index(f) for f in ("length", "start", "tail"))


def grid() -> tuple[float, ...]:
    """The clipping factors ``fit`` tries: 0.01 apart over ``quant.FIT_RANGE``."""
    from flashcodec_fx.codecs.quant import FIT_RANGE

    return tuple(round(FIT_RANGE[0] + 0.01 * i, 2) for i in range(round((FIT_RANGE[1] - FIT_RANGE[0]) / 0.01) + 1))


def level_bits(levels: str) -> range:
    return range(2 if levels == "int" else 1, (LLOYD_MAX_BITS if levels == "lloyd" else MAX_BITS) + 1)


def squared_error(q: Quantizer, x: torch.Tensor) -> torch.Tensor:
    """Per token-axis slice: the squared error of ``x (N, D)`` through ``q``'s encode and decode, ``(N,)``."""
    rows = x[:, None, None, :]
    packed, scale, zero = q.quantize(rows)
    return (q.dequantize(packed, scale, zero, x.shape[-1]) - rows).square().sum((-3, -2, -1))


def gaussian(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def lloyd_line(bits: int, x: torch.Tensor) -> tuple[float, float]:
    """Least-squares line of the best clipping factor (:func:`grid`, fp16 scales rounded up) against amax / RMS."""
    from flashcodec_fx.codecs.levels import level_table, rms_sqrt

    table = level_table("lloyd", bits)
    mids = (table[1:] + table[:-1]) / 2
    rms = rms_sqrt(x.square().mean(-1, keepdim=True))
    best_err, best_f = None, None
    for f in grid():
        s = fp16_toward(rms * f, up=True)
        err = (table[torch.bucketize((x / s).contiguous(), mids)] * s - x).square().sum(-1)
        if best_err is None:
            best_err, best_f = err, torch.full_like(err, f)
        else:
            better = err < best_err
            best_err, best_f = torch.where(better, err, best_err), torch.where(better, f, best_f)
    ratio = (x.abs().amax(-1) / rms[:, 0]).double()
    a, c = torch.linalg.lstsq(torch.stack([ratio, torch.ones_like(ratio)], 1), best_f.double()[:, None]).solution[:, 0]
    return round(float(a), 4), round(float(c), 4)


def constant_start(levels: str, bits: int, x: torch.Tensor) -> float:
    """The constant start factor whose "fit" errs least in total (:func:`grid`), for a level set other than lloyd."""
    import flashcodec_fx.codecs.quant as quant

    q = Quantizer((bits,), (levels,), "token", 1, "fit")
    best = None
    saved = quant.FIT_LINES.get((levels, bits))
    try:
        for f in grid()[::5]:  # 0.05 steps, then 0.01 around the best
            quant.FIT_LINES[(levels, bits)] = ((0.0, f),) * len(quant.FIT_SIZES)
            quant.fit_start.cache_clear()
            err = float(squared_error(q, x).sum())
            best = (err, f) if best is None or err < best[0] else best
        for f in [g for g in grid() if abs(g - best[1]) < 0.05]:
            quant.FIT_LINES[(levels, bits)] = ((0.0, f),) * len(quant.FIT_SIZES)
            quant.fit_start.cache_clear()
            err = float(squared_error(q, x).sum())
            best = (err, f) if err < best[0] else best
    finally:
        if saved is None:
            quant.FIT_LINES.pop((levels, bits), None)
        else:
            quant.FIT_LINES[(levels, bits)] = saved
        quant.fit_start.cache_clear()
    return best[1]


def fit_table() -> dict[tuple[str, int], tuple[tuple[float, float], ...]]:
    from flashcodec_fx.codecs.quant import FIT_SIZES

    table = {}
    for levels in LEVELS:
        for bits in level_bits(levels):
            lines = []
            for d in FIT_SIZES:
                x = gaussian(FIT_VALUES // d, d, seed=1000 * bits + d)
                start = time.perf_counter()
                if levels == "lloyd":
                    line = (0.0, 1.0) if bits == 1 else lloyd_line(bits, x)
                else:
                    line = (0.0, constant_start(levels, bits, x))
                lines.append(line)
                print(f"# {levels} {bits} bits, size {d}: {line} ({time.perf_counter() - start:.0f} s)",
                      file=sys.stderr, flush=True)
            table[(levels, bits)] = tuple(lines)
    return table


def print_table(table: dict) -> None:
    print("FIT_LINES: dict[tuple[str, int], tuple[tuple[float, float], ...]] = {")
    for (levels, bits), lines in table.items():
        print(f"    ({levels!r}, {bits}): ({', '.join(f'({a}, {c})' for a, c in lines)}),")
    print("}")


# --- mse --------------------------------------------------------------------------------------------------------

def preset_rows(windows: int = 1) -> dict[str, dict[str, torch.Tensor]]:
    """``{preset: {"keys"|"values": (N, D)}}``: the rows each lossy preset's quantizers receive on SmolLM2 (one window
    of bench_fakequant's protocol; every layer, at most 4,096 rows per layer and stream)."""
    import bench_fakequant
    from corpus import kind_texts, leading_tokens, load_tokens
    from corpus import windows as make_windows

    import flashcodec_fx.codecs.quant as quant
    from flashcodec_fx.config import cache_config
    from flashcodec_fx.pretrained import load_pretrained

    model, tokenizer = load_pretrained("SmolLM2-135M-Instruct", dtype=torch.float32)
    ids = make_windows(load_tokens(tokenizer, kind_texts(["prose"])), windows, 1024, leading_tokens(tokenizer))
    original = quant.Quantizer.quantize
    out: dict[str, dict[str, list[torch.Tensor]]] = {}
    current: list = []

    def hooked(self: Quantizer, rows: torch.Tensor):
        stream = ("keys", "values")[current[1] % 2]  # each layer codes its keys, then its values (FakeQuant)
        current[1] += 1
        if rows.shape[-3:-1] == (1, 1):
            flat = rows.float().reshape(-1, rows.shape[-1])
            pick = torch.randperm(flat.shape[0], generator=torch.Generator().manual_seed(flat.shape[0]))[:4096]
            out.setdefault(current[0], {}).setdefault(stream, []).append(flat[pick])
        return original(self, rows)

    quant.Quantizer.quantize = hooked
    try:
        for preset in LOSSY:
            current[:] = [preset, 0]
            bench_fakequant.logprobs(model, ids, cache_config(preset=preset), 128, 16)
    finally:
        quant.Quantizer.quantize = original
    return {p: {s: torch.cat(v) for s, v in streams.items()} for p, streams in out.items()}


def mse_rows(seed: int = 7) -> list[dict[str, Any]]:
    rows = []
    synthetic = {f"gaussian {d}": gaussian(20000, d, seed + d) for d in (64, 128, 256)}
    gen = torch.Generator().manual_seed(seed)
    for name, dist in (("student-t3 64", torch.distributions.StudentT(3.0)),
                       ("student-t5 64", torch.distributions.StudentT(5.0)),
                       ("laplace 64", torch.distributions.Laplace(0.0, 1.0))):
        torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
        synthetic[name] = dist.sample((20000, 64))

    def measure(source: str, levels: str, bits: int, x: torch.Tensor) -> dict[str, Any]:
        err = {str(m): float(squared_error(Quantizer((bits,), (levels,), "token", 1, m), x).sum()) for m in MODES}
        return {"rows": source, "levels": levels, "bits": bits, "slices": x.shape[0], "size": x.shape[1],
                **{f"vs_trials_{m}": err[m] / err["trials"] for m in ("False", "fit")}}

    for source, x in synthetic.items():
        for levels in LEVELS:
            for bits in (1, 2, 3, 4, 8):
                if bits in level_bits(levels):
                    rows.append(measure(source, levels, bits, x))
                    print(rows[-1], flush=True)
    for preset, streams in preset_rows().items():
        key, value = (preset_options(preset)[f"{s}_options"] for s in ("key", "value"))
        for stream, options in (("keys", key), ("values", value)):
            rows.append(measure(f"SmolLM2 {preset} {stream}", options["levels"], options["quant_bits"],
                                streams[stream]))
            print(rows[-1], flush=True)
    return rows


# --- kl ---------------------------------------------------------------------------------------------------------

def tiers() -> list[dict[str, Any]]:
    """bench_ppl tiers: each lossy preset with ``scale_search`` trials / fit, at the presets' rotations and at seed
    ``OTHER_SEED`` in every layer."""
    out = []
    for preset in LOSSY:
        for seed in (None, OTHER_SEED):
            for mode in ("trials", "fit"):
                options = preset_options(preset)
                for stream in ("key_options", "value_options"):
                    options[stream]["scale_search"] = mode
                    if seed is not None:
                        options[stream]["rotate"] = seed
                name = f"{preset} {mode}" + ("" if seed is None else f" seed {seed}")
                out.append({"name": name, "family": "clipping", "options": options})
    return out


def kl_summary(ppl: dict[str, Any]) -> list[dict[str, Any]]:
    """Per preset: KL of trials and fit at both rotations (mean and per window); ``fit_vs_trials``: fit's KL over the
    trials' at each rotation; ``paired_change``: fit's per-window change over the trials' (both rotations' windows),
    its mean; ``rotation_noise``: the per-window change between the trials at the two rotations (two equally good
    quantizers), its spread ``noise_sd`` and the standard error of a mean over as many windows (``noise_se``); the
    verdict ``fit``: "better" (mean change below -2 SE), "within noise" (within +-2 SE), "worse"."""
    (model, data), = ppl["models"].items()
    by_name = {r["tier"]: r for r in data["rows"]}
    out = []
    for preset in LOSSY:
        runs = {(mode, seed): by_name.get(f"{preset} {mode}{seed}") for mode in ("trials", "fit")
                for seed in ("", f" seed {OTHER_SEED}")}
        if any(v is None for v in runs.values()):
            continue
        row: dict[str, Any] = {"preset": preset, "model": model}
        for (mode, seed), r in runs.items():
            key = mode + ("_seed" if seed else "")
            row[f"kl_{key}"] = r["kl"]
            row[f"kl_per_window_{key}"] = r["kl_per_window"]
            row[f"bits_end_{key}"], row[f"bits_worst_{key}"] = r["bits_end"], r["bits_worst"]
        paired = [f / t - 1 for s in ("", "_seed") for f, t in zip(row[f"kl_per_window_fit{s}"],
                                                                     row[f"kl_per_window_trials{s}"], strict=True)]
        noise = [u / t - 1 for u, t in zip(row["kl_per_window_trials_seed"], row["kl_per_window_trials"], strict=True)]
        sd = statistics.stdev(noise)
        se = sd / math.sqrt(len(paired))
        mean = statistics.fmean(paired)
        row.update(fit_vs_trials=[row["kl_fit"] / row["kl_trials"], row["kl_fit_seed"] / row["kl_trials_seed"]],
                   paired_change=paired, paired_change_mean=mean, windows_fit_lower=sum(c < 0 for c in paired),
                   rotation_noise=noise, noise_sd=sd, noise_se=se,
                   fit="better" if mean < -2 * se else "within noise" if mean <= 2 * se else "worse")
        out.append(row)
    return out


# --- speed ------------------------------------------------------------------------------------------------------

def with_search(codec, mode):
    """``codec`` (a per-token jpeg codec) with ``scale_search=mode``."""
    from flashcodec_fx.codecs import codec_from_spec
    from flashcodec_fx.codecs.jpeg import SEARCH_CODES

    spec = codec.spec.replace(f"search={SEARCH_CODES[codec.quantizer.search]};", f"search={SEARCH_CODES[mode]};")
    return codec_from_spec(spec)


class AppendCase:
    """The C++ ``flashcodec::append`` of ``tokens`` new tokens into a layer's K and V streams (SmolLM2's 3 KV heads
    of 64) holding ``length`` tokens, put back before each call (``length``, ``start`` and the raw tail: the same
    tokens are encoded into the same slots again). A decode token past the raw window encodes one token per stream."""

    def __init__(self, k_codec, v_codec, length: int, tokens: int, seed: int = 0):
        from flashcodec_fx.ops import empty_state

        self.specs = [c.resolved(torch.float32).spec for c in (k_codec, v_codec)]
        gen = torch.Generator().manual_seed(seed)
        self.states = []
        for spec, codec in zip(self.specs, (k_codec, v_codec), strict=True):
            state = list(empty_state(codec.resolved(torch.float32), 1, 3, length + tokens + 8, 64, torch.float32,
                                     "cpu"))
            if length:
                torch.ops.flashcodec.append(state, torch.randn(1, 3, length, 64, generator=gen), spec, None)
            self.states.append(state)
        self.saved = [[t.clone() for t in (s[LENGTH], s[START], s[TAIL])] for s in self.states]
        self.new = [torch.randn(1, 3, tokens, 64, generator=gen) for _ in range(2)]

    def __call__(self) -> None:
        for state, saved in zip(self.states, self.saved, strict=True):
            state[LENGTH].copy_(saved[0])
            state[START].copy_(saved[1])
            state[TAIL].copy_(saved[2])
        for state, new, spec in zip(self.states, self.new, self.specs, strict=True):
            torch.ops.flashcodec.append(state, new, spec, None)


def store_case(preset: str, mode):
    """The vLLM plugin's store of a 2,048-token prompt (both phases, plans made once), one layer."""
    import bench_vllm_kernels as vk

    from flashcodec_fx.vllm import kernels
    from flashcodec_fx.vllm.page import PHASES, PageFormat, page_format, store_plan

    call = vk.Call([(2048, 0)])
    fmt = page_format(preset, vk.LAYER, vk.HEAD_DIM, torch.float32)
    if mode is not None:
        fmt = PageFormat(fmt.name, with_search(fmt.key, mode), with_search(fmt.value, mode), fmt.anchors,
                         fmt.head_dim, fmt.dtype)
    cache = vk.filled_pages(call, fmt)
    meta = (call.block_table, call.seq_lens, call.query_start_loc)
    plans = {phase: store_plan(fmt, vk.BLOCK, call.slots, *meta, phase) for phase in PHASES}

    def run() -> None:
        for phase in PHASES:
            kernels.paged_store(fmt, call.key, call.value, cache, call.slots, *meta, phase, plans[phase])

    return run


def speed_cases(modes) -> dict[tuple[str, str, str], Any]:
    """``{(what, preset, search): fn}``; search None: the preset's codecs as they are (named "preset")."""
    from flashcodec_fx.presets import preset_codecs

    cases: dict[tuple[str, str, str], Any] = {}
    for preset in LOSSY:
        codecs = preset_codecs(preset, 5)
        for mode in modes:
            k, v = codecs if mode is None else (with_search(c, mode) for c in codecs)
            name = "preset" if mode is None else str(mode)
            cases[("append: decode token at 1024", preset, name)] = AppendCase(k, v, 1024, 1)
            cases[("append: 2048-token prefill", preset, name)] = AppendCase(k, v, 0, 2048)
            cases[("vLLM store: 2048-token prompt", preset, name)] = store_case(preset, mode)
    return cases


def time_round(cases: dict, repeats: int, reverse: bool) -> dict[tuple[str, str, str], float]:
    """One round: each case once untimed, then ``repeats`` calls timed (process CPU ms per call)."""
    out = {}
    for key in reversed(list(cases)) if reverse else list(cases):
        fn = cases[key]
        fn()
        start = time.process_time()
        for _ in range(repeats):
            fn()
        out[key] = (time.process_time() - start) / repeats * 1e3
    return out


def before_round(commit: str, scratch: Path, repeats: int, reverse: bool) -> dict[tuple[str, str, str], float]:
    """One round of the presets as ``commit``'s package stores them (a subprocess importing it from ``scratch``)."""
    out = scratch / "round.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(scratch), str(Path(__file__).parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(Path(__file__).resolve()), "speed", "--presets-round", str(out), "--repeats",
           str(repeats), "--threads", "1"] + (["--reverse"] if reverse else [])
    subprocess.run(cmd, check=True, env=env, cwd=scratch)
    return {tuple(k.split("|")): v for k, v in json.loads(out.read_text()).items()}


def speed_rows(rounds: int, repeats: int, before: str | None) -> tuple[list[dict[str, Any]], list[float]]:
    """Encode timings (module docstring): the cases of this tree (``"trials"``, ``"fit"``, ``False`` and the presets
    as they are) and, with ``before``, the presets as commit ``before`` stores them (a subprocess per round); rounds
    interleaved (this tree's cases reversed every other round, the subprocess first or last in turn); medians."""
    cases = speed_cases(MODES)
    samples: dict[tuple[str, str, str], list[float]] = {key: [] for key in cases}
    loads = []
    with tempfile.TemporaryDirectory() as scratch:
        if before is not None:
            archive = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "archive", before,
                                      "flashcodec_fx"], check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", scratch], input=archive, check=True)
        for r in range(rounds):
            loads.append(round(os.getloadavg()[0], 2))
            parts = [lambda r=r: time_round(cases, repeats, r % 2 == 1)]
            if before is not None:
                parts.append(lambda r=r: {(w, p, f"before {before[:7]}"): ms for (w, p, _), ms in
                                          before_round(before, Path(scratch), repeats, r % 2 == 1).items()})
            for part in parts if r % 2 == 0 else reversed(parts):
                for key, ms in part().items():
                    samples.setdefault(key, []).append(ms)
    rows = [{"what": what, "preset": preset, "search": mode, "cpu_ms": statistics.median(ms), "cpu_ms_min": min(ms),
             "cpu_ms_max": max(ms), "samples": len(ms)} for (what, preset, mode), ms in samples.items()]
    for row in rows:
        trials = next(r for r in rows if (r["what"], r["preset"], r["search"]) == (row["what"], row["preset"], "trials"))
        row["vs_trials"] = row["cpu_ms"] / trials["cpu_ms"]
    return rows, loads


# --- main -------------------------------------------------------------------------------------------------------

def merge_part(part: str, payload: dict[str, Any], out: Path) -> Path:
    """Write ``payload`` as part ``part`` of ``out`` (the other parts kept, each with its own run metadata)."""
    from flashcodec_fx.provenance import metadata

    parts = json.loads(out.read_text()).get("parts", {}) if out.exists() else {}
    parts[part] = {"run": metadata(), **payload}
    return write_result("clipping", {"parts": parts}, out=out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("fit", "mse", "tiers", "kl", "speed"))
    parser.add_argument("--ppl", type=Path, default=RESULTS_DIR / "clipping_ppl.json",
                        help="kl: the bench_ppl result of the clipping tiers")
    parser.add_argument("--rounds", type=int, default=7, help="speed: interleaved rounds")
    parser.add_argument("--repeats", type=int, default=5, help="speed: calls per case and round")
    parser.add_argument("--before", default=None, metavar="REV",
                        help="speed: also time the presets as commit REV stores them (its package, a subprocess per round)")
    parser.add_argument("--presets-round", type=Path, default=None, help=argparse.SUPPRESS)  # before_round's child
    parser.add_argument("--reverse", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.part == "fit":
        print_table(fit_table())
    elif args.part == "tiers":
        print(json.dumps(tiers(), indent=1))
    elif args.part == "mse":
        start = time.perf_counter()
        rows = mse_rows()
        print(f"wrote {merge_part('mse', {'seconds': time.perf_counter() - start, 'rows': rows}, args.out)}")
    elif args.part == "kl":
        ppl = json.loads(args.ppl.read_text())
        rows = kl_summary(ppl)
        for r in rows:
            print(f"{r['preset']}: KL trials {r['kl_trials']:.4g} / {r['kl_trials_seed']:.4g}, fit {r['kl_fit']:.4g} / "
                  f"{r['kl_fit_seed']:.4g} (own rotation / seed {OTHER_SEED}); paired change "
                  f"{r['paired_change_mean']:+.3f} ({r['windows_fit_lower']} of {len(r['paired_change'])} windows "
                  f"lower), rotation noise sd {r['noise_sd']:.3f}, se {r['noise_se']:.3f}: {r['fit']}")
        payload = {"source": args.ppl.name, "protocol": ppl["protocol"], "source_commit": ppl["versions"]["git_commit"],
                   "rows": rows}
        print(f"wrote {merge_part('kl', payload, args.out)}")
    elif args.presets_round is not None:  # one round of the presets as this package stores them, for --before
        times = time_round(speed_cases([None]), args.repeats, args.reverse)
        args.presets_round.write_text(json.dumps({"|".join(k): v for k, v in times.items()}))
    else:
        rows, loads = speed_rows(args.rounds, args.repeats, args.before)
        for r in rows:
            print(r)
        payload = {"rounds": args.rounds, "repeats": args.repeats, "before": args.before, "load_before_rounds": loads,
                   "rows": rows}
        print(f"wrote {merge_part('speed', payload, args.out)}")


if __name__ == "__main__":
    main()
