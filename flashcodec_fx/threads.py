"""How many CPU threads torch and the fused C++ kernels use: the thread policy of ``flashcodec run`` and the
benchmarks (``--threads auto|N``; ``benchmarks/common.py`` applies the same function).

Why a policy: on a machine shared with other processes, several OpenMP threads per process collapse. Next to a
2-thread torch process on 2 cores, a 2-thread SmolLM2 decode ran 3-49x slower than alone (PyTorch's own kernels
worst), while a 1-thread decode lost what its share of the cores costs, no more (``benchmarks/bench_e2e.py
--neighbours``: the README's busy-machine table; the main job: ``benchmarks/bench_main_job.py`` ->
``benchmarks/results/main_job_busy.json``).
An OpenMP team waits at every region's barrier for its slowest thread, and a thread the OS has descheduled for
another process's holds it a whole time slice; one thread has no barrier to wait at.

``auto``: measure how many cores other processes keep busy now (:func:`other_busy_cores`: ``/proc/stat`` over
:data:`SAMPLE_S` seconds, this process's own CPU time subtracted) and use the cores they leave free, rounded, at
least one and at most torch's default (:func:`auto_threads`). A quiet machine gets torch's default; a busy one, one
thread. Where ``/proc/stat`` is missing (not Linux) ``auto`` keeps torch's default and says so. The fused C++ kernels
size their helper threads from ``torch.get_num_threads()``, so one setting covers both.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

AUTO = "auto"
SAMPLE_S = 0.3
"""Seconds :func:`other_busy_cores` watches the machine for (``auto``)."""
_STAT = "/proc/stat"
_default: int | None = None


@dataclass(frozen=True)
class ThreadChoice:
    """What :func:`apply_threads` set: ``threads`` torch threads for the ``setting`` asked for (``"auto"`` or a
    number), the cores other processes kept busy when it looked (None: not measured), and why, in words."""

    threads: int
    setting: str
    other_busy_cores: float | None
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_threads(value: str | int) -> str | int:
    """``"auto"`` or a positive int from a command-line value; ValueError naming what is allowed."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"threads must be 'auto' or an int >= 1, got {type(value).__name__}")
    if value == AUTO:
        return AUTO
    try:
        threads = int(value)
    except ValueError:
        raise ValueError(f"threads must be 'auto' or an integer >= 1, got {value!r}") from None
    if threads < 1:
        raise ValueError(f"threads must be 'auto' or an integer >= 1, got {threads}")
    return threads


def _cpu_jiffies() -> tuple[int, int, int] | None:
    """``(busy, total, cpus)`` of ``/proc/stat``: clock ticks spent busy and in all, summed over the online CPUs."""
    try:
        with open(_STAT) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    fields = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    idle = fields[3] + fields[4]
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return sum(fields) - idle, sum(fields), cpus


def _own_jiffies() -> float:
    """This process's CPU time (every thread, user + system) in clock ticks."""
    times = os.times()
    return (times.user + times.system) * os.sysconf("SC_CLK_TCK")


def other_busy_cores(interval: float = SAMPLE_S) -> float | None:
    """How many cores other processes kept busy during the next ``interval`` seconds (0 .. the CPU count), this
    process's own CPU time subtracted; None where ``/proc/stat`` cannot be read."""
    before, own_before = _cpu_jiffies(), _own_jiffies()
    if before is None:
        return None
    time.sleep(interval)
    after, own_after = _cpu_jiffies(), _own_jiffies()
    if after is None or after[1] <= before[1]:
        return None
    others = (after[0] - before[0]) - (own_after - own_before)
    return max(0.0, others / (after[1] - before[1]) * after[2])


def auto_threads(default: int, busy: float | None, cores: int | None = None) -> int:
    """Threads for ``auto``: the ``cores`` (default: those this process may run on) that ``busy`` leaves free,
    rounded, within ``[1, default]``; ``default`` when ``busy`` is unknown."""
    if busy is None:
        return default
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(default, math.floor(cores - busy + 0.5)))


def default_threads() -> int:
    """torch's thread count before this module first changed it (``OMP_NUM_THREADS`` or torch's own choice)."""
    global _default
    if _default is None:
        import torch

        _default = torch.get_num_threads()
    return _default


def choose_threads(setting: str | int = AUTO) -> ThreadChoice:
    """The :class:`ThreadChoice` for ``setting`` (``"auto"`` or a positive int), measuring the machine for ``auto``;
    changes nothing."""
    setting = parse_threads(setting)
    default = default_threads()
    if setting != AUTO:
        return ThreadChoice(setting, str(setting), None, "asked for")
    busy = other_busy_cores()
    threads = auto_threads(default, busy)
    if busy is None:
        reason = f"{_STAT} unreadable: torch's default"
    elif threads < default:
        reason = f"other processes keep {busy:.1f} cores busy: {threads} of {default}"
    else:
        reason = f"other processes keep {busy:.1f} cores busy: torch's default"
    return ThreadChoice(threads, AUTO, None if busy is None else round(busy, 2), reason)


def apply_threads(setting: str | int = AUTO) -> ThreadChoice:
    """Choose (:func:`choose_threads`) and set ``torch.set_num_threads``; returns the choice."""
    choice = choose_threads(setting)
    import torch

    torch.set_num_threads(choice.threads)
    return choice


__all__ = ["AUTO", "SAMPLE_S", "ThreadChoice", "apply_threads", "auto_threads", "choose_threads", "default_threads",
           "other_busy_cores", "parse_threads"]
