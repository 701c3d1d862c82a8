"""Shared helpers for benchmarks: run metadata, JSON results, timing. Small on purpose; import it, don't copy it.

Usage from a script in ``benchmarks/``::

    from common import median_time, metadata, write_result
    write_result("mybench", {"rows": rows}, out=args.out)   # -> benchmarks/results/mybench.json
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from flashcodec_fx.provenance import metadata, write_json

RESULTS_DIR = Path(__file__).resolve().parent / "results"
__all__ = ["RESULTS_DIR", "median_time", "median_times", "metadata", "write_result"]


def write_result(name: str, payload: dict, out: str | Path | None = None) -> Path:
    """Write ``{"benchmark": name, **metadata(), **payload}`` as indented JSON to ``out`` (default
    ``benchmarks/results/<name>.json``); :func:`flashcodec_fx.provenance.metadata` records date, machine, load,
    versions and the git commit."""
    return write_json(out if out is not None else RESULTS_DIR / f"{name}.json", name, payload)


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
