"""benchmarks/bench_adaptive.py: the per-layer allocation is the exact knapsack optimum."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("transformers")

import bench_adaptive as adaptive  # noqa: E402


def test_adaptive_allocation_is_the_exact_knapsack_optimum():
    gen = torch.Generator().manual_seed(0)
    damage = {k: (torch.rand(5, generator=gen) / k).tolist() for k in adaptive.LADDER[:-1]} | {adaptive.LADDER[-1]: [0.0] * 5}
    cheapest = 5 * min(adaptive.LADDER)
    for budget in (cheapest, cheapest + 3, 14, 20, 27, 40):
        picks, total = adaptive.allocate(damage, budget)
        brute = min((sum(damage[k][i] for i, k in enumerate(c)), c)
                    for c in itertools.product(adaptive.LADDER, repeat=5) if sum(c) <= budget)
        assert sum(picks) <= budget and total == pytest.approx(brute[0])
    with pytest.raises(ValueError, match="budget"):
        adaptive.allocate(damage, cheapest - 1)
