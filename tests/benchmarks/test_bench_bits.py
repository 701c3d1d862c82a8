"""benchmarks/bench_bits.py on a tiny Llama (head_dim 32): bits as stored by length, the worst case over the last
lengths, and the fixed raw cost falling with the length."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import bench_bits  # noqa: E402
from bench_ppl import candidates  # noqa: E402
from conftest import tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def model():
    config = tiny_config("llama")
    config.head_dim = 32
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _tier(name):
    return next(c.tier for c in candidates(None, []) if c.tier.name == name)


def test_a_preset_stores_fewer_bits_the_longer_the_cache(model):
    rows = bench_bits.bits_by_length(model, _tier("flashcodec 3bit"), (256, 1024), span=64)
    assert [r["length"] for r in rows] == [256, 1024]
    for r in rows:
        assert r["bits_worst"] >= r["bits"] and r["length"] - 63 <= r["worst_at"] <= r["length"]
    assert rows[1]["bits"] < rows[0]["bits"]  # the raw sinks and newest keys are a fixed cost
    assert 2.75 < rows[1]["bits"] < 3.25  # 3-bit keys and 2-bit values, each + a 16-bit scale per 32 values


def test_a_tier_without_raw_tokens_stores_the_same_at_every_length(model):
    rows = bench_bits.bits_by_length(model, _tier("TurboQuant-style K3V2"), (256, 512), span=64)
    assert {round(r["bits"], 6) for r in rows} == {round(r["bits_worst"], 6) for r in rows} == {2.5 + 16 / 32}


def test_lengths_must_exceed_the_worst_case_span():
    with pytest.raises(SystemExit):
        bench_bits.main(["--lengths", "64"])
