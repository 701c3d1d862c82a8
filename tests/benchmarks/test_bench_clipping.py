"""bench_clipping.py measures what it claims: its tiers are the lossy presets with only the scale search (and the
rotation) changed, the paired KL summary and its verdict come out of the per-window figures, an append case encodes
the same tokens at the same length every call, the codecs it times differ from the presets' in the search only."""

from __future__ import annotations

import bench_clipping
import pytest
import torch

from flashcodec_fx.presets import preset_codecs, preset_options


def test_tiers_change_the_search_and_the_rotation_only():
    tiers = bench_clipping.tiers()
    assert len(tiers) == 4 * len(bench_clipping.LOSSY)
    for tier in tiers:
        preset, mode = tier["name"].split()[:2]
        want = preset_options(preset)
        for stream in ("key_options", "value_options"):
            got = dict(tier["options"][stream])
            assert got.pop("scale_search") == mode
            if "seed" in tier["name"]:
                assert got.pop("rotate") == bench_clipping.OTHER_SEED
                want[stream].pop("rotate")
            want[stream].pop("scale_search")
            assert got == want[stream]


def _ppl(kl: dict[str, list[float]]) -> dict:
    rows = [{"tier": name, "kl": sum(w) / len(w), "kl_per_window": w, "bits_end": 4.0, "bits_worst": 4.2}
            for name, w in kl.items()]
    return {"models": {"tiny": {"rows": rows}}}


@pytest.mark.parametrize(("fit_scale", "verdict"), [(0.5, "better"), (1.0, "within noise"), (2.0, "worse")])
def test_kl_summary_pairs_windows_and_judges_against_the_rotation_noise(fit_scale, verdict):
    trials, other = [1.0, 2.0, 1.0, 2.0], [1.1, 1.9, 0.9, 2.1]  # the rotation moves a window by 5-10%
    kl = {}
    for preset in bench_clipping.LOSSY:
        seed = f" seed {bench_clipping.OTHER_SEED}"
        kl |= {f"{preset} trials": trials, f"{preset} trials{seed}": other,
               f"{preset} fit": [fit_scale * x for x in trials], f"{preset} fit{seed}": [fit_scale * x for x in other]}
    rows = bench_clipping.kl_summary(_ppl(kl))
    assert [r["preset"] for r in rows] == list(bench_clipping.LOSSY)
    row = rows[0]
    assert row["paired_change"] == pytest.approx([fit_scale - 1] * 8)
    assert row["windows_fit_lower"] == (8 if fit_scale < 1 else 0)
    assert row["rotation_noise"] == pytest.approx([0.1, -0.05, -0.1, 0.05])
    assert row["fit"] == verdict


def test_kl_summary_skips_a_preset_without_all_four_runs():
    assert bench_clipping.kl_summary(_ppl({"4bit trials": [1.0, 1.0], "4bit fit": [1.0, 1.0]})) == []


def test_with_search_changes_only_the_search():
    for codec in preset_codecs("3bit", 2):
        for mode in bench_clipping.MODES:
            other = bench_clipping.with_search(codec, mode)
            assert other.quantizer.search == mode
            assert other.spec.replace("search=0", "").replace("search=1", "").replace("search=2", "") == \
                codec.spec.replace("search=2", "")


def test_append_case_encodes_the_same_tokens_at_the_same_length(cpu_kernels):
    k, v = preset_codecs("4bit", 1)
    case = bench_clipping.AppendCase(k, v, 40, 1)
    case()
    first = [t.clone() for state in case.states for t in state]
    case()
    assert all(torch.equal(a, b) for a, b in zip(first, [t for state in case.states for t in state], strict=True))
    assert int(case.states[0][bench_clipping.LENGTH]) == 41
