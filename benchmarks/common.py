"""Shared helpers for benchmarks: run metadata, JSON results, timing. Small on purpose; import it, don't copy it.

Usage from a script in ``benchmarks/``::

    from common import median_time, metadata, write_result
    write_result("mybench", {"rows": rows}, out=args.out)   # -> benchmarks/results/mybench.json

Threads: ``add_threads_argument(parser, default)``, then ``flashcodec_fx.threads.apply_threads(args.threads)``, give a
benchmark the CLI's ``--threads auto|N`` (one policy for the command and the benchmarks).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from flashcodec_fx.provenance import metadata, write_json
from flashcodec_fx.threads import parse_threads

RESULTS_DIR = Path(__file__).resolve().parent / "results"
__all__ = ["NEIGHBOURS", "RESULTS_DIR", "add_threads_argument", "copy_gbps", "median_time", "median_times", "metadata",
           "neighbour", "write_result"]

# CPU-burning neighbour processes (a shared machine's other jobs, on purpose): pure-Python busy loops, one per core;
# or one process running a torch matmul loop on every core (OpenMP threads, like another model's decode).
_BURNERS = {
    "python": ["while True: pass"],
    "omp": ["import os, torch\ntorch.set_num_threads(os.cpu_count())\na = torch.randn(512, 512)\nwhile True: a @ a"],
}
NEIGHBOURS = ("none", *_BURNERS)


def write_result(name: str, payload: dict, out: str | Path | None = None) -> Path:
    """Write ``{"benchmark": name, **metadata(), **payload}`` as indented JSON to ``out`` (default
    ``benchmarks/results/<name>.json``); :func:`flashcodec_fx.provenance.metadata` records date, machine, load,
    versions and the git commit."""
    return write_json(out if out is not None else RESULTS_DIR / f"{name}.json", name, payload)


def add_threads_argument(parser: argparse.ArgumentParser, default: str | int, what: str = "torch threads") -> None:
    """``--threads auto|N`` (``default``), parsed by :func:`flashcodec_fx.threads.parse_threads`."""
    def parse(value: str) -> str | int:
        try:
            return parse_threads(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parser.add_argument("--threads", type=parse, default=parse_threads(default), metavar="auto|N",
                        help=f"{what} (default {default}; auto: torch's default on a quiet machine, fewer, down to "
                             "one, for the cores other processes keep busy: flashcodec_fx/threads.py)")


def median_times(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Medians over ``repeats`` runs of ``fn()`` after ``warmup`` untimed runs (CUDA synced), in seconds:
    ``wall_s`` (wall clock) and ``cpu_s`` (this process's CPU time, all threads: steadier on a shared machine)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        sync()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu)}


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs after ``warmup`` untimed runs (CUDA synced)."""
    return median_times(fn, repeats, warmup)["wall_s"]


@contextlib.contextmanager
def neighbour(kind: str) -> Iterator[list[subprocess.Popen]]:
    """Run the CPU-burning neighbour ``kind`` (:data:`NEIGHBOURS`; ``none``: nothing) for the duration of the block
    (it yields the processes): ``python`` starts one pure-Python busy loop per core, ``omp`` one process whose torch
    matmul loop keeps an OpenMP thread on every core. They are killed when the block ends."""
    if kind not in NEIGHBOURS:
        raise ValueError(f"neighbour must be one of {NEIGHBOURS}, got {kind!r}")
    import os

    procs = []
    if kind != "none":
        copies = (os.cpu_count() or 1) if kind == "python" else 1
        procs = [subprocess.Popen([sys.executable, "-c", _BURNERS[kind][0]], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for _ in range(copies)]
        time.sleep(2.0)  # let them start burning (torch's import takes a second)
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def copy_gbps(nbytes: int, repeats: int = 5) -> float:
    """The machine's copy bandwidth for a buffer of ``nbytes`` (GB/s of bytes read, median of ``repeats`` copies of
    one fp32 tensor into another, on this process's torch threads): the physical floor next to a kernel's reads."""
    src = torch.ones(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    return nbytes / median_time(lambda: dst.copy_(src), repeats=repeats, warmup=1) / 1e9
