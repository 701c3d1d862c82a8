"""Shared helpers for benchmarks: run metadata, JSON results, timing. Small on purpose; import it, don't copy it.

Usage from a script in ``benchmarks/``::

    from common import median_time, metadata, write_result
    write_result("mybench", {"rows": rows}, out=args.out)   # -> benchmarks/results/mybench.json
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_VERSIONED = ("torch", "transformers", "triton")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    head = Path(__file__).resolve().parent.parent / ".git"
    try:
        ref = (head / "HEAD").read_text().strip()
        return (head / ref[5:]).read_text().strip() if ref.startswith("ref: ") else ref
    except OSError:
        return None


def metadata() -> dict:
    """Date (UTC, ISO 8601), machine (platform, processor, cpu count, torch threads, GPU, load average), versions
    (python, torch, transformers, triton: None when absent; flashcodec_fx and the git commit of this checkout)."""
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_avg_1_5_15m": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,  # other work slows timings
    }
    import flashcodec_fx

    versions = {"python": platform.python_version(), **{name: _version(name) for name in _VERSIONED},
                "flashcodec_fx": flashcodec_fx.__version__, "git_commit": _git_commit()}
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine, "versions": versions}


def write_result(name: str, payload: dict, out: str | Path | None = None) -> Path:
    """Write ``{**metadata(), **payload}`` as indented JSON to ``out`` (default ``benchmarks/results/<name>.json``)."""
    path = Path(out) if out is not None else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, **metadata(), **payload}, indent=2) + "\n")
    return path


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
