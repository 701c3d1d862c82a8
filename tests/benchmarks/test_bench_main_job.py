"""benchmarks/bench_main_job.py: thread settings, the ratios to the quiet run and issue 32's targets (the runs
themselves are the full main job: the benchmark, not a test)."""

from __future__ import annotations

import pytest
from bench_main_job import add_ratios, parse_setting, targets


@pytest.mark.parametrize(("setting", "parsed"), [
    ("auto", ("auto", {})), ("1", ("1", {})), ("default", ("4", {})),
    ("default+passive", ("4", {"OMP_WAIT_POLICY": "PASSIVE"})), ("auto+passive", ("auto", {"OMP_WAIT_POLICY": "PASSIVE"})),
])
def test_settings_are_a_threads_value_and_an_environment(setting, parsed):
    assert parse_setting(setting, 4) == parsed


@pytest.mark.parametrize("setting", ["0", "fast", "default+active"])
def test_bad_settings_name_what_is_allowed(setting):
    with pytest.raises(ValueError, match="threads must be 'auto' or an integer >= 1"):
        parse_setting(setting, 4)


def _runs():
    return [{"setting": "auto", "neighbour": "none", "work_s": 100.0, "tiers_s": 50.0, "process_s": 110.0},
            {"setting": "auto", "neighbour": "omp", "work_s": 150.0, "tiers_s": 100.0, "process_s": 170.0},
            {"setting": "2", "neighbour": "none", "work_s": 80.0, "tiers_s": 40.0, "process_s": 90.0},
            {"setting": "2", "neighbour": "omp", "work_s": 800.0, "tiers_s": 700.0, "process_s": 820.0},
            {"setting": "2", "neighbour": "python", "error": "killed"}]


def test_ratios_are_to_the_same_settings_quiet_run():
    runs = _runs()
    add_ratios(runs)
    assert [r.get("vs_quiet") for r in runs] == [1.0, 1.5, 1.0, 10.0, None]
    assert [r.get("tiers_vs_quiet") for r in runs] == [1.0, 2.0, 1.0, 17.5, None]


def test_targets_read_auto_beside_omp_and_auto_alone():
    runs = _runs()
    add_ratios(runs)
    assert targets(runs) == {"auto_beside_omp_vs_quiet": 1.5, "auto_beside_omp_within_2x": True,
                             "auto_quiet_work_s": 100.0, "auto_quiet_process_s": 110.0, "auto_quiet_under_3_min": True}
    failed = [r | {"error": "timed out"} if r["setting"] == "auto" and r["neighbour"] == "omp" else r for r in runs]
    assert targets(failed)["auto_beside_omp_within_2x"] is None  # a failed run proves nothing
