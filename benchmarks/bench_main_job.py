"""The main job (``flashcodec run``) alone and beside CPU-burning neighbours, under each thread setting, side by side.

Each run is the command as a user types it (``python -m flashcodec_fx.cli run --threads SETTING --out FILE``, a fresh
process: import, model load, every tier), timed from outside (``process_s``) and by the job itself: ``job_s`` (its
``wall_s``: model load, the CPU kernels' preparation, the tiers), ``tiers_s`` (the tiers' own seconds) and ``work_s``
(``job_s`` less ``kernel_build_s``: a build happens once per machine and kernel source). The CPU kernels are built
(or loaded) once before the first run.

Neighbours (``common.neighbour``): ``none``; ``omp``, one process whose torch matmul loop keeps an OpenMP thread on
every core (another model's decode); ``python``, one pure-Python busy loop per core. Thread settings
(``--settings``): ``auto`` (the command's default: ``flashcodec_fx/threads.py``), a number, ``default`` (torch's
default thread count, what the command ran with before ``auto``), and any of them with ``+passive``
(``OMP_WAIT_POLICY=PASSIVE``: OpenMP threads sleep at barriers instead of spinning). Runs go in rounds, one setting
beside every neighbour in turn, so that a setting's ratios to its quiet run (``vs_quiet`` of ``work_s``,
``tiers_vs_quiet`` of ``tiers_s``) come from runs minutes apart.

Target (issue 32): ``auto`` beside the ``omp`` neighbour within 2x of ``auto`` alone; ``auto`` alone under 3 minutes
on 2 cores (``targets`` in the JSON).

    python benchmarks/bench_main_job.py                 # the full main job: 4 settings x 3 neighbours
    python benchmarks/bench_main_job.py --quick         # 8 new tokens, raw + int8 + 4bit, auto / 1 / default
    python benchmarks/bench_main_job.py --settings auto,1 --neighbours none,omp --new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import NEIGHBOURS, neighbour, write_result

from flashcodec_fx.threads import parse_threads

PASSIVE = "+passive"
SETTINGS = ("auto", "1", "default", "default+passive")
QUICK = {"new_tokens": 8, "tiers": "int8,4bit", "settings": "auto,1,default"}
TIMEOUT_S = 1800  # one run; a run past it is recorded as an error


def parse_setting(setting: str, default_threads: int) -> tuple[str, dict[str, str]]:
    """``(--threads value, extra environment)`` of a setting: ``auto`` / ``N`` / ``default``, optionally ``+passive``."""
    base, passive = (setting[: -len(PASSIVE)], True) if setting.endswith(PASSIVE) else (setting, False)
    threads = str(default_threads) if base == "default" else str(parse_threads(base))
    return threads, {"OMP_WAIT_POLICY": "PASSIVE"} if passive else {}


def run_job(threads: str, env: dict[str, str], new_tokens: int, tiers: str | None, out: Path) -> dict:
    """One ``flashcodec run`` in a fresh process; its JSON's figures, or the error."""
    cmd = [sys.executable, "-m", "flashcodec_fx.cli", "run", "--threads", threads, "--new-tokens", str(new_tokens),
           "--out", str(out)]
    cmd += ["--tiers", tiers] if tiers else []
    load = os.getloadavg()
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {TIMEOUT_S} s", "load_avg_before": list(load)}
    process_s = time.perf_counter() - start
    figures = {"process_s": round(process_s, 2), "load_avg_before": list(load), "load_avg_after": list(os.getloadavg())}
    if done.returncode != 0 or not out.exists():
        return {**figures, "error": (done.stderr or done.stdout)[-2000:]}
    job = json.loads(out.read_text())
    build = job["kernel_build_s"] or 0.0
    return {**figures, "job_s": round(job["wall_s"], 2), "work_s": round(job["wall_s"] - build, 2),
            "tiers_s": round(sum(r["seconds"] for r in job["rows"]), 2), "kernel_build_s": round(build, 2),
            "threads": [r["threads"] for r in job["rows"]], "thread_policy": job["thread_policy"],
            "rows": [{k: r[k] for k in ("tier", "seconds", "decode_tok_s", "threads", "token_match")}
                     for r in job["rows"]]}


def add_ratios(runs: list[dict]) -> None:
    """``vs_quiet`` / ``tiers_vs_quiet``: each run's ``work_s`` / ``tiers_s`` over the same setting's run without a
    neighbour."""
    for key, ratio in (("work_s", "vs_quiet"), ("tiers_s", "tiers_vs_quiet")):
        quiet = {r["setting"]: r.get(key) for r in runs if r["neighbour"] == "none"}
        for r in runs:
            if r.get(key) and quiet.get(r["setting"]):
                r[ratio] = round(r[key] / quiet[r["setting"]], 2)


def targets(runs: list[dict]) -> dict:
    """Issue 32's two targets, read from the runs (None where a run is missing)."""
    by = {(r["setting"], r["neighbour"]): r for r in runs if "error" not in r}
    quiet, busy = by.get(("auto", "none"), {}), by.get(("auto", "omp"), {})
    return {"auto_beside_omp_vs_quiet": busy.get("vs_quiet"), "auto_beside_omp_within_2x":
            None if busy.get("vs_quiet") is None else busy["vs_quiet"] <= 2.0,
            "auto_quiet_work_s": quiet.get("work_s"), "auto_quiet_process_s": quiet.get("process_s"),
            "auto_quiet_under_3_min": None if quiet.get("process_s") is None else quiet["process_s"] < 180}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=None, help=f"comma list of thread settings (default {','.join(SETTINGS)})")
    parser.add_argument("--neighbours", default=",".join(NEIGHBOURS), help=f"comma list of {', '.join(NEIGHBOURS)}")
    parser.add_argument("--new-tokens", type=int, default=None, help="the job's --new-tokens (default: the job's, 64)")
    parser.add_argument("--tiers", default=None, help="the job's --tiers (default: the job's: raw + every preset)")
    parser.add_argument("--quick", action="store_true", help=f"defaults for a check: {QUICK}")
    parser.add_argument("--out", default=None, help="default benchmarks/results/main_job_busy.json")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: the neighbours and the job are stopped too
    quick = QUICK if args.quick else {"new_tokens": 64, "tiers": None, "settings": ",".join(SETTINGS)}
    new_tokens = args.new_tokens or quick["new_tokens"]
    tiers = args.tiers or quick["tiers"]
    settings = [s for s in (args.settings or quick["settings"]).split(",") if s]
    kinds = [k for k in args.neighbours.split(",") if k]
    if sorted(set(kinds) - set(NEIGHBOURS)):
        raise ValueError(f"--neighbours: unknown {sorted(set(kinds) - set(NEIGHBOURS))}; allowed: {NEIGHBOURS}")
    default_threads = torch.get_num_threads()
    plans = {s: parse_setting(s, default_threads) for s in settings}  # bad settings fail before any run
    from flashcodec_fx.cli.main_job import prepare_kernels

    kernels = prepare_kernels("cpu")
    print(kernels[0] if kernels else "CPU kernels: not used", flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for setting, (threads, env) in plans.items():
            for kind in kinds:
                with neighbour(kind):
                    result = run_job(threads, env, new_tokens, tiers, Path(scratch) / f"{len(runs)}.json")
                runs.append({"setting": setting, "threads_arg": threads, "env": env, "neighbour": kind, **result})
                print({k: runs[-1].get(k) for k in ("setting", "neighbour", "process_s", "work_s", "tiers_s", "kernel_build_s",
                                                      "threads", "load_avg_before", "error")}, flush=True)
    add_ratios(runs)
    payload = {"command": "python -m flashcodec_fx.cli run --threads SETTING --new-tokens N [--tiers T] --out FILE",
               "new_tokens": new_tokens, "tiers": tiers, "settings": settings, "neighbours": kinds,
               "default_threads": default_threads, "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
               "kernels": kernels[0] if kernels else None,
               "runs": runs, "targets": targets(runs),
               "note": "job_s: the job's own wall time (model load, kernels, tiers); work_s: job_s less the kernels' "
                       "build; process_s: the command from outside (Python and torch imports too); vs_quiet / "
                       "tiers_vs_quiet: work_s / tiers_s over the same setting's run with no neighbour"}
    path = write_result("main_job_busy", payload, out=args.out)
    print(json.dumps(payload["targets"]), f"\nwrote {path}", flush=True)


if __name__ == "__main__":
    main()
