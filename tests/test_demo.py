"""The main job's table-building code (demo/main.py) on a tiny random-init Llama: every tier runs end to end."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from conftest import fresh_tiny_model, tiny_prompt  # noqa: E402

from flashcodec_fx.evaluate import RAW, Tier, main_tiers, markdown_table  # noqa: E402

DEMO = Path(__file__).resolve().parent.parent / "demo"
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
