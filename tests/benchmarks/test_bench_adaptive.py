"""benchmarks/bench_adaptive.py: the allocation is the exact multiple-choice knapsack optimum, and on a tiny random
Llama the whole calibrate / allocate / evaluate run keeps every adaptive twin within its uniform preset's bits."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

import bench_adaptive as adaptive  # noqa: E402
from conftest import tiny_model, tiny_prompt  # noqa: E402

LENGTH, PREFILL, CHUNK = 160, 32, 16  # past one 128-token key group after the 4 sinks, so every preset archives


@st.composite
def knapsacks(draw):
    layers, rungs = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    names = [f"r{j}" for j in range(rungs)]
    cost = {r: draw(st.lists(st.integers(0, 20), min_size=layers, max_size=layers)) for r in names}
    damage = {r: draw(st.lists(st.floats(-1.0, 10.0), min_size=layers, max_size=layers)) for r in names}
    cheapest = sum(min(cost[r][i] for r in names) for i in range(layers))
    return damage, cost, draw(st.integers(cheapest, cheapest + 40))


@settings(max_examples=200, deadline=None)
@given(knapsacks())
def test_allocation_is_the_brute_force_optimum(case):
    damage, cost, budget = case
    picks, total, spent = adaptive.allocate(damage, cost, budget)
    layers = range(len(picks))
    assert spent == sum(cost[r][i] for i, r in zip(layers, picks, strict=True)) <= budget
    assert total == pytest.approx(sum(damage[r][i] for i, r in zip(layers, picks, strict=True)))
    best = min(sum(damage[r][i] for i, r in enumerate(combo)) for combo in itertools.product(damage, repeat=len(picks))
               if sum(cost[r][i] for i, r in enumerate(combo)) <= budget)
    assert total == pytest.approx(best, abs=1e-9)


def test_allocation_spends_cheap_rungs_on_robust_layers():
    damage = {"2bit": [5.0, 0.1, 0.1, 4.0], "4bit": [0.5, 0.0, 0.0, 0.4]}
    cost = {"2bit": [2] * 4, "4bit": [4] * 4}
    assert adaptive.allocate(damage, cost, 12)[0] == ["4bit", "2bit", "2bit", "4bit"]


def test_allocation_rejects_infeasible_budgets_and_ragged_tables():
    damage, cost = {"a": [1.0, 2.0], "b": [0.0, 0.0]}, {"a": [1, 1], "b": [3, 3]}
    with pytest.raises(ValueError, match="budget 1 is below the cheapest allocation"):
        adaptive.allocate(damage, cost, 1)
    with pytest.raises(ValueError, match="one damage and one cost per layer"):
        adaptive.allocate({"a": [1.0], "b": [0.0, 0.0]}, cost, 4)
    with pytest.raises(ValueError, match="same non-empty rungs"):
        adaptive.allocate(damage, {"a": [1, 1]}, 4)


def test_per_layer_tiers_touch_codec_layers_only():
    model = tiny_model("hybrid")  # linear-attention layers 0 and 2 keep their native layer and may not be named
    assert adaptive.codec_layers(model) == [1, 3]
    tier = adaptive.per_layer_tier("t", model, {3: "3bit"})
    assert tier.options["per_layer"] == {1: None, 3: adaptive.preset_options("3bit")}
    assert adaptive.make_cache(model, tier).codec_layers == [3]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the fused CPU kernels' OpenMP regions crawl on an oversubscribed machine
    yield
    torch.set_num_threads(threads)


def test_quick_run_keeps_every_adaptive_twin_within_its_uniform_bits(one_thread):
    model = tiny_model("llama")
    payload = adaptive.run(model, tiny_prompt(1, LENGTH, seed=2), tiny_prompt(2, LENGTH, seed=3), prefill=PREFILL,
                           chunk=CHUNK)
    layers = model.config.num_hidden_layers
    assert set(payload["damage"]) == set(adaptive.LADDER) and all(len(d) == layers for d in payload["damage"].values())
    assert sum(payload["damage"]["2.5bit"]) > sum(payload["damage"]["4bit"]) > abs(sum(payload["damage"]["int8"]))
    rows = {row["tier"]: row for row in payload["rows"]}
    assert len(rows) == 1 + 2 * len(adaptive.UNIFORM) and rows["raw DynamicCache"]["kl"] == 0.0
    for name in adaptive.UNIFORM:
        uniform, twin, alloc = rows[f"uniform {name}"], rows[f"adaptive @ {name} bits"], payload["allocations"][name]
        assert alloc["budget_bits"] == sum(payload["layer_cost_bits"][name])
        assert alloc["allocated_bits"] <= alloc["budget_bits"]
        assert alloc["predicted_damage"] <= alloc["uniform_predicted_damage"]  # uniform is one feasible allocation
        assert twin["bits_end"] <= uniform["bits_end"] < 16  # measured again on the evaluation replica
        assert twin["kl"] > 0 and uniform["kl"] > 0
        if set(alloc["rungs"].values()) == {name}:  # the twin is the uniform preset, built through per_layer
            assert twin["kl"] == pytest.approx(uniform["kl"], rel=1e-6) and twin["bits_end"] == uniform["bits_end"]
