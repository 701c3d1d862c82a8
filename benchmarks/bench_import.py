"""Start-up time: ``import torch``, ``import flashcodec_fx`` and the ``flashcodec`` command's quick answers (issue 32).

    python benchmarks/bench_import.py               # 7 rounds: about a minute on a quiet 2-core machine
    python benchmarks/bench_import.py --repeats 3   # fewer rounds on a busy one

Each command runs in a fresh interpreter, ``--repeats`` rounds after one untimed warm-up round (file cache); a round
runs every command once, one after the other, so a change of load hits all of them alike. Per command: the median
wall time and the median CPU time of the child (user + sys: steadier than wall on a shared machine), and both as a
ratio to ``import torch`` (target: the CLI's calls within 1.5x of it). The load average is recorded before each
round. ``python -c pass`` is the interpreter's own start. Output: ``results/import_time.json``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import write_result

TARGET_RATIO = 1.5  # the CLI's quick answers within this factor of `import torch`


def cli_command() -> list[str]:
    """The ``flashcodec`` console script next to this interpreter, else ``python -m flashcodec_fx.cli``."""
    script = Path(sys.executable).with_name("flashcodec")
    return [str(script)] if script.exists() else [sys.executable, "-m", "flashcodec_fx.cli"]


def commands() -> dict[str, list[str]]:
    """Name -> argv of every command timed."""
    cli = cli_command()
    return {"python -c pass": [sys.executable, "-c", "pass"],
            "import torch": [sys.executable, "-c", "import torch"],
            "import flashcodec_fx": [sys.executable, "-c", "import flashcodec_fx"],
            "flashcodec --version": [*cli, "--version"],
            "flashcodec --help": [*cli, "--help"]}


def timed(argv: list[str]) -> tuple[float, float]:
    """``(wall_s, cpu_s)`` of one run of ``argv`` (cpu: the child's user + sys time); raises if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(argvs: dict[str, list[str]], repeats: int, warmup: int = 1) -> dict:
    """``{"rows": [{"command", "argv", "wall_s", "cpu_s", "walls", "cpus", "wall_vs_torch", "cpu_vs_torch"}],
    "load_1m_per_round": [...]}``: medians over ``repeats`` rounds (after ``warmup`` untimed ones)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    walls = {name: [] for name in argvs}
    cpus = {name: [] for name in argvs}
    loads = []
    for round_ in range(warmup + repeats):
        if round_ >= warmup:
            loads.append(os.getloadavg()[0])
        for name, argv in argvs.items():
            wall, cpu = timed(argv)
            if round_ >= warmup:
                walls[name].append(wall)
                cpus[name].append(cpu)
    rows = [{"command": name, "argv": argv[1:] if argv[0] == sys.executable else [Path(argv[0]).name, *argv[1:]],
             "wall_s": statistics.median(walls[name]), "cpu_s": statistics.median(cpus[name]),
             "walls": walls[name], "cpus": cpus[name]} for name, argv in argvs.items()]
    torch_row = next((row for row in rows if row["command"] == "import torch"), None)
    for row in rows:
        row["wall_vs_torch"] = None if torch_row is None else row["wall_s"] / torch_row["wall_s"]
        row["cpu_vs_torch"] = None if torch_row is None else row["cpu_s"] / torch_row["cpu_s"]
    return {"rows": rows, "load_1m_per_round": loads}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--out", default=None, help="JSON path (default results/import_time.json)")
    args = parser.parse_args(argv)
    result = measure(commands(), args.repeats)
    print("| command | wall s | cpu s | wall vs import torch | cpu vs import torch |\n|---|---|---|---|---|")
    for row in result["rows"]:
        print(f"| `{row['command']}` | {row['wall_s']:.2f} | {row['cpu_s']:.2f} | {row['wall_vs_torch']:.2f} | "
              f"{row['cpu_vs_torch']:.2f} |")
    cli_rows = [row for row in result["rows"] if row["command"].startswith("flashcodec ")]
    payload = {"repeats": args.repeats, "warmup_rounds": 1, "target_ratio_vs_import_torch": TARGET_RATIO,
               "within_target": all(row["wall_vs_torch"] <= TARGET_RATIO for row in cli_rows),
               "method": "fresh interpreter per command; rounds run every command once in turn; medians of the "
                         "child's wall time and CPU time (user + sys)", **result}
    print(f"wrote {write_result('import_time', payload, out=args.out)}")


if __name__ == "__main__":
    main()
