"""Decode tok/s vs context from bench_e2e's JSON: raw / codec default (eager) / codec compiled / quanto int4.

    python benchmarks/plot_e2e.py      # results/e2e_cpu_eager.json + results/e2e_cpu_compiled.json -> results/e2e_cpu.png

One line per configuration that has rows (errors skipped), log-scaled context; the title carries the model, the
threads and the load averages the runs recorded. Needs matplotlib (the ``[bench]`` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import RESULTS_DIR

LABELS = {"eager_raw": "raw DynamicCache (eager)", "eager_codec": "codec default (eager, stored form)",
          "eager_quanto": "HF QuantizedCache quanto int4 (eager)", "raw": "raw StaticCache (compiled)",
          "codec_pass": "codec + pass (compiled)", "codec_materialized": "codec materialized (compiled)"}
STYLES = {"eager_raw": ("k", "-"), "eager_codec": ("tab:blue", "-"), "eager_quanto": ("tab:orange", "-"),
          "raw": ("k", "--"), "codec_pass": ("tab:blue", "--"), "codec_materialized": ("tab:green", "--")}


def series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """``{config: [(context, tok/s), ...]}`` sorted by context, rows with an error left out."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if "error" in row or "tok_per_s" not in row:
            continue
        out.setdefault(row["config"], []).append((row["context"], row["tok_per_s"]))
    return {config: sorted(points) for config, points in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="*", default=[str(RESULTS_DIR / "e2e_cpu_eager.json"),
                                                      str(RESULTS_DIR / "e2e_cpu_compiled.json")])
    parser.add_argument("--out", default=str(RESULTS_DIR / "e2e_cpu.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    notes = []
    for path in args.inputs:
        data = json.loads(Path(path).read_text())
        rows = data["rows"]
        for config, points in series(rows).items():
            color, style = STYLES.get(config, (None, ":"))
            ax.plot([c for c, _ in points], [t for _, t in points], style, color=color, marker="o",
                    label=LABELS.get(config, config))
        loads = [row["load_avg_after"][0] for row in rows if "load_avg_after" in row]
        threads = sorted({row["threads"] for row in rows if "threads" in row})
        models = sorted({row["model"] for row in rows})
        if loads:
            notes.append(f"{Path(path).stem}: {', '.join(models)}, threads {threads}, load {min(loads):.1f}-"
                         f"{max(loads):.1f}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens stored)")
    ax.set_ylabel("decode tok/s (median step)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("\n".join(notes), fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
