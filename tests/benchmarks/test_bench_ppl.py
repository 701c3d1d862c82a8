"""benchmarks/bench_ppl.py on a tiny random bf16 Llama (head_dim 32, so KIVI's 32-channel groups fit): the lockstep
streaming rows, the worst-case bit accounting and the tier selection."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import bench_ppl  # noqa: E402
from conftest import tiny_config, tiny_prompt  # noqa: E402
from peers.fakequant import Span  # noqa: E402
from peers.kivi import KiviPolicy  # noqa: E402

from flashcodec_fx.evaluate import RAW  # noqa: E402

LENGTH, PREFILL, CHUNK = 200, 40, 16


@pytest.fixture(scope="module")
def model():
    config = tiny_config("llama")
    config.head_dim = 32
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16)


def _by_name(names):
    return [c for c in bench_ppl.candidates(None, []) if c.tier.name in names]


def test_lockstep_rows_measure_kl_ppl_and_bits(model):
    batch = tiny_prompt(3, LENGTH)
    tiers = _by_name(["flashcodec lossless", "KIVI-2", "TurboQuant-style K3V2"])
    rows = {r["tier"]: r for r in bench_ppl.stream_all(model, batch, tiers, PREFILL, CHUNK)}
    raw = rows[RAW.name]
    config = model.config
    assert raw["run_values_end"] == 2 * config.num_hidden_layers * 3 * config.num_key_value_heads * LENGTH * 32
    assert raw["kl"] == 0.0 and raw["run_bits_end"] == 16.0 and raw["delta_ppl"] == 0.0
    with torch.no_grad():  # the raw row's NLL is the full forward's over the scored tokens
        logprobs = torch.log_softmax(model(input_ids=batch).logits.float(), -1)[:, PREFILL - 1:-1]
    full_nll = -logprobs.gather(-1, batch[:, PREFILL:, None]).mean()
    assert raw["nll"] == pytest.approx(float(full_nll), abs=0.02)
    # lossless values; what remains is bf16 rounding: the stored-form attention accumulates in fp32 where SDPA rounds
    assert rows["flashcodec lossless"]["kl"] < 0.1 * rows["KIVI-2"]["kl"]
    assert rows["KIVI-2"]["kl"] > 0 and rows["TurboQuant-style K3V2"]["kl"] > 0
    assert rows["TurboQuant-style K3V2"]["run_bits_end"] == pytest.approx(2.5 + 16 / 32)
    assert len(raw["kl_per_window"]) == 3
    assert math.isclose(raw["ppl"], math.exp(raw["nll"]))


def test_worst_bits_is_the_maximum_of_the_format_over_the_last_lengths(model):
    policy = KiviPolicy(2)
    result = bench_ppl.stored_bits(model, bench_ppl.peer_tiers()[0][1], 1, 280, PREFILL, CHUNK, 64)
    heads, d = model.config.num_key_value_heads, 32

    def bits(n):
        span = Span(1, heads, d, 0, n, policy.key_boundary(n), policy.value_boundary(n))
        stored = policy.stored_bytes(span)
        return 8 * (stored["archive_used"] + stored["tail"]) / (2 * heads * n * d)

    expected = max(range(280 - 63, 280 + 1), key=bits)
    assert result["worst_at"] == expected and result["bits_worst"] == pytest.approx(bits(expected))
    assert result["bits_end"] == pytest.approx(bits(280))
    assert result["bits_worst"] > result["bits_end"]  # keys waiting for their 128-token flush
    raw = bench_ppl.stored_bits(model, RAW, 1, LENGTH, PREFILL, CHUNK, 64)
    assert raw["bits_worst"] == raw["bits_end"] == 16.0


def test_bf16_replica_bits_equal_the_run_caches_bits(model):
    """The replica (random states, same updates) is what bits_end reports: in a bf16 run it must equal the bytes
    of the caches that produced the KL."""
    tiers = _by_name(["png keep=1.0", "jpeg r=8 K=8 int8", "jpeg r=8 K=2 int8", "KIVI-4", "TurboQuant-style K4V4"])
    rows = bench_ppl.stream_all(model, tiny_prompt(2, LENGTH), tiers, PREFILL, CHUNK)
    for row, cand in zip(rows[1:], tiers, strict=True):
        replica = bench_ppl.stored_bits(model, cand.tier, 2, LENGTH, PREFILL, CHUNK, 64)
        assert replica["bits_end"] == pytest.approx(row["run_bits_end"], rel=1e-12), cand.tier.name


def test_tier_selection_and_json_tiers():
    picked = bench_ppl.candidates(["KIVI", "quanto int4"], [])
    assert [c.tier.name for c in picked] == ["KIVI-2", "KIVI-4", "quanto int4"]
    with pytest.raises(ValueError, match="unknown"):
        bench_ppl.candidates(["KIVI-3"], [])
    custom = bench_ppl.json_tier('{"name": "try", "options": {"mode": "png"}}')
    assert (custom.tier.name, custom.tier.options, custom.family) == ("try", {"mode": "png"}, bench_ppl.CUSTOM)
    for bad in ("not json", '{"name": "x"}', '["x"]'):
        with pytest.raises(ValueError, match="--tier-json"):
            bench_ppl.json_tier(bad)


def test_runnable_reports_why_a_peer_cannot_run():
    config = tiny_config("llama")  # head_dim 16: KIVI's 32-channel value groups do not fit
    torch.manual_seed(0)
    small = transformers.LlamaForCausalLM(config).eval()
    ok, skipped = bench_ppl.runnable(small, _by_name(["KIVI-2", "TurboQuant-style K4V4"]))
    assert [c.tier.name for c in ok] == ["KIVI-2", "TurboQuant-style K4V4"]  # head_dim is checked on first update
    gemma = tiny_config("gemma3")
    gemma.head_dim = 32
    torch.manual_seed(0)
    sliding = transformers.Gemma3ForCausalLM(gemma).eval()
    ok, skipped = bench_ppl.runnable(sliding, _by_name(["quanto int4"]))
    if skipped:  # optimum-quanto installed or not, transformers refuses sliding layers (or the import fails)
        assert "quanto int4" == skipped[0]["tier"] and skipped[0]["reason"]
    assert not ok


def _result(tmp_path, name, model, windows=6, chunk=16):
    result = {"benchmark": "ppl", "date": "2026-12-01", "machine": {"cpu_count": 2}, "versions": {"git_commit": "a" * 40},
              "total_seconds": 1.0, "protocol": {"windows": windows, "chunk": chunk}, "dtype": "float32",
              "stored_dtype": "bfloat16",
              "raw_bits_per_value": 16, "quick": False, "method": "m", "models": {model: {"rows": [{"tier": "t"}]}}}
    path = tmp_path / name
    path.write_text(json.dumps(result))
    return path


def test_merge_joins_single_model_runs_of_one_protocol(tmp_path):
    a, b = _result(tmp_path, "a.json", "m1"), _result(tmp_path, "b.json", "m2")
    merged = bench_ppl.merge([a, b])
    assert list(merged["models"]) == ["m1", "m2"] and merged["merged_from"] == ["a.json", "b.json"]
    assert merged["models"]["m2"]["run"]["file"] == "b.json" and merged["models"]["m2"]["rows"] == [{"tier": "t"}]
    fewer = bench_ppl.merge([a, _result(tmp_path, "c.json", "m3", windows=2)])  # window counts may differ by model
    assert fewer["protocol"] == {"chunk": 16, "windows": {"m1": 6, "m3": 2}}
    assert fewer["models"]["m3"]["protocol"]["windows"] == 2
    with pytest.raises(ValueError, match="protocol"):
        bench_ppl.merge([a, _result(tmp_path, "e.json", "m3", chunk=8)])
    with pytest.raises(ValueError, match="appears twice"):
        bench_ppl.merge([a, _result(tmp_path, "d.json", "m1")])


def test_readme_table_renders_one_table_per_model_and_the_skipped_peers(monkeypatch):
    import readme_tables

    row = {"tier": "KIVI-2", "family": "KIVI", "bits_end": 3.8125, "bits_worst": 4.1, "kl": 0.2, "ppl": 20.0,
           "delta_ppl": 1.0, "seconds": 3.0}
    result = {"date": "2026-12-01T00:00:00", "machine": {"load_avg_1_5_15m": [1.0]}, "versions": {"git_commit": "b" * 40},
              "models": {"m1": {"rows": [row], "skipped": []},
                         "m2": {"rows": [row], "skipped": [{"tier": "quanto int4", "reason": "ValueError: no"}]}}}
    monkeypatch.setattr(readme_tables, "load", lambda name: result)
    table = readme_tables.ppl_table()
    assert table.count("| KIVI-2 | KIVI | 3.81 | 4.10 | 2.00e-01 | 20.000 | +1.000 | 3.0 |") == 2
    assert "**m1**" in table and "**m2**" in table and "skipped on m2: quanto int4 (ValueError: no)" in table
    assert "commit bbbbbbb" in table
