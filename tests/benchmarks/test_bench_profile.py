"""bench_profile.py splits what the profiler recorded as it says: model matmuls, the cache's own operators (counted
per layer), other ATen operators, the rest of the wall time as untracked, allocations counted."""

from __future__ import annotations

from types import SimpleNamespace

import bench_profile
import pytest


def _event(key: str, self_us: float, count: int) -> SimpleNamespace:
    return SimpleNamespace(key=key, self_cpu_time_total=self_us, count=count)


EVENTS = [_event("aten::mm", 4000.0, 40), _event("flashcodec::append_attention", 1000.0, 4),
          _event("aten::cat", 300.0, 6), _event("aten::empty", 50.0, 10), _event("Torch-Compiled Region", 200.0, 2),
          _event("cudaLaunchKernel", 999.0, 1)]


def test_a_codec_step_counts_its_flashcodec_ops_as_the_cache_and_cat_as_other():
    row = bench_profile.summarize(EVENTS, "eager_4bit", 256, steps=2, layers=2, wall=0.004)
    assert row["model_mm_ms"] == 2.0 and row["cache_ops_ms"] == 0.5
    assert row["other_aten_ms"] == pytest.approx(0.175)
    assert row["cache_op_calls_per_layer"] == 1.0 and row["allocations_per_step"] == 5.0
    assert row["untracked_ms"] == pytest.approx(2.0 - (4000 + 1000 + 300 + 50 + 200) / 1e3 / 2)
    assert row["cache_ops"]["flashcodec::append_attention"] == {"calls_per_step": 2.0, "us_per_call": 250.0}


def test_the_raw_cache_counts_cat_as_its_cache_op():
    row = bench_profile.summarize(EVENTS[:4], "eager_raw", 256, steps=2, layers=2, wall=0.004)
    assert row["cache_ops_ms"] == pytest.approx(0.65) and row["cache_op_calls_per_layer"] == 2.5


def test_unknown_configs_are_refused(monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench_profile.py", "--configs", "eager_raw,eager_9bit"])
    with pytest.raises(ValueError, match="eager_9bit"):
        bench_profile.main()
