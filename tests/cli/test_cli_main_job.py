"""The main job's measurement (flashcodec_fx.cli.main_job) on a tiny random-init Llama: every tier end to end."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from conftest import fresh_tiny_model, tiny_prompt  # noqa: E402

from flashcodec_fx.cli import main_job  # noqa: E402
from flashcodec_fx.evaluate import RAW, Tier  # noqa: E402

NEW_TOKENS = 24  # 20 prompt + 24 new tokens: several archived blocks of r = 8
ALL = list(main_job.NAMED)
HARSH = Tier("png keep=0.1", {"mode": "png", "block_size": 8, "keep_ratio": 0.1})  # diverges after 1 token


class Bar:
    """A tqdm stand-in recording what the progress hook does."""

    def __init__(self, total):
        self.total, self.n, self.closed, self.refreshed = total, 0, False, 0

    def update(self, k):
        self.n += k

    def refresh(self):
        self.refreshed += 1

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def measured():
    bars = {}

    def progress(tier, total):
        bars[tier.name] = Bar(total)
        return bars[tier.name]

    model = fresh_tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # peaked next-token distributions: lossy tiers measurably diverge
    tiers = [*main_job.resolve_tiers(ALL), HARSH]
    rows = list(main_job.measure(model, tiny_prompt(1, 20), NEW_TOKENS, tiers, progress))
    assert not model._forward_hooks  # the progress hook is removed after each tier
    return {row["tier"]: row for row in rows}, bars


def test_every_tier_has_a_complete_row(measured):
    rows, bars = measured
    assert list(rows) == [*(main_job.NAMED[key] for key in ALL), HARSH.name]
    for name, row in rows.items():
        assert len(row["tokens"]) == NEW_TOKENS
        assert row["kv_bytes"] > 0 and row["held_bytes"] >= row["kv_bytes"]
        assert math.isfinite(row["nll"]) and row["ppl"] == pytest.approx(math.exp(row["nll"]))
        assert 0.0 <= row["token_match"] <= 1.0 and 0 <= row["match_prefix"] <= NEW_TOKENS
        assert row["decode_tok_s"] > 0 and row["seconds"] > 0  # the raw tier is timed too
        assert row["kl"] >= 0.0 and not row["kl_text"].startswith("-")
        assert bars[name].closed and bars[name].n == bars[name].total, name
    lines = main_job.markdown_rows(list(rows.values()), main_job.COLUMNS)
    assert len(lines) == len(rows) + 2 and lines[0].startswith("| tier |")


def test_progress_counts_every_forward_call(measured):
    """Teacher forcing makes NEW_TOKENS calls; a tier that diverges adds the greedy steps after the divergence."""
    rows, bars = measured
    for name, row in rows.items():
        extra = 0 if row["match_prefix"] == NEW_TOKENS else NEW_TOKENS - row["match_prefix"] - 1
        assert bars[name].total == NEW_TOKENS + extra, name
        assert bars[name].refreshed == (1 if extra else 0)
    assert any(row["match_prefix"] < NEW_TOKENS for row in rows.values())  # the growing total was exercised


def test_raw_row_is_the_reference(measured):
    raw = measured[0][RAW.name]
    assert raw["kv_ratio"] == 1.0 and raw["bits_per_value"] == 32.0 and raw["kl_noise_floor"] is None
    assert raw["token_match"] == 1.0 and raw["match_prefix"] == NEW_TOKENS and raw["kl"] == 0.0 and raw["kl_text"] == "0"


@pytest.mark.parametrize("name", ["png keep=1.0", "jpeg r=8 K=8"])
def test_lossless_tiers_reproduce_raw_within_the_kl_floor(measured, name):
    rows, _ = measured
    assert rows[name]["token_match"] == 1.0
    assert rows[name]["nll"] == pytest.approx(rows[RAW.name]["nll"], abs=1e-4)
    assert rows[name]["kl"] <= rows[name]["kl_noise_floor"] and rows[name]["kl_text"].startswith("< ")


def test_lossy_tiers_show_their_kl(measured):
    row = measured[0]["jpeg r=8 K=2 int8"]
    assert row["kl"] > row["kl_noise_floor"] and row["kl_text"] == f"{row['kl']:.2e}"


def test_int8_tiers_store_fewer_bytes_in_truncation_order(measured):
    rows, _ = measured
    ratios = [rows[f"jpeg r=8 K={k} int8"]["kv_ratio"] for k in (8, 4, 2)]
    assert ratios[0] < 0.5 and ratios[0] > ratios[1] > ratios[2]


def test_materialization_free_reads_the_same_stored_data_without_a_view(measured):
    rows, _ = measured
    free, memo = rows["jpeg r=8 K=8 int8"], rows["jpeg r=8 K=8 int8 view"]
    assert free["kv_bytes"] == memo["kv_bytes"] and free["held_bytes"] < memo["held_bytes"]
    assert free["nll"] == pytest.approx(memo["nll"], abs=1e-4)
    assert free["tokens"] == memo["tokens"]


def test_measure_requires_the_raw_reference_first():
    model = fresh_tiny_model("llama")
    with pytest.raises(ValueError, match="raw DynamicCache"):
        next(main_job.measure(model, tiny_prompt(1, 8), 2, [Tier("png", {"mode": "png"})], Bar))


def test_resolve_tiers_puts_raw_first_once_and_names_what_is_allowed():
    assert [t.name for t in main_job.resolve_tiers(["jpeg-int8", "png", "jpeg-int8"])] == [RAW.name, "jpeg r=8 K=8 int8",
                                                                                            "png keep=1.0"]
    assert [t.name for t in main_job.resolve_tiers(["png", "raw"])] == [RAW.name, "png keep=1.0"]
    with pytest.raises(ValueError, match=r"unknown tier\(s\) \['gif'\]; choose from \['raw', 'png'"):
        main_job.resolve_tiers(["gif"])


def test_default_tiers_are_raw_and_the_presets_else_png_and_int8(monkeypatch):
    import flashcodec_fx

    monkeypatch.setattr(flashcodec_fx, "PRESETS", {}, raising=False)
    assert main_job.default_tier_names() == ["raw", "png", "jpeg-int8"]
    presets = {"tiny": flashcodec_fx.cache_config(mode="jpeg", keep_freqs=4), "int8": flashcodec_fx.cache_config()}
    monkeypatch.setattr(flashcodec_fx, "PRESETS", presets, raising=False)
    assert main_job.default_tier_names() == ["raw", "tiny", "int8"]
    tier = main_job.resolve_tiers(["tiny"])[1]
    assert tier.name == "preset tiny" and tier.options == {"preset": "tiny"}
    monkeypatch.setattr(flashcodec_fx, "PRESETS", {"png": flashcodec_fx.cache_config(mode="png")}, raising=False)
    with pytest.raises(ValueError, match="clashes"):
        main_job.available_tiers()


def test_kl_noise_floor_bounds_the_rounding_of_identical_distributions():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 1000, generator=gen, dtype=torch.float64)
    exact = torch.log_softmax(logits, -1)
    a, b = torch.log_softmax(logits.float(), -1), torch.log_softmax(logits.float() * (1 + 1e-7), -1)
    floor = main_job.kl_noise_floor(a, b)
    measured = float((a.double().exp() * (a.double() - b.double())).sum(-1).mean())
    assert 0 < floor < 1e-4 and abs(measured) <= floor
    assert main_job.kl_noise_floor(exact.float(), exact.float()) > 0


@pytest.mark.parametrize(("kl", "floor", "text"), [(0.0, None, "0"), (-1.9e-8, 3e-7, "< 3e-07"), (2e-7, 3e-7, "< 3e-07"),
                                                   (7.4e-4, 3e-7, "7.40e-04")])
def test_kl_text_is_never_negative(kl, floor, text):
    assert main_job.kl_text(kl, floor) == text


def test_rows_record_their_threads(measured):
    assert {row["threads"] for row in measured[0].values()} == {torch.get_num_threads()}


class FakeExtension:
    """Stands in for ``ops.cpu.EXTENSION``: ``module()`` "builds" by creating the binary (or fails)."""

    def __init__(self, binary, fails=False):
        self.binary, self.fails, self.calls = binary, fails, 0
        self.error = "RuntimeError: no compiler" if fails else None

    def module(self):
        self.calls += 1
        if self.fails:
            return None
        self.binary.parent.mkdir(parents=True, exist_ok=True)
        self.binary.touch()
        return object()


@pytest.fixture
def fake_kernels(monkeypatch, tmp_path):
    from flashcodec_fx.ops import cpu
    from flashcodec_fx.ops.cpu import build

    binary = tmp_path / "flashcodec_cpu_x" / "flashcodec_cpu_x.so"
    monkeypatch.setattr(build, "binary_path", lambda: binary)
    monkeypatch.delenv(cpu.ENV, raising=False)

    def install(fails=False):
        fake = FakeExtension(binary, fails)
        monkeypatch.setattr(cpu, "EXTENSION", fake)
        return fake

    return install


def test_prepare_kernels_builds_before_timing_and_says_so(fake_kernels):
    fake = fake_kernels()
    line, seconds = main_job.prepare_kernels("cpu")
    assert fake.calls == 1 and seconds >= 0
    assert line.startswith("CPU kernels: fused C++, built in ") and "before the first tier (once per machine" in line
    line, _ = main_job.prepare_kernels("cpu")  # the binary exists now: loaded, not built
    assert line.startswith("CPU kernels: fused C++, loaded in ")


def test_prepare_kernels_says_when_the_reference_runs(fake_kernels):
    fake_kernels(fails=True)
    line, _ = main_job.prepare_kernels("cpu")
    assert line.startswith("CPU kernels: not built (RuntimeError: no compiler); the codec tiers run the reference ops")


def test_prepare_kernels_does_nothing_off_the_cpu_or_for_the_reference(fake_kernels, monkeypatch):
    fake = fake_kernels()
    assert main_job.prepare_kernels("cuda") is None
    monkeypatch.setenv("FLASHCODEC_KERNELS", "reference")
    assert main_job.prepare_kernels("cpu") is None
    assert fake.calls == 0
