"""flashcodec_fx/threads.py: the thread policy of the CLI and the benchmarks (parsing, the auto rule, measuring the
other processes' load with this process's own CPU time taken out)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx import threads


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("value", "parsed"), [("auto", "auto"), ("3", 3), (2, 2), ("1", 1)])
def test_parse_threads(value, parsed):
    assert threads.parse_threads(value) == parsed


@pytest.mark.parametrize("value", ["0", "-1", "two", "", 0, "1.5"])
def test_parse_threads_names_what_is_allowed(value):
    with pytest.raises(ValueError, match=r"threads must be 'auto' or an integer >= 1, got "):
        threads.parse_threads(value)


@pytest.mark.parametrize("value", [None, True, 1.5, [1]])
def test_parse_threads_refuses_other_types(value):
    with pytest.raises(TypeError, match="threads must be 'auto' or an int >= 1, got "):
        threads.parse_threads(value)


@pytest.mark.parametrize(("default", "busy", "cores", "expected"), [
    (2, 0.0, 2, 2), (2, 0.4, 2, 2), (2, 0.6, 2, 1), (2, 2.0, 2, 1), (2, 5.0, 2, 1), (2, None, 2, 2),
    (16, 3.2, 16, 13), (8, 0.0, 16, 8), (1, 0.0, 2, 1),
])
def test_auto_uses_the_cores_others_leave_free(default, busy, cores, expected):
    assert threads.auto_threads(default, busy, cores) == expected


@given(default=st.integers(1, 64), cores=st.integers(1, 64), busy=st.floats(0, 128), more=st.floats(0, 16))
def test_auto_is_within_one_and_the_default_and_never_grows_with_load(default, cores, busy, more):
    chosen = threads.auto_threads(default, busy, cores)
    assert 1 <= chosen <= default
    assert threads.auto_threads(default, busy + more, cores) <= chosen


def test_other_busy_cores_takes_this_process_out(monkeypatch):
    """150 busy ticks of 200 over 2 CPUs, 50 of them this process's: others kept (150 - 50) / 200 * 2 = 1 core."""
    machine = iter([(1000, 2000, 2), (1150, 2200, 2)])
    own = iter([300.0, 350.0])
    monkeypatch.setattr(threads, "_cpu_jiffies", lambda: next(machine))
    monkeypatch.setattr(threads, "_own_jiffies", lambda: next(own))
    assert threads.other_busy_cores(0.0) == pytest.approx(1.0)


def test_other_busy_cores_is_none_without_proc_stat(monkeypatch, tmp_path):
    monkeypatch.setattr(threads, "_STAT", str(tmp_path / "missing"))
    assert threads.other_busy_cores(0.0) is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc/stat (not Linux)")
def test_other_busy_cores_reads_this_machine():
    busy, total, cpus = threads._cpu_jiffies()
    assert 0 <= busy <= total and cpus >= 1
    measured = threads.other_busy_cores(0.05)
    assert measured is not None and 0.0 <= measured <= cpus


def test_choose_threads_auto_says_why(monkeypatch):
    monkeypatch.setattr(threads, "_default", 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(threads, "other_busy_cores", lambda: 1.8)
    busy = threads.choose_threads("auto")
    assert (busy.threads, busy.setting, busy.other_busy_cores) == (1, "auto", 1.8)
    assert busy.reason == "other processes keep 1.8 cores busy: 1 of 2"
    monkeypatch.setattr(threads, "other_busy_cores", lambda: 0.1)
    assert threads.choose_threads("auto").reason == "other processes keep 0.1 cores busy: torch's default"
    monkeypatch.setattr(threads, "other_busy_cores", lambda: None)
    unknown = threads.choose_threads("auto")
    assert unknown.threads == 2 and unknown.other_busy_cores is None and "unreadable" in unknown.reason


def test_a_number_is_used_as_asked_without_measuring(monkeypatch, torch_threads):
    monkeypatch.setattr(threads, "other_busy_cores", lambda: pytest.fail("measured a fixed setting"))
    choice = threads.apply_threads("1")
    assert choice.as_dict() == {"threads": 1, "setting": "1", "other_busy_cores": None, "reason": "asked for"}
    assert torch.get_num_threads() == 1


def test_apply_threads_sets_torch(monkeypatch, torch_threads):
    monkeypatch.setattr(threads, "_default", 2)
    monkeypatch.setattr(threads, "other_busy_cores", lambda: 0.0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert threads.apply_threads("auto").threads == 2 and torch.get_num_threads() == 2
    monkeypatch.setattr(threads, "other_busy_cores", lambda: 2.0)
    assert threads.apply_threads("auto").threads == 1 and torch.get_num_threads() == 1
