"""The main job's table-building code (demo/main.py) on a tiny random-init Llama: every tier runs end to end."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
DEMO = Path(__file__).resolve().parent.parent / "demo"
sys.path.insert(0, str(DEMO))
sys.path.insert(0, str(DEMO.parent / "benchmarks"))

from conftest import fresh_tiny_model, tiny_prompt  # noqa: E402
from kv_eval import (  # noqa: E402
    RAW,
    Tier,
    greedy,
    greedy_and_forced,
    main_tiers,
    make_cache,
    markdown_table,
    mean_kl,
    teacher_forced,
    token_match,
)

_spec = importlib.util.spec_from_file_location("flashcodec_demo_main", DEMO / "main.py")
demo_main = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo_main)
NEW_TOKENS = 24  # 20 prompt + 24 new tokens: several archived blocks of r = 8


@pytest.fixture(scope="module")
def table():
    model = fresh_tiny_model("llama")
    rows, generated = demo_main.build_table(model, tiny_prompt(1, 20), NEW_TOKENS, main_tiers())
    return {row["tier"]: row for row in rows}, generated


def test_every_tier_has_a_complete_row(table):
    rows, generated = table
    assert list(rows) == [t.name for t in main_tiers()]
    for name, row in rows.items():
        assert generated[name].shape == (1, NEW_TOKENS)
        assert len(row["tokens"]) == NEW_TOKENS
        assert row["kv_bytes"] > 0 and row["held_bytes"] >= row["kv_bytes"]
        assert math.isfinite(row["nll"]) and row["ppl"] == pytest.approx(math.exp(row["nll"]))
        assert 0.0 <= row["token_match"] <= 1.0 and 0 <= row["match_prefix"] <= NEW_TOKENS
        assert row["decode_tok_s"] > 0
    markdown = markdown_table(list(rows.values()), demo_main.COLUMNS)
    assert markdown.count("\n") == len(rows) + 1


def test_raw_row_is_the_reference(table):
    raw = table[0][RAW.name]
    assert raw["kv_ratio"] == 1.0 and raw["bits_per_value"] == 32.0
    assert raw["token_match"] == 1.0 and raw["match_prefix"] == NEW_TOKENS and raw["kl"] == 0.0


@pytest.mark.parametrize("name", ["png keep=1.0", "jpeg r=8 K=8"])
def test_lossless_tiers_reproduce_raw(table, name):
    rows, _ = table
    assert rows[name]["token_match"] == 1.0
    assert rows[name]["nll"] == pytest.approx(rows[RAW.name]["nll"], abs=1e-4)
    assert abs(rows[name]["kl"]) < 1e-5


def test_int8_tiers_store_fewer_bytes_in_truncation_order(table):
    rows, _ = table
    ratios = [rows[f"jpeg r=8 K={k} int8"]["kv_ratio"] for k in (8, 4, 2)]
    assert ratios[0] < 0.5 and ratios[0] > ratios[1] > ratios[2]


def test_materialization_free_reads_the_same_stored_data_without_a_view(table):
    rows, _ = table
    free, memo = rows["jpeg r=8 K=8 int8 mat-free"], rows["jpeg r=8 K=8 int8"]
    assert free["kv_bytes"] == memo["kv_bytes"] and free["held_bytes"] < memo["held_bytes"]
    assert free["nll"] == pytest.approx(memo["nll"], abs=1e-4)
    assert free["tokens"] == memo["tokens"]


def test_table_requires_the_raw_reference_first():
    model = fresh_tiny_model("llama")
    with pytest.raises(ValueError, match="raw DynamicCache"):
        demo_main.build_table(model, tiny_prompt(1, 8), 2, [Tier("png", {"mode": "png"})])


def test_metric_helpers():
    ref = torch.log_softmax(torch.randn(2, 3, 5), -1)
    assert mean_kl(ref, ref) == pytest.approx(0.0, abs=1e-7)
    assert mean_kl(ref, torch.log_softmax(torch.randn(2, 3, 5), -1)) > 0
    assert token_match(torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 2, 0, 4]])) == (0.75, 2)
    assert token_match(torch.tensor([[1, 2]]), torch.tensor([[1, 2]])) == (1.0, 2)


def test_teacher_forcing_matches_one_full_forward_on_the_raw_cache():
    from transformers import DynamicCache

    model = fresh_tiny_model("llama")
    ids = tiny_prompt(2, 14)
    forced = teacher_forced(model, ids[:, :6], ids[:, 6:], DynamicCache(config=model.config))
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids).logits[:, 5:-1].float(), -1)
    torch.testing.assert_close(forced, full, atol=1e-4, rtol=1e-4)


def test_single_pass_equals_separate_greedy_and_teacher_forcing_after_a_divergence():
    """png keep_ratio=0.25 (pruned deltas) is lossy enough to make the tiny model diverge from the raw tokens."""
    model = fresh_tiny_model("llama")
    ids, lossy = tiny_prompt(1, 20), Tier("png keep=0.25", {"mode": "png", "keep_ratio": 0.25})
    ref = greedy(model, ids, make_cache(model, RAW), NEW_TOKENS)
    alone = greedy(model, ids, make_cache(model, lossy), NEW_TOKENS)
    both = greedy_and_forced(model, ids, ref.tokens, make_cache(model, lossy))
    assert token_match(ref.tokens, alone.tokens)[1] < NEW_TOKENS - 1  # it does diverge, early enough to matter
    assert torch.equal(both.tokens, alone.tokens)
    torch.testing.assert_close(both.logprobs, teacher_forced(model, ids, ref.tokens, make_cache(model, lossy)))
    assert both.decode_steps == (NEW_TOKENS - 1) + (NEW_TOKENS - 1 - token_match(ref.tokens, alone.tokens)[1])


def test_main_writes_json(tmp_path, monkeypatch):
    """main() end to end with a tiny saved model: the JSON has metadata and one row per tier."""
    tok = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    model = fresh_tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    vocab = {chr(ord("a") + i): i + 3 for i in range(26)} | {"<pad>": 0, "<s>": 1, "<unk>": 2}
    backend = tok.Tokenizer(tok.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tok.pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>").save_pretrained(tmp_path / "model")
    out = tmp_path / "main_job.json"
    demo_main.main(["--model", str(tmp_path / "model"), "--prompt", "hello world", "--new-tokens", "10",
                    "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["benchmark"] == "main_job" and "versions" in result and "machine" in result
    assert [row["tier"] for row in result["rows"]] == [t.name for t in main_tiers()]


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"flashcodec_{name}", DEMO.parent / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_adaptive_allocation_is_the_exact_knapsack_optimum():
    import itertools

    adaptive = _bench("bench_adaptive")
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


def test_kivi_like_layer_quantizes_complete_groups_and_counts_the_format():
    ppl = _bench("bench_ppl")
    layer = ppl.KiviLikeLayer(bits=4)
    keys, values = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    out_k, _ = layer.update(keys, values)
    assert out_k is keys  # prefill attends on the exact states
    assert layer.quantized == 32 and torch.equal(layer.keys[:, :, 32:], keys[:, :, 32:])
    err = (layer.keys[:, :, :32] - keys[:, :, :32]).abs()
    span = keys[:, :, :32].amax(2, keepdim=True) - keys[:, :, :32].amin(2, keepdim=True)
    assert err.max() > 0 and bool((err <= span / 15 / 2 * 1.01 + 1e-3).all())  # half a step of the per-channel grid
    parts = layer.storage_bytes()
    assert parts["archive_used"] == 2 * 2 * 32 * 64 * 4 // 8 + 2 * 2 * 2 * 2 * 32 * 64 // 32
    assert parts["tail"] == 2 * 2 * 8 * 64 * 4
