"""Matplotlib charts of KV-cache results: the demo's comparison charts and the frontier plots of the committed
benchmark JSON (benchmarks/results/*.json). Needs matplotlib (the ``[demo]`` extra), not Gradio, and is not imported
by ``flashcodec_fx.evaluate``; uses ``matplotlib.figure.Figure`` only (no pyplot state, safe in a server's worker
threads).

    python -m flashcodec_fx.evaluate.plots [--results benchmarks/results] [--out DIR]   # DIR/frontier_*.png

A benchmark that writes a result file can redraw the PNG files with ``write_frontier_pngs(results_dir)``.

Every frontier chart reads its JSON defensively: a missing file or a schema it does not know gives a chart with no
figure and a note saying what was looked for, never an exception.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

RESULTS_DIR = Path("benchmarks") / "results"  # relative to the checkout's root (where the commands run)
NATIVE, CODEC, PEER, VIEW = "#6b7280", "#2563eb", "#ea580c", "#93c5fd"
KL_FLOOR = 1e-7  # KL at or below this (lossless tiers, rounding noise) is drawn on the floor of the log axis
MIB = 2**20
E2E_CONFIGS = {"raw": "raw static cache", "codec_materialized": "codec, materialized view",
               "codec_pass": "codec + SDPA-over-cache pass"}


@dataclass
class Chart:
    """A titled figure, or ``figure=None`` and a ``note`` saying why not; ``source``: the JSON files it draws."""

    key: str
    title: str
    figure: Figure | None
    note: str = ""
    source: str = ""


def _figure(width: float = 7.0, height: float = 4.0, columns: int = 1) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    axes = [fig.add_subplot(1, columns, i + 1) for i in range(columns)]
    for ax in axes:
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(True, color="#e5e7eb", linewidth=0.8)
        ax.set_axisbelow(True)
    return fig, axes


def _is_native(name: str) -> bool:
    return name.lower().startswith(("raw", "native", "staticcache", "dynamiccache"))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bars(ax: Any, names: list[str], values: list[float], colors: list[str], fmt: str) -> None:
    """Horizontal bars, first name on top, each labelled with its value (``-`` when not finite)."""
    y = list(range(len(names)))[::-1]
    ax.barh(y, [v if _finite(v) else 0 for v in values], color=colors, height=0.65)
    ax.set_yticks(y, names, fontsize=8)
    for yi, value in zip(y, values, strict=True):
        ax.annotate("-" if not _finite(value) else format(value, fmt), (value if _finite(value) else 0, yi),
                    xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
    ax.grid(True, axis="x", color="#e5e7eb")
    ax.grid(False, axis="y")


def label_points(ax: Any, points: list[tuple[float, float, str]], fontsize: float = 7) -> None:
    """Label scatter points without overlaps: points closer than a few pixels share one label (names stacked),
    and each label takes the first offset around its point whose box overlaps no label placed before it."""
    if not points:
        return
    pixels = ax.transData.transform([(x, y) for x, y, _ in points])
    clusters: list[tuple[list[float], list[str]]] = []
    for (px, py), (x, y, name) in zip(pixels, points, strict=True):
        near = next((c for c in clusters if abs(c[0][0] - px) < 8 and abs(c[0][1] - py) < 8), None)
        if near is None:
            clusters.append(([px, py, x, y], [name]))
        elif name not in near[1]:
            near[1].append(name)
    scale = ax.figure.dpi / 72
    line_h, char_w = 1.25 * fontsize * scale, 0.56 * fontsize * scale
    offsets = [(6, 2), (6, -2), (-6, 2), (-6, -2), (6, 12), (6, -12), (-6, 12), (-6, -12), (6, 24), (6, -24)]
    placed: list[tuple[float, float, float, float]] = []
    for (px, py, x, y), names in sorted(clusters, key=lambda c: -c[0][1]):
        text = "\n".join(names)
        width = char_w * max(map(len, names))
        height = line_h * len(names)
        for dx, dy in offsets:
            left = px + dx * scale - (width if dx < 0 else 0)
            bottom = py + dy * scale - (height if dy < 0 else 0)  # va="top" below the point, "bottom" above
            box = (left, bottom, left + width, bottom + height)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                break
        placed.append(box)
        ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                    ha="right" if dx < 0 else "left", va="top" if dy < 0 else "bottom", color="#1f2937")


def comparison_figures(rows: list[dict[str, Any]]) -> dict[str, Figure]:
    """``{"storage", "speed", "quality"}`` charts of the demo's comparison rows (first row: the native cache).
    Row keys used: tier, kv_ratio, held, kept, bits_per_value, decode_tok_s, nll, kl."""
    names = [row["tier"] for row in rows]
    colors = [NATIVE if _is_native(n) else CODEC for n in names]
    raw_kept = rows[0]["kept"] if rows and rows[0].get("kept") else math.nan

    storage, (ax,) = _figure(7.0, 0.45 * len(rows) + 1.4)
    held = [row.get("held", math.nan) / raw_kept for row in rows]
    y = list(range(len(names)))[::-1]
    ax.barh(y, held, color=VIEW, height=0.65, label="held (kept + view + capacity)")
    with_bits = [f"{name}\n{row['bits_per_value']:.2f} bits/value" if _finite(row.get("bits_per_value")) else name
                 for name, row in zip(names, rows, strict=True)]
    _bars(ax, with_bits, [row["kv_ratio"] for row in rows], colors, ".3f")
    ax.axvline(1.0, color=NATIVE, linestyle="--", linewidth=1)
    ax.set_xlabel("KV bytes vs the native cache (bar: kept; light bar: everything held)")
    ax.set_title("Storage", loc="left", fontsize=10)

    speed, (ax,) = _figure(7.0, 0.45 * len(rows) + 1.2)
    _bars(ax, names, [row.get("decode_tok_s", math.nan) for row in rows], colors, ".1f")
    ax.set_xlabel("decode tokens / s (this machine, this run)")
    ax.set_title("Speed", loc="left", fontsize=10)

    quality, (ax_nll, ax_kl) = _figure(9.0, 0.45 * len(rows) + 1.4, columns=2)
    _bars(ax_nll, names, [row.get("nll", math.nan) for row in rows], colors, ".3f")
    if rows and _finite(rows[0].get("nll")):
        ax_nll.axvline(rows[0]["nll"], color=NATIVE, linestyle="--", linewidth=1)
    ax_nll.set_xlabel("teacher-forced NLL of the native continuation (nats/token)")
    ax_nll.set_title("Quality", loc="left", fontsize=10)
    kls = [max(row.get("kl", math.nan), KL_FLOOR) if _finite(row.get("kl")) else math.nan for row in rows]
    ax_kl.barh(y, kls, color=colors, height=0.65)
    ax_kl.set_xscale("log")
    ax_kl.set_xlim(KL_FLOOR, max([k for k in kls if _finite(k)] + [10 * KL_FLOOR]) * 3)
    ax_kl.set_yticks(y, [""] * len(names))
    for yi, row in zip(y, rows, strict=True):
        kl = row.get("kl")
        label = "-" if not _finite(kl) else "≈0" if kl <= KL_FLOOR else f"{kl:.1e}"
        ax_kl.annotate(label, (max(kl, KL_FLOOR) if _finite(kl) else KL_FLOOR, yi), xytext=(3, 0),
                       textcoords="offset points", va="center", fontsize=7)
    ax_kl.set_xlabel(f"mean KL vs native, log scale (floor {KL_FLOOR:g})")
    return {"storage": storage, "speed": speed, "quality": quality}


def read_json(path: Path) -> tuple[dict[str, Any] | None, str]:
    """``(data, "")``, or ``(None, why)`` for a missing, unreadable or non-object JSON file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None, f"{Path(path).name} not found in {Path(path).parent} (run its benchmark to create it)"
    except (OSError, ValueError) as err:
        return None, f"{Path(path).name} could not be read: {err}"
    if not isinstance(data, dict):
        return None, f"{Path(path).name}: expected a JSON object, got {type(data).__name__}"
    return data, ""


def _rows(data: dict[str, Any], name: str, needs: Iterable[str]) -> tuple[list[dict[str, Any]], str]:
    """The rows of a result file holding every key in ``needs``, or ``([], why)``."""
    needs = tuple(needs)
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        return [], f"{name} has no 'rows' list (an older or different schema): nothing to draw"
    good = [row for row in rows if isinstance(row, dict) and all(key in row for key in needs)]
    if not good:
        return [], f"{name}: no row has all of {list(needs)} (an older or different schema): nothing to draw"
    return good, ""


def _machine(data: dict[str, Any]) -> str:
    machine = data.get("machine") if isinstance(data.get("machine"), dict) else {}
    where = machine.get("cuda_device") or f"CPU x{machine.get('cpu_count', '?')}"
    return f"{where}, {str(data.get('date', 'undated'))[:10]}"


def _guarded(key: str, title: str, draw: Callable[[], Chart]) -> Chart:
    try:
        return draw()
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        return Chart(key, title, None, f"the JSON did not have the expected shape ({type(err).__name__}: {err})")


def _first_model(data: dict[str, Any]) -> dict[str, Any]:
    """bench_ppl's streaming schema (``models``: name -> rows, bits as stored at the end) as the flat one the chart
    reads (``rows`` with ``bits_per_value``): its first model; any other schema unchanged."""
    models = data.get("models")
    if not isinstance(models, dict) or not models:
        return data
    model, entry = next(iter(models.items()))
    protocol = entry.get("protocol") or data.get("protocol", {})
    rows = [dict(row, bits_per_value=row.get("bits_end")) for row in entry.get("rows", [])]
    return {**data, "model": model, "rows": rows, "windows": protocol.get("windows"),
            "target_tokens": protocol.get("scored_tokens_per_window")}


def frontier_kl(results: Path = RESULTS_DIR) -> Chart:
    """Bits per stored value vs KL (log scale) for every tier and peer of ppl.json."""
    title = "Quality vs size: bits per stored value vs KL to the uncompressed model"

    def draw() -> Chart:
        data, why = read_json(results / "ppl.json")
        if data is None:
            return Chart("kl", title, None, why, "ppl.json")
        data = _first_model(data)
        rows, why = _rows(data, "ppl.json", ("tier", "bits_per_value", "kl"))
        if not rows:
            return Chart("kl", title, None, why, "ppl.json")
        fig, (ax,) = _figure(8.0, 5.0)
        labels = []
        for row in rows:
            name, bits, kl = str(row["tier"]), row["bits_per_value"], row["kl"]
            if not (_finite(bits) and _finite(kl)):
                continue
            peer = row.get("options") is None and not _is_native(name)
            color = NATIVE if _is_native(name) else PEER if peer else CODEC
            lossless = kl <= KL_FLOOR
            ax.scatter([bits], [max(kl, KL_FLOOR)], s=46, color=color, facecolors="white" if lossless else color,
                       linewidths=1.5, zorder=3, marker="s" if peer else "o")
            labels.append((bits, max(kl, KL_FLOOR), name.split(" (")[0]))
        ax.set_yscale("log")
        ax.set_ylim(KL_FLOOR / 3, max(y for _, y, _ in labels) * 4 if labels else None)
        ax.set_xlim(0, max(x for x, _, _ in labels) * 1.25 if labels else None)
        label_points(ax, labels)
        ax.set_xlabel("bits per stored value (as stored: scales, indices, raw tail included)")
        ax.set_ylabel("mean KL vs uncompressed (nats), log")
        ax.scatter([], [], color=CODEC, label="flashcodec tiers")
        ax.scatter([], [], color=PEER, marker="s", label="peers (quanto, KIVI-like)")
        ax.scatter([], [], color="white", edgecolors=NATIVE, label=f"KL ≤ {KL_FLOOR:g} (drawn on the floor)")
        ax.legend(fontsize=7, loc="upper right")
        ax.set_title(f"{data.get('model', 'model?')}, {data.get('windows', '?')} windows x "
                     f"{data.get('target_tokens', '?')} scored tokens ({_machine(data)})", fontsize=8, loc="left")
        return Chart("kl", title, fig, "lower-left is better", "ppl.json")

    return _guarded("kl", title, draw)


def _e2e_files(results: Path) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(results.glob("e2e*.json")):
        data, _ = read_json(path)
        if data is not None:
            out.append((path.stem, data))
    return out


def _e2e_series(files: list[tuple[str, dict[str, Any]]], value: Callable[[dict[str, Any]], float],
                by_file: bool = True) -> dict[str, list[tuple[int, float]]]:
    """``{label: [(context, value), ...]}`` over the e2e result files. ``by_file``: a file's stem joins the label
    when two files hold the same model and configuration; else the first file's points of each context win."""
    series: dict[tuple[str, str, str], dict[int, float]] = {}
    for stem, data in files:
        rows, _ = _rows(data, stem, ("model", "config", "context"))
        for row in rows:
            y = value(row)
            if _finite(y) and _finite(row["context"]):
                key = (str(row["model"]), str(row["config"]), stem if by_file else "")
                series.setdefault(key, {}).setdefault(int(row["context"]), y)
    counts: dict[tuple[str, str], int] = {}
    for model, config, _ in series:
        counts[model, config] = counts.get((model, config), 0) + 1
    labelled = {}
    for (model, config, stem), points in series.items():
        label = f"{model}: {E2E_CONFIGS.get(config, config)}"
        labelled[label + (f" [{stem}]" if counts[model, config] > 1 else "")] = sorted(points.items())
    return labelled


def _line_style(label: str, seen: set[str]) -> dict[str, Any]:
    """Colour by configuration, marker by model; a later file's series of the same model and config is hollow."""
    color = NATIVE if "raw" in label else CODEC if "pass" in label else VIEW
    model = label.split(":")[0]
    marker = "o" if model == "llama-rand" else "D"
    base = label.split(" [")[0]
    hollow = base in seen
    seen.add(base)
    return {"color": color, "marker": marker, "markerfacecolor": "white" if hollow else color,
            "linestyle": "-" if model == "llama-rand" else "--"}


def frontier_speed(results: Path = RESULTS_DIR) -> Chart:
    """Compiled decode tok/s vs context length from the e2e*.json files."""
    title = "Decode speed vs context (compiled decode, bench_e2e)"

    def draw() -> Chart:
        files = _e2e_files(results)
        if not files:
            return Chart("speed", title, None, f"no e2e*.json in {results} (run benchmarks/bench_e2e.py)", "e2e*.json")
        series = _e2e_series(files, lambda row: row.get("tok_per_s", math.nan))
        if not series:
            return Chart("speed", title, None, "the e2e*.json files have no rows with model, config, context and "
                         "tok_per_s (an older or different schema)", "e2e*.json")
        fig, (ax,) = _figure(8.0, 4.6)
        seen: set[str] = set()
        for label, points in series.items():
            ax.plot(*zip(*points, strict=True), label=label, **_line_style(label, seen))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens, log2)")
        ax.set_ylabel("decode tokens / s (log)")
        ax.legend(fontsize=7)
        ax.set_title(", ".join(sorted({_machine(d) for _, d in files})), fontsize=8, loc="left")
        return Chart("speed", title, fig, "higher is better", ", ".join(stem + ".json" for stem, _ in files))

    return _guarded("speed", title, draw)


def frontier_memory(results: Path = RESULTS_DIR) -> Chart:
    """KV memory vs context: one layer's stored bytes per tier (footprint.json) and the whole model's KV held plus
    the view a materialized step builds (e2e*.json)."""
    title = "KV memory vs context"

    def draw() -> Chart:
        notes = []
        fig, (ax_layer, ax_model) = _figure(11.0, 4.6, columns=2)
        data, why = read_json(results / "footprint.json")
        rows, why = _rows(data, "footprint.json", ("tier", "seq_len", "storage_bytes", "raw_bytes")) if data else ([], why)
        if rows:
            tiers: dict[str, list[tuple[int, float]]] = {}
            raw: dict[int, float] = {}
            for row in rows:
                stored = row["storage_bytes"].get("total_without_memo", row["storage_bytes"].get("total"))
                tiers.setdefault(str(row["tier"]), []).append((int(row["seq_len"]), stored / MIB))
                raw[int(row["seq_len"])] = row["raw_bytes"] / MIB
            for name, points in tiers.items():
                ax_layer.plot(*zip(*sorted(points), strict=True), marker=".", label=name)
            ax_layer.plot(*zip(*sorted(raw.items()), strict=True), color=NATIVE, linestyle="--", linewidth=2,
                          label="raw cache", zorder=3)
            ax_layer.set_xscale("log", base=2)
            ax_layer.set_yscale("log")
            ax_layer.set_xlabel("context length (tokens, log2)")
            ax_layer.set_ylabel("MiB stored, one layer (no memo view)")
            ax_layer.legend(fontsize=6, ncols=2)
            ax_layer.set_title(f"one layer (footprint.json, {_machine(data)})", fontsize=8, loc="left")
        else:
            notes.append(why)
            ax_layer.set_axis_off()
        files = _e2e_files(results)
        held = _e2e_series(files, lambda row: row["kv_bytes"]["total"] / MIB if isinstance(row.get("kv_bytes"), dict)
                           and _finite(row["kv_bytes"].get("total")) else math.nan, by_file=False)
        views = _e2e_series(files, lambda row: row.get("view_bytes_per_step", 0) / MIB or math.nan, by_file=False)
        if held:
            seen: set[str] = set()
            for label, points in held.items():
                ax_model.plot(*zip(*points, strict=True), label=f"{label} (KV held)", **_line_style(label, seen))
            for label, points in views.items():
                ax_model.plot(*zip(*points, strict=True), label=f"{label} (view built per step)", color=PEER,
                              marker="x", linestyle=":")
            ax_model.set_xscale("log", base=2)
            ax_model.set_yscale("log")
            ax_model.set_xlabel("context length (tokens, log2)")
            ax_model.set_ylabel("MiB, whole model")
            ax_model.legend(fontsize=6)
            ax_model.set_title("compiled decode (e2e*.json)", fontsize=8, loc="left")
        else:
            notes.append("no e2e*.json with kv_bytes.total per row: the whole-model panel is empty")
            ax_model.set_axis_off()
        if not rows and not held:
            return Chart("memory", title, None, "; ".join(notes), "footprint.json, e2e*.json")
        return Chart("memory", title, fig, "; ".join(notes) or "lower is better", "footprint.json, e2e*.json")

    return _guarded("memory", title, draw)


def frontier_charts(results: Path = RESULTS_DIR) -> list[Chart]:
    """Every frontier chart of the result files in ``results`` (kl, speed, memory)."""
    results = Path(results)
    return [frontier_kl(results), frontier_speed(results), frontier_memory(results)]


def write_frontier_pngs(results: Path = RESULTS_DIR, out: Path | None = None) -> list[Path]:
    """Write ``frontier_<key>.png`` for every chart that has a figure into ``out`` (default: ``results``)."""
    out = Path(out if out is not None else results)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for chart in frontier_charts(results):
        if chart.figure is not None:
            path = out / f"frontier_{chart.key}.png"
            chart.figure.savefig(path)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="folder of the benchmark JSON files")
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNG files (default: --results)")
    args = parser.parse_args(argv)
    for chart in frontier_charts(args.results):
        if chart.figure is None:
            print(f"{chart.key}: not drawn: {chart.note}")
    for path in write_frontier_pngs(args.results, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
