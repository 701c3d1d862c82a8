"""flashcodec_fx.evaluate.plots: comparison charts, and frontier charts that read benchmark JSON defensively."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
from flashcodec_fx.evaluate import plots  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
ROWS = [
    {"tier": "raw DynamicCache", "kept": 4096, "held": 4096, "kv_ratio": 1.0, "bits_per_value": 32.0,
     "decode_tok_s": 10.0, "nll": 0.59, "kl": 0.0},
    {"tier": "jpeg r=8 K=8 int8", "kept": 1334, "held": 9000, "kv_ratio": 0.326, "bits_per_value": 10.42,
     "decode_tok_s": 5.0, "nll": 0.58, "kl": 7e-4},
    {"tier": "broken", "kept": 1, "held": 1, "kv_ratio": 0.1, "bits_per_value": float("nan"),
     "decode_tok_s": float("nan"), "nll": float("nan"), "kl": float("nan")},
]


def test_comparison_figures_draw_one_bar_per_row():
    figures = plots.comparison_figures(ROWS)
    assert set(figures) == {"storage", "speed", "quality"}
    for figure in figures.values():
        ax = figure.axes[0]
        top_down = sorted(zip(ax.get_yticks(), ax.get_yticklabels(), strict=True), key=lambda tick: -tick[0])
        assert [label.get_text().split("\n")[0] for _, label in top_down] == [row["tier"] for row in ROWS]
    assert len(figures["quality"].axes) == 2 and figures["quality"].axes[1].get_xscale() == "log"


def test_frontier_charts_of_the_committed_results_all_have_figures(tmp_path):
    charts = plots.frontier_charts(RESULTS)
    assert [c.key for c in charts] == ["kl", "speed", "memory"]
    for chart in charts:
        assert chart.figure is not None, chart.note
    kl = charts[0].figure.axes[0]
    assert kl.get_yscale() == "log"
    data = json.loads((RESULTS / "ppl.json").read_text())
    rows = next(iter(data["models"].values()))["rows"] if "models" in data else data["rows"]
    assert sum(len(c.get_offsets()) for c in kl.collections) >= len(rows)  # every tier and peer is a point
    written = plots.write_frontier_pngs(RESULTS, tmp_path)
    assert [p.name for p in written] == ["frontier_kl.png", "frontier_speed.png", "frontier_memory.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_missing_files_give_notes_not_exceptions(tmp_path):
    charts = plots.frontier_charts(tmp_path)
    assert all(c.figure is None for c in charts)
    assert "ppl.json not found" in charts[0].note and "e2e" in charts[1].note
    assert "footprint.json not found" in charts[2].note
    assert plots.write_frontier_pngs(tmp_path, tmp_path / "out") == []


@pytest.mark.parametrize("content, says", [
    ("{not json", "could not be read"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"results": [{"tier": "x"}]}), "no 'rows' list"),
    (json.dumps({"rows": [{"tier": "x", "bits": 4}]}), "no row has all of"),
    (json.dumps({"rows": [{"tier": "x", "bits_per_value": "four", "kl": None}]}), "lower-left"),
])
def test_older_or_broken_schemas_give_a_clear_note(tmp_path, content, says):
    (tmp_path / "ppl.json").write_text(content)
    (tmp_path / "e2e_old.json").write_text(json.dumps({"rows": [{"context": 1024}]}))
    (tmp_path / "footprint.json").write_text(json.dumps({"rows": [{"tier": "a", "seq_len": 8, "storage_bytes": 3,
                                                                    "raw_bytes": 1}]}))
    kl, speed, memory = plots.frontier_charts(tmp_path)
    assert says in kl.note
    assert speed.figure is None and "schema" in speed.note
    assert memory.figure is None and "expected shape" in memory.note


def test_points_at_one_place_share_a_label():
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 10)
    plots.label_points(ax, [(5, 5, "a"), (5, 5, "b"), (1, 9, "c")])
    assert sorted(t.get_text() for t in ax.texts) == ["a\nb", "c"]
