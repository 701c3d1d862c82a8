"""bench_step.py times what it claims: its paths are one decode step each (the fused op leaves the states the three
ops leave and returns their output), the state goes back to the same length between timed calls, and the rows,
ratios and table come out of the samples."""

from __future__ import annotations

import argparse

import bench_step
import torch


def test_the_paths_are_one_step_each_and_reset_puts_the_length_back(cpu_kernels):
    fused, three = bench_step.Layer("4bit", 40, seed=0), bench_step.Layer("4bit", 40, seed=0)
    length = int(fused.ks[bench_step.LENGTH])
    got = fused.paths(["fused"])["fused"]()
    want = three.paths(["three_ops"])["three_ops"]()
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(fused.ks + fused.vs, three.ks + three.vs, strict=True))
    assert int(fused.ks[bench_step.LENGTH]) == length + 1
    fused.reset()
    assert int(fused.ks[bench_step.LENGTH]) == int(fused.vs[bench_step.LENGTH]) == length
    raw = fused.paths(["raw"])["raw"]()
    assert raw.shape == fused.q.shape


def test_rows_ratios_and_table(cpu_kernels):
    args = argparse.Namespace(threads=[1], lengths=[40], presets=["int8"], rounds=3, warmup=1)
    rows = bench_step.measure(args, bench_step.PATHS)
    assert len(rows) == 1 and {"fused", "three_ops", "raw", "load_before"} <= set(rows[0])
    before = [{"threads": 1, "L": 40, "preset": "int8", "load_before": [0.0, 0.0, 0.0],
               "three_ops": {"median_us": 300.0}, "raw": {"median_us": 100.0}}]
    bench_step.merge(rows, before)
    bench_step.ratios(rows[0])
    assert rows[0]["before_three_ops_vs_raw"] == 3.0
    assert rows[0]["fused_vs_raw"] == round(rows[0]["fused"]["median_us"] / rows[0]["raw"]["median_us"], 3)
    assert "| 1 | 40 | int8 |" in bench_step.table(rows) and "300 (100)" in bench_step.table(rows)
