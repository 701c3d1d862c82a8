"""benchmarks/bench_fakequant.py models bench_ppl's streaming protocol: on a tiny Llama its KL is the real cache's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import bench_fakequant  # noqa: E402
from conftest import fresh_tiny_model, tiny_prompt  # noqa: E402

from flashcodec_fx.codecs import make_codec  # noqa: E402
from flashcodec_fx.evaluate import RAW, Tier, make_cache, prepared, token_kl  # noqa: E402
from flashcodec_fx.evaluate.drive import streamed_logprobs  # noqa: E402
from flashcodec_fx.evaluate.outliers import add_outlier_channels  # noqa: E402

LENGTH, PREFILL, CHUNK = 120, 12, 8
TIERS = [
    {"name": "3bit", "options": {"preset": "3bit"}},
    {"name": "2bit", "options": {"preset": "2bit"}},
    {"name": "dct keys", "options": {"key_options": {"mode": "jpeg", "block_size": 4, "quant_bits": [3, 2, 2, 1],
                                                     "levels": "lloyd", "rotate": True, "center": True, "sinks": 2,
                                                     "window": 5}, "value_options": {"mode": "jpeg", "block_size": 1,
                                                                                     "quant_bits": 2}}},
]


@pytest.fixture(scope="module")
def model():
    model = fresh_tiny_model("llama")
    add_outlier_channels(model, 16.0, key_channels=(1,), value_channels=(2,))  # the channel exponents take part
    return model


def test_the_kl_is_what_the_real_cache_gives(model):
    ids = tiny_prompt(2, LENGTH)
    rows = bench_fakequant.tier_kl(model, ids, TIERS, PREFILL, CHUNK)
    ref = streamed_logprobs(model, ids, make_cache(model, RAW), PREFILL, CHUNK)
    for row, tier in zip(rows, TIERS, strict=True):
        real = Tier(tier["name"], tier["options"])
        with prepared(model, real):
            lossy = streamed_logprobs(model, ids, make_cache(model, real), PREFILL, CHUNK)
        want = float(token_kl(ref, lossy).mean())
        assert want > 1e-6 and row["kl"] == pytest.approx(want, rel=0.05), (tier["name"], row["kl"], want)
    assert model.config._attn_implementation == "sdpa"  # restored


def test_exact_reads_follow_the_archive():
    """A query reads exactly its call's tokens, the sinks and the raw tail its call's append leaves."""
    codec = make_codec("jpeg", block_size=4, quant_bits=4, sinks=2, window=12)
    exact = bench_fakequant.exact_reads(codec, 40, 10, 8)
    # query 20 is in the call [18, 26): the tail after it starts at 14 (12 raw, groups of 4 from position 2)
    assert exact[20, :2].all() and not exact[20, 2:14].any() and exact[20, 14:].all()
    assert exact[5].all()  # the prefill reads itself exactly


def test_sliding_models_are_refused():
    with pytest.raises(ValueError, match="full-attention layers only"):
        bench_fakequant.check_model(fresh_tiny_model("gemma3"))


def test_the_raw_tier_reads_everything_exactly():
    model = fresh_tiny_model("llama")
    ids = tiny_prompt(1, 40)
    rows = bench_fakequant.tier_kl(model, ids, [{"name": "lossless", "options": {"preset": "lossless"}}], 8, 8)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # fp32 rounding: the value sum is split in two
    assert torch.isfinite(torch.tensor(rows[0]["ppl"]))
