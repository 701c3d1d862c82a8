"""Two checkouts of the package, one benchmark, side by side: is a change within noise?

    python benchmarks/bench_paired.py --before 3aabc06 --rounds 4 --metric time_us \
        --key S layers shape tier path -- bench_attention.py --device cpu --quick --threads 1 --repeats 15
    python benchmarks/bench_paired.py --before 3aabc06 --rounds 4 --metric step_ms_median \
        --key model config context -- bench_e2e.py --quick --configs eager_raw,eager_4bit --new-tokens 8 --threads 1

``--before`` and ``--after`` (default HEAD) are checked out as git worktrees (under ``--workdir``); each round runs
the benchmark script of each checkout, ``python <checkout>/benchmarks/<script> <args> --out <json>``, with that
checkout first on ``PYTHONPATH`` (so it imports its own ``flashcodec_fx``; the C++ kernels build once per
checkout, before their timings), in alternating order (before, after; then after, before; ...). Rows of the two
JSONs are matched by ``--key`` fields; per matched row: each round's ``--metric`` ratio after / before, and their
median and range. ``within_noise``: the median ratio within ``--tolerance`` of 1, or the ratios' range containing 1.
Load averages before each run are kept. -> results/paired.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import write_result

REPO = Path(__file__).resolve().parent.parent


def worktree(commit: str, workdir: Path) -> Path:
    """A detached worktree of ``commit`` under ``workdir`` (reused when it is there)."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", commit], check=True, capture_output=True,
                         text=True).stdout.strip()
    path = workdir / sha
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), sha], check=True,
                       capture_output=True)
    return path


def run(checkout: Path, script: str, args: list[str], out: Path) -> dict[str, Any]:
    """The checkout's benchmark ``script`` with ``args``, its JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")])}
    load = os.getloadavg()
    subprocess.run([sys.executable, str(checkout / "benchmarks" / script), *args, "--out", str(out)], check=True,
                   env=env, cwd=checkout)
    return {"load_avg_before": list(load), "result": json.loads(out.read_text())}


def keyed(result: dict[str, Any], keys: list[str], metric: str) -> dict[tuple, float]:
    """``--key`` fields -> ``--metric`` of every row that has both."""
    return {tuple(row[k] for k in keys): row[metric] for row in result["rows"]
            if metric in row and all(k in row for k in keys)}


def compare(rounds: list[dict[str, Any]], keys: list[str], metric: str, tolerance: float) -> list[dict[str, Any]]:
    """Per row present in every run: the rounds' after / before ratios of ``metric``, their median and range."""
    tables = [(keyed(r["before"]["result"], keys, metric), keyed(r["after"]["result"], keys, metric)) for r in rounds]
    common = set.intersection(*(set(b) & set(a) for b, a in tables))
    rows = []
    for key in sorted(common, key=str):
        ratios = [a[key] / b[key] for b, a in tables]
        median = statistics.median(ratios)
        rows.append({**dict(zip(keys, key, strict=True)), "before": [b[key] for b, _ in tables],
                     "after": [a[key] for _, a in tables], "ratios": ratios, "ratio_median": median,
                     "within_noise": abs(median - 1) <= tolerance or min(ratios) <= 1 <= max(ratios)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="commit of the 'before' checkout")
    parser.add_argument("--after", default="HEAD", help="commit of the 'after' checkout")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each checkout, alternating which goes first")
    parser.add_argument("--metric", required=True, help="the rows' field compared (a time: lower is faster)")
    parser.add_argument("--key", nargs="+", required=True, help="the rows' fields that match a row across runs")
    parser.add_argument("--tolerance", type=float, default=0.05, help="a median ratio this close to 1 is noise")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "flashcodec_paired")
    parser.add_argument("--out", type=Path, default=None, help="default results/paired.json")
    parser.add_argument("benchmark", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS... (a script of benchmarks/)")
    args = parser.parse_args(argv)
    command = args.benchmark[1:] if args.benchmark[:1] == ["--"] else args.benchmark
    if not command:
        parser.error("give the benchmark after --, e.g. -- bench_attention.py --quick")
    script, script_args = command[0], command[1:]
    args.workdir.mkdir(parents=True, exist_ok=True)
    checkouts = {"before": worktree(args.before, args.workdir), "after": worktree(args.after, args.workdir)}
    rounds = []
    for i in range(args.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        done = {}
        for side in order:
            print(f"== round {i + 1}: {side} ({checkouts[side].name})", file=sys.stderr, flush=True)
            done[side] = run(checkouts[side], script, script_args, args.workdir / f"{side}_{i}.json")
        rounds.append({"order": list(order), **done})
    rows = compare(rounds, args.key, args.metric, args.tolerance)
    for row in rows:
        name = " ".join(str(row[k]) for k in args.key)
        print(f"{name}: after / before {row['ratio_median']:.3f} (rounds {min(row['ratios']):.3f}-"
              f"{max(row['ratios']):.3f}){'' if row['within_noise'] else '  OUTSIDE NOISE'}")
    result = {"before": checkouts["before"].name, "after": checkouts["after"].name, "script": script,
              "args": script_args, "metric": args.metric, "key": args.key, "tolerance": args.tolerance,
              "loads": [{side: r[side]["load_avg_before"] for side in ("before", "after")} for r in rounds],
              "rows": rows}
    path = write_result("paired", result, out=args.out)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
