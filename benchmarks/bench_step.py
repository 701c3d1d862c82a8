"""One layer's decode step on the CPU: a codec layer's (append K, append V, attention on the stored form) vs a raw
DynamicCache layer's (torch.cat of K and V onto the cache, SDPA), per call, at the lengths where the fixed cost shows.

Shape: SmolLM2-135M's layer (B=1, H_kv=3, H_q=9: GQA 3, D=64), fp32, one new token (T=1); the stored length ``L``
(``--lengths``: 256, 512, 1024, 4096) before the step; presets ``--presets`` (int8, 4bit, 3bit: their key and value
codecs as a cache's layer 0 resolves them, bf16 raw sinks and windows); ``--threads`` (1 and 2, each applied through
``flashcodec_fx.threads``).

Paths, each timed on its own call (``time.perf_counter`` around it, the stream's ``length`` / ``start`` put back
between calls, untimed, so every call appends at the same ``L``), in interleaved rounds (each round runs every path
once, in a shuffled order), ``--rounds`` of them after warm-up:

- ``fused``: ``torch.ops.flashcodec.append_attention`` (one op, one C++ call on the CPU);
- ``three_ops``: ``flashcodec::append`` for K, for V, then ``flashcodec::codec_attention`` (the step before the
  fused op);
- ``raw``: ``torch.cat`` of the new K and V onto ``(1, 3, L, 64)`` caches (a DynamicCache layer's update), then
  ``scaled_dot_product_attention(..., enable_gqa=True)``.

Reported per row: median, 10th and 90th percentile microseconds; ``fused / raw`` and ``three_ops / raw`` (medians).
The load average is recorded before and after each row (the machine is shared: a row measured next to other work
is slower, whatever the path). ``--before COMMIT``: the ``three_ops`` and ``raw`` paths also run with that commit's
package (``git archive`` of ``flashcodec_fx`` into a scratch folder, in a subprocess), as ``before_three_ops`` /
``before_raw``: the per-call cost before the change, next to its own raw path. -> ``results/step_cpu.json``.

    python benchmarks/bench_step.py                              # ~3 min on 2 cores
    python benchmarks/bench_step.py --before f64fb10             # + the three ops at that commit
    python benchmarks/bench_step.py --quick                      # L = 512, 4bit, 1 thread
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import write_result

from flashcodec_fx import presets
from flashcodec_fx.ops import empty_state
from flashcodec_fx.threads import apply_threads, parse_threads

B, HKV, HQ, D = 1, 3, 9, 64
PATHS = ("fused", "three_ops", "raw")
REPO = Path(__file__).resolve().parent.parent
LENGTH, START = 7, 8  # the state's length and start (ops/state.py StreamState)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Layer:
    """A codec layer's two streams at ``L`` tokens (and a raw layer's K / V caches), put back to ``L`` after each
    timed step: only ``length`` and ``start`` move back (an append at the same length writes the same slots again)."""

    def __init__(self, preset: str, length: int, seed: int):
        ck, cv = (c.resolved(torch.float32) for c in presets.preset_codecs(preset))
        self.spec_k, self.spec_v = ck.spec, cv.spec
        gen = torch.Generator().manual_seed(seed)
        k = torch.randn(B, HKV, length, D, generator=gen).cumsum(2) * 0.05 + torch.randn(B, HKV, 1, D, generator=gen)
        v = torch.randn(B, HKV, length, D, generator=gen)
        self.ks = list(empty_state(ck, B, HKV, length + 8, D, torch.float32, "cpu"))
        self.vs = list(empty_state(cv, B, HKV, length + 8, D, torch.float32, "cpu"))
        torch.ops.flashcodec.append(self.ks, k, self.spec_k, None)
        torch.ops.flashcodec.append(self.vs, v, self.spec_v, None)
        self.saved = [t.clone() for t in (self.ks[LENGTH], self.ks[START], self.vs[LENGTH], self.vs[START])]
        self.k_raw, self.v_raw = k, v
        self.q = torch.randn(B, HQ, 1, D, generator=gen)
        self.k_new = torch.randn(B, HKV, 1, D, generator=gen)
        self.v_new = torch.randn(B, HKV, 1, D, generator=gen)

    def reset(self) -> None:
        for t, s in zip((self.ks[LENGTH], self.ks[START], self.vs[LENGTH], self.vs[START]), self.saved, strict=True):
            t.copy_(s)

    def paths(self, names) -> dict:
        ops = torch.ops.flashcodec
        q, ks, vs, kn, vn, sk, sv = self.q, self.ks, self.vs, self.k_new, self.v_new, self.spec_k, self.spec_v
        out = {}
        if "fused" in names and hasattr(ops, "append_attention"):
            fused = ops.append_attention.default
            out["fused"] = lambda: fused(q, ks, vs, sk, sv, kn, vn)
        if "three_ops" in names:
            append, attention = ops.append.default, ops.codec_attention.default

            def three():
                append(ks, kn, sk, None)
                append(vs, vn, sv, None)
                return attention(q, ks, vs, sk, sv, kn, vn)
            out["three_ops"] = three
        if "raw" in names:
            kr, vr = self.k_raw, self.v_raw
            out["raw"] = lambda: F.scaled_dot_product_attention(q, torch.cat([kr, kn], 2), torch.cat([vr, vn], 2),
                                                                enable_gqa=True)
        return out


def time_paths(layer: Layer, paths: dict, rounds: int, warmup: int, seed: int) -> dict[str, list[float]]:
    """Microseconds of each call of each path, ``rounds`` interleaved rounds after ``warmup`` of them."""
    times = {name: [] for name in paths}
    rng = random.Random(seed)
    names = list(paths)
    for r in range(warmup + rounds):
        rng.shuffle(names)
        for name in names:
            layer.reset()
            t0 = time.perf_counter()
            paths[name]()
            elapsed = (time.perf_counter() - t0) * 1e6
            if r >= warmup:
                times[name].append(elapsed)
    return times


def summary(samples: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples, n=10)
    return {"median_us": round(statistics.median(samples), 2), "p10_us": round(q[0], 2), "p90_us": round(q[-1], 2)}


def measure(args, names) -> list[dict]:
    import flashcodec_fx

    print(f"flashcodec_fx from {Path(flashcodec_fx.__file__).parent}", file=sys.stderr)
    rows = []
    for threads in args.threads:
        choice = apply_threads(threads)
        for length in args.lengths:
            for preset in args.presets:
                layer = Layer(preset, length, seed=length)
                paths = layer.paths(names)
                before = load()
                times = time_paths(layer, paths, args.rounds, args.warmup, seed=length + choice.threads)
                row = {"threads": choice.threads, "L": length, "preset": preset, "load_before": before,
                       "load_after": load()}
                for name, samples in times.items():
                    row[name] = summary(samples)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def before_rows(commit: str, args) -> list[dict]:
    """The ``three_ops`` and ``raw`` rows measured with ``commit``'s package (a subprocess importing it)."""
    with tempfile.TemporaryDirectory() as scratch:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "flashcodec_fx"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", scratch], input=archive, check=True)
        out = Path(scratch) / "before.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([scratch, os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, __file__, "--paths", "three_ops", "raw", "--rows-only", str(out),
               "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--lengths", *map(str, args.lengths),
               "--presets", *args.presets, "--threads", *map(str, args.threads)]
        subprocess.run(cmd, check=True, env=env, cwd=scratch)
        return json.loads(out.read_text())


def merge(rows: list[dict], before: list[dict]) -> None:
    """``before_three_ops`` / ``before_raw`` into the rows of the same (threads, L, preset)."""
    by_key = {(r["threads"], r["L"], r["preset"]): r for r in before}
    for row in rows:
        old = by_key.get((row["threads"], row["L"], row["preset"]))
        if old is not None:
            row["before_three_ops"], row["before_raw"] = old["three_ops"], old["raw"]
            row["before_load"] = old["load_before"]


def ratios(row: dict) -> None:
    raw = row["raw"]["median_us"]
    for name in ("fused", "three_ops"):
        if name in row:
            row[f"{name}_vs_raw"] = round(row[name]["median_us"] / raw, 3)
    if "before_three_ops" in row:
        row["before_three_ops_vs_raw"] = round(row["before_three_ops"]["median_us"] / row["before_raw"]["median_us"], 3)


def table(rows: list[dict]) -> str:
    lines = ["| threads | L | preset | raw us | fused us | three ops us | before: three ops us (raw) | fused / raw | "
             "load |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        before = (f"{r['before_three_ops']['median_us']:.0f} ({r['before_raw']['median_us']:.0f})"
                  if "before_three_ops" in r else "")
        lines.append(f"| {r['threads']} | {r['L']} | {r['preset']} | {r['raw']['median_us']:.0f} | "
                     f"{r['fused']['median_us']:.0f} | {r['three_ops']['median_us']:.0f} | {before} | "
                     f"{r['fused_vs_raw']:.2f} | {r['load_before'][0]:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 4096])
    parser.add_argument("--presets", nargs="+", default=["int8", "4bit", "3bit"])
    parser.add_argument("--threads", type=parse_threads, nargs="+", default=[1, 2], metavar="auto|N")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--before", help="a commit whose package also runs the three ops and raw paths")
    parser.add_argument("--quick", action="store_true", help="L = 512, 4bit, one thread, 100 rounds")
    parser.add_argument("--rows-only", help=argparse.SUPPRESS)  # (--before's subprocess) the rows as JSON there
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.presets, args.threads, args.rounds = [512], ["4bit"], [1], 100
    started = load()
    rows = measure(args, args.paths)
    if args.rows_only:
        Path(args.rows_only).write_text(json.dumps(rows))
        return
    if args.before:
        merge(rows, before_rows(args.before, args))
    for row in rows:
        ratios(row)
    print(table(rows))
    path = write_result("step_cpu", {
        "shape": {"B": B, "H_kv": HKV, "H_q": HQ, "D": D, "T": 1, "dtype": "float32"},
        "rounds": args.rounds, "warmup": args.warmup, "before_commit": args.before, "load_at_start": started,
        "load_at_end": load(), "rows": rows}, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
