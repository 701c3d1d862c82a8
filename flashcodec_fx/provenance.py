"""Where a measured result comes from: date, machine, versions and the git commit of the code that produced it.

Every JSON result (the main job's ``--out``, each benchmark's ``benchmarks/results/*.json``) starts with
:func:`metadata`, so a figure can always be traced to the commit, machine and load it was measured at.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

CHECKOUT = Path(__file__).resolve().parent.parent  # the source checkout when installed editable / run from source
VERSIONED = ("torch", "transformers", "triton")
# Instruction-set flags that pick the CPU kernels' loops (``-march=native``): kernels on other flags round differently
SIMD_FLAGS = ("avx2", "fma", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vbmi", "avx512_bf16", "amx_tile")


def version(dist: str) -> str | None:
    """Installed version of the distribution ``dist``, None when absent."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, timeout=10,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """``{"git_commit": sha or None, "git_dirty": bool or None}`` of the checkout holding this package (None outside
    a git checkout). ``git_dirty``: tracked files differ from the commit (the code measured is not exactly it)."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"git_commit": None, "git_dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def cpu_simd() -> list[str] | None:
    """The :data:`SIMD_FLAGS` this CPU has (Linux ``/proc/cpuinfo``), None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else [flag for flag in SIMD_FLAGS if flag in flags]


def metadata() -> dict[str, Any]:
    """Date (UTC, ISO 8601), machine (platform, processor, SIMD flags, cpu count, torch threads, GPU, load average),
    versions (python, torch, transformers, triton: None when absent; flashcodec_fx, the git commit and dirty flag)."""
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_simd": cpu_simd(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_avg_1_5_15m": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,  # other work slows timings
    }
    import flashcodec_fx

    versions = {"python": platform.python_version(), **{name: version(name) for name in VERSIONED},
                "flashcodec_fx": flashcodec_fx.__version__, **git_state()}
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine, "versions": versions}


def write_json(path: str | os.PathLike, name: str, payload: dict[str, Any]) -> Path:
    """Write ``{"benchmark": name, **metadata(), **payload}`` as indented JSON to ``path`` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, **metadata(), **payload}, indent=2) + "\n")
    return path
