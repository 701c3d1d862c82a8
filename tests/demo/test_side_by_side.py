"""The demo's model side (demo/side_by_side.py) on a tiny random-init Llama: tiers, streamed turns, comparison."""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "demo"))

import side_by_side as sbs  # noqa: E402
from conftest import save_tiny_model  # noqa: E402

import flashcodec_fx  # noqa: E402
from flashcodec_fx.evaluate import RAW, greedy, main_tiers, make_cache  # noqa: E402

NEW = 20  # several archived blocks of r = 8 after the prompt


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from flashcodec_fx.pretrained import load_pretrained

    folder = tmp_path_factory.mktemp("tiny_model")
    save_tiny_model(folder)
    model, tokenizer = load_pretrained(folder)
    return sbs.Engine(model, tokenizer, "tiny llama")


@pytest.fixture(scope="module")
def ids(engine):
    return engine.encode([{"role": "user", "content": "the quick brown fox"}])


def _finish(turn):
    updates = list(turn)
    return updates, updates[-1]


def test_tiers_are_every_preset_then_every_main_tier_not_already_a_preset(monkeypatch):
    same_as_int8 = flashcodec_fx.cache_config(**next(t for t in main_tiers() if t.name == "jpeg r=8 K=8 int8").options)
    presets = {"k8-int8": same_as_int8, "lossless": flashcodec_fx.cache_config(mode="png")}
    monkeypatch.setattr(flashcodec_fx, "PRESETS", presets, raising=False)
    tiers = sbs.codec_tiers()
    assert [t.name for t in tiers] == ["k8-int8", "lossless", "png keep=1.0", "jpeg r=8 K=8", "jpeg r=8 K=4 int8",
                                       "jpeg r=8 K=2 int8"]
    assert tiers[0].options == {"preset": "k8-int8"} and "quant_bits=8" in tiers[0].note
    monkeypatch.setattr(flashcodec_fx, "PRESETS", None)  # a package without presets (a lazy name: delattr would not hide it)
    assert [t.name for t in sbs.codec_tiers()] == [t.name for t in main_tiers(view=False)[1:]]


def test_every_tier_the_package_offers_builds_a_cache(engine):
    """Real presets too, when the package has them: each must build a FlashCodecCache for the model."""
    for tier in sbs.codec_tiers():
        assert make_cache(engine.model, tier).codec_layers, tier.name


def test_turn_streams_the_native_greedy_decode_on_the_left_and_the_tier_on_the_right(engine, ids):
    updates, last = _finish(engine.turn(ids, ids, engine.tiers()["lossless"], NEW))
    reference = greedy(engine.model, ids, make_cache(engine.model, RAW), NEW).tokens[0].tolist()
    assert last.finished and last.status == "finished"
    assert len(updates) == 2 * NEW + 1  # one per forward call of each panel (prefill + NEW - 1 steps), then the end
    lengths = [len(u.right_text) for u in updates]
    assert lengths == sorted(lengths) and 0 < lengths[len(lengths) // 2] < lengths[-1]  # text appears while generating
    assert last.left["tokens"] == last.right["tokens"] == NEW
    assert last.left_text == engine.tokenizer.decode(reference, skip_special_tokens=True)
    assert last.right["match"] == 1.0 and last.right["match_prefix"] == NEW == last.right["match_over"]
    assert last.left["bits_per_value"] == 32.0 and last.left["view"] == 0
    for stats in (last.left, last.right):
        assert stats["ms_per_token"] > 0 and stats["prefill_s"] > 0 and stats["prompt_tokens"] == ids.shape[1]
        assert stats["peak_held"] >= stats["steady_held"] == stats["held"] >= stats["kept"] > 0


def test_int8_tier_keeps_fewer_bytes_and_materialization_free_keeps_no_view(engine, ids):
    tier = engine.tiers()["jpeg r=8 K=8 int8"]
    _, memo = _finish(engine.turn(ids, ids, tier, NEW))
    _, free = _finish(engine.turn(ids, ids, tier, NEW, materialization_free=True))
    assert memo.right["kept"] < memo.left["kept"] and memo.right["bits_per_value"] < 32
    assert memo.right["view"] > 0 and free.right["view"] == 0 and free.right["kept"] == memo.right["kept"]
    assert free.right["tier"].endswith("mat-free") and free.right_text == memo.right_text
    assert free.left_text == memo.left_text  # the codec attention leaves the native panel's layers alone


def test_compiled_turn_decodes_the_same_tokens_as_eager(engine, ids):
    tier = engine.tiers()["jpeg r=8 K=8 int8"]
    _, eager = _finish(engine.turn(ids, ids, tier, 10, materialization_free=True))
    _, compiled = _finish(engine.turn(ids, ids, tier, 10, compiled=True))
    assert compiled.left_text == eager.left_text and compiled.right_text == eager.right_text
    assert compiled.left["compiled"] and compiled.right["first_step_s"] > 0 and compiled.right["view"] == 0
    assert compiled.left["kept"] == eager.left["kept"] < compiled.left["held"]  # static: capacity held, tokens kept


def test_requests_outside_the_model_or_the_budget_are_refused(engine, ids):
    limit = engine.max_positions
    with pytest.raises(sbs.RequestError, match=f"{limit} positions"):
        next(engine.turn(ids, ids, engine.tiers()["lossless"], limit - ids.shape[1] + 1))
    with pytest.raises(sbs.RequestError, match="max new tokens"):
        next(engine.turn(ids, ids, engine.tiers()["lossless"], 0))
    with pytest.raises(sbs.RequestError, match="empty"):
        engine.check_request(ids[:, :0], 4)
    with pytest.raises(sbs.RequestError, match="at least 2"):
        next(engine.compare("hi", [], 1))
    assert not engine.lock.locked()


def test_a_second_session_waits_for_the_first_and_then_runs_alone(engine, ids):
    tier = engine.tiers()["jpeg r=8 K=4 int8"]
    first = engine.turn(ids, ids, tier, NEW)
    next(first)  # the first session holds the model
    second: dict = {}
    thread = threading.Thread(target=lambda: second.update(updates=list(engine.turn(ids, ids, tier, NEW))))
    thread.start()
    thread.join(timeout=0.5)
    assert thread.is_alive() and not second  # blocked on the lock, no step interleaved
    rest = list(first)
    thread.join(timeout=60)
    assert second["updates"][0].status.startswith("waited")
    assert second["updates"][-1].right_text == rest[-1].right_text


def test_comparison_has_the_native_row_then_one_row_per_tier(engine):
    tiers = list(engine.tiers().values())
    steps = list(engine.compare("the quick brown fox", tiers, 9))
    assert [done for done, _ in steps] == list(range(len(tiers) + 1))
    rows = steps[-1][1]
    assert [r["tier"] for r in rows] == [RAW.name, *(t.name for t in tiers)]
    native, by_name = rows[0], {r["tier"]: r for r in rows}
    assert native["kv_ratio"] == 1.0 and native["kl"] == 0.0 and native["match"] == 1.0 and native["bits_per_value"] == 32
    assert by_name["lossless"]["nll"] == pytest.approx(native["nll"], abs=1e-4)
    assert by_name["jpeg r=8 K=8 int8"]["kv_ratio"] < 1 and by_name["jpeg r=8 K=8 int8"]["bits_per_value"] < 32
    for row in rows:
        assert row["peak_held"] >= row["steady_held"] > 0 and row["decode_tok_s"] > 0 and math.isfinite(row["nll"])
    free = list(engine.compare("the quick brown fox", tiers[:1], 9, materialization_free=True))[-1][1]
    assert free[1]["tier"].endswith("mat-free") and free[1]["view"] == 0


def test_static_cache_footprint_counts_the_stored_tokens_not_the_capacity(engine, ids):
    from transformers import StaticCache

    cache = StaticCache(config=engine.model.config, max_cache_len=64)
    with torch.no_grad():
        engine.model(input_ids=ids[:, :16], use_cache=True, **{engine.cache_kwarg: cache})
    size, config = sbs.footprint(cache, engine.model.dtype), engine.model.config
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4  # K and V, fp32
    assert size["kept"] == 16 * per_token and size["held"] >= 64 * per_token
    assert size["bits_per_value"] == 32.0
