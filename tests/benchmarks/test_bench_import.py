"""benchmarks/bench_import.py: the commands it times, medians per command over rounds, ratios to ``import torch``."""

from __future__ import annotations

import statistics
import sys

import bench_import
import pytest


def test_it_times_the_commands_of_the_issue():
    argvs = bench_import.commands()
    assert {"import torch", "import flashcodec_fx", "flashcodec --version", "flashcodec --help"} <= set(argvs)
    assert argvs["flashcodec --version"][-1] == "--version" and argvs["flashcodec --help"][-1] == "--help"


def test_medians_and_ratios_per_command():
    argvs = {"import torch": [sys.executable, "-c", "pass"], "other": [sys.executable, "-c", "print('x')"]}
    result = bench_import.measure(argvs, repeats=3, warmup=0)
    assert len(result["load_1m_per_round"]) == 3
    rows = {row["command"]: row for row in result["rows"]}
    for row in rows.values():
        assert len(row["walls"]) == len(row["cpus"]) == 3
        assert row["wall_s"] == statistics.median(row["walls"]) and row["cpu_s"] == statistics.median(row["cpus"])
        assert row["wall_vs_torch"] == row["wall_s"] / rows["import torch"]["wall_s"]
    assert rows["import torch"]["wall_vs_torch"] == 1.0


def test_a_failing_command_raises_and_bad_counts_too():
    with pytest.raises(RuntimeError, match="failed \\(3\\).*boom"):
        bench_import.measure({"bad": [sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"]}, 1, 0)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        bench_import.measure({}, 0)
