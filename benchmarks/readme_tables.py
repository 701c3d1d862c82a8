"""The measured tables of README.md, docs/results.md, docs/architectures.md and docs/quantization.md, regenerated from
the committed results (benchmarks/results/*.json).

    python benchmarks/readme_tables.py            # rewrite every table of the documents from the JSON
    python benchmarks/readme_tables.py --check    # exit 1 (and show what differs) when a document and the JSON disagree

Each table sits in one of :data:`DOCUMENTS` between ``<!-- table: NAME -->`` and ``<!-- /table -->`` (every name of
``TABLES`` exactly once over both); ``TABLES`` says which JSON makes it and how. Links are written relative to the
document's folder. Under each table one line names the JSON, the commit it was measured at, its date and the load
average, all read from the JSON. KL cells never show rounding noise as a number: negative values are clamped to 0,
and a value within its recorded fp32 noise floor prints as ``< floor``. tests/benchmarks/test_readme_tables.py fails
when the README and the JSON disagree.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE.parent / "README.md"
DOCUMENTS = (README, HERE.parent / "docs" / "results.md", HERE.parent / "docs" / "architectures.md",
             HERE.parent / "docs" / "quantization.md")
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)
MIB = 1 << 20


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def provenance(*names: str) -> str:
    """One line per table: which JSON, measured at which commit, when, under which load."""
    parts = []
    for name in names:
        result = load(name)
        commit = (result["versions"].get("git_commit") or "unknown")[:7]
        dirty = " (uncommitted changes)" if result["versions"].get("git_dirty") else ""
        load_avg = result["machine"].get("load_avg_1_5_15m") or [float("nan")]
        parts.append(f"[{name}.json](benchmarks/results/{name}.json): commit {commit}{dirty}, {result['date'][:10]}, "
                     f"load {load_avg[0]:.1f}")
    return "<sub>" + "; ".join(parts) + "</sub>"


def kl_cell(row: dict[str, Any]) -> str:
    """KL vs raw: the reference prints 0; rounding noise is never a number (clamped at 0, or ``< floor``)."""
    from flashcodec_fx.cli.main_job import kl_text

    kl, floor = max(float(row["kl"]), 0.0), row.get("kl_noise_floor")
    if floor is None:
        return "0" if kl == 0.0 else f"{kl:.2e}"
    return kl_text(kl, floor)


def markdown(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """``evaluate.markdown_table`` of ``rows`` with the KL rule applied, keeping the columns some row has."""
    from flashcodec_fx.evaluate import markdown_table

    columns = [c for c in columns if any(c[1] in row for row in rows) or c[1] == "kl"]
    shown = [dict(row, kl=kl_cell(row)) if "kl" in row else row for row in rows]
    columns = [(head, key, "s" if key == "kl" else spec) for head, key, spec in columns]
    return markdown_table(shown, columns)


def main_job_table() -> str:
    from flashcodec_fx.cli.main_job import COLUMNS

    result = load("main_job")
    columns = [(head, "kl" if key == "kl_text" else key, spec) for head, key, spec in COLUMNS]
    return markdown(result["rows"], columns) + "\n\n" + provenance("main_job")


def ppl_table() -> str:
    """One table per model of ppl.json (bench_ppl's streaming protocol: ``models``), then the skipped tiers and
    their reason; a ppl.json of the earlier teacher-forced protocol (top-level ``rows``) renders as it did."""
    import bench_ppl

    result = load("ppl")
    if "models" not in result:
        legacy = [("bytes vs raw", "kv_ratio", ".3f"), ("bits/value", "bits_per_value", ".2f"),
                  ("KL vs raw", "kl", ".2e"), ("ppl", "ppl", ".3f"), ("Δppl", "delta_ppl", "+.3f"),
                  ("seconds", "seconds", ".1f")]
        return markdown(result["rows"], [bench_ppl.COLUMNS[0], *legacy]) + "\n\n" + provenance("ppl")
    parts = []
    for model, data in result["models"].items():
        parts.append(f"**{model}**\n\n" + markdown(data["rows"], bench_ppl.COLUMNS))
        parts += [f"skipped on {model}: {s['tier']} ({s['reason']})" for s in data.get("skipped", [])]
    return "\n\n".join(parts) + "\n\n" + provenance("ppl")


def presets_table() -> str:
    """The presets of ppl.json side by side on every model: bits as stored at the measured length (and the worst
    case over the last 128 lengths), KL vs raw."""
    import bench_ppl

    models = load("ppl")["models"]
    prefix = f"{bench_ppl.FLASHCODEC} "
    names = [r["tier"] for r in next(iter(models.values()))["rows"] if r["tier"].startswith(prefix)]
    head = "| preset | " + " | ".join(f"{m}: bits (worst) | {m}: KL vs raw" for m in models) + " |"
    lines = [head, "|---|" + "---|---|" * len(models)]
    for name in names:
        cells = []
        for data in models.values():
            row = next(r for r in data["rows"] if r["tier"] == name)
            cells += [f"{row['bits_end']:.2f} ({row['bits_worst']:.2f})", kl_cell(row)]
        lines.append(f"| `{name[len(prefix):]}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + provenance("ppl")


def bits_table() -> str:
    """bits.json: bits as stored at each measured length (and the worst case over its last 128 lengths), every
    preset and peer, one column per model and length."""
    result = load("bits")
    models, lengths = result["models"], result["lengths"]
    heads = [f"{_short(m)}: {n // 1024}k" if n % 1024 == 0 else f"{_short(m)}: {n}" for m in models for n in lengths]
    lines = ["| tier | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    names = list(dict.fromkeys(r["tier"] for data in models.values() for r in data["rows"]))
    for name in names:
        cells = []
        for data in models.values():
            row = next((r for r in data["rows"] if r["tier"] == name), {})
            by_length = {p["length"]: p for p in row.get("by_length", [])}
            cells += [f"{by_length[n]['bits']:.2f} ({by_length[n]['bits_worst']:.2f})" if n in by_length else "-"
                      for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + provenance("bits")


# Issue 20's targets (SmolLM2-135M, bench_ppl's streaming protocol, 6 x 1024 tokens): bits as stored, worst case
# over the last 128 lengths, and KL vs raw, at most.
TARGETS = {"4bit": (4.25, 0.004), "3bit": (3.00, 0.035), "2.5bit": (2.50, 0.10), "2bit": (2.00, 0.25)}


def _verdict(value: float, target: float) -> str:
    return "met" if value <= target else f"**{value / target:.1f}x over**"


def targets_table() -> str:
    """ppl.json's SmolLM2 presets against issue 20's targets (``TARGETS``)."""
    import bench_ppl

    rows = load("ppl")["models"]["SmolLM2-135M-Instruct"]["rows"]
    lines = ["| preset | bits target | bits (worst) | bits | KL target | KL | KL |", "|---|---|---|---|---|---|---|"]
    for name, (bits, kl) in TARGETS.items():
        row = next(r for r in rows if r["tier"] == f"{bench_ppl.FLASHCODEC} {name}")
        lines.append(f"| `{name}` | <= {bits:.2f} | {row['bits_end']:.2f} ({row['bits_worst']:.2f}) | "
                     f"{_verdict(row['bits_worst'], bits)} | <= {kl:g} | {kl_cell(row)} | {_verdict(row['kl'], kl)} |")
    return "\n".join(lines) + "\n\n" + provenance("ppl")


# Quality beyond one number (issue 20): each column one bench_ppl run on SmolLM2 (JSON, how its KL is read, heading).
BEYOND = (("ppl", None, "prose 6 x 1k"), ("ppl_texts", "pride", "dialogue"), ("ppl_texts", "difflib", "source code"),
          ("ppl_4k", None, "prose 2 x 4k"), ("ppl_decode", None, "token by token"),
          ("ppl_outliers", None, "x16 outlier channels"))


def beyond_table() -> str:
    """KL vs raw of the presets and peers on SmolLM2 in every run of ``BEYOND`` (a tier a run left out: ``-``); the
    outlier run's cells also give the ratio to the same tier's KL on the same windows without outliers (ppl.json's
    first windows: both runs cut the windows alike)."""
    model = "SmolLM2-135M-Instruct"
    results = {name: load(name) for name in dict.fromkeys(b[0] for b in BEYOND)}
    runs = {name: result["models"][model]["rows"] for name, result in results.items()}
    tiers = [r["tier"] for r in runs["ppl"] if r["family"] != "raw" and r["tier"] != "flashcodec lossless"]
    lines = ["| tier | " + " | ".join(head for _, _, head in BEYOND) + " |", "|---|" + "---|" * len(BEYOND)]
    for tier in tiers:
        cells = []
        for name, text, _ in BEYOND:
            row = next((r for r in runs[name] if r["tier"] == tier), None)
            kl = None if row is None else row["kl"] if text is None else row.get("kl_per_text", {}).get(text)
            cell = "-" if kl is None else kl_cell({"kl": kl})
            if kl is not None and results[name]["protocol"].get("outliers"):
                plain = next(r for r in runs["ppl"] if r["tier"] == tier)["kl_per_window"]
                windows = results[name]["protocol"]["windows"]
                cell += f" ({kl / (sum(plain[:windows]) / windows):.1f}x)"
            cells.append(cell)
        lines.append(f"| {tier} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + provenance(*runs)


def _signed(n: int) -> str:
    return f"{n:+d}" if n else "0"


def passkey_table(name: str = "passkey") -> str:
    """passkey.json (or ``name``.json): keys retrieved per tier and haystack length, and whether the tier retrieves
    what raw does; a trellis twin (``NAME-tcq``) run beside its scalar preset also gets its keys retrieved minus the
    scalar preset's, per length."""
    summary = load(name)["summary"]
    lengths = sorted({s["length"] for s in summary})
    tiers = list(dict.fromkeys(s["tier"] for s in summary))
    got = {(s["tier"], s["length"]): s for s in summary}
    twins = any(t.endswith("-tcq") and (t[:-len("-tcq")], lengths[0]) in got for t in tiers)
    lines = ["| tier | " + " | ".join(f"{n // 1024}k" for n in lengths) + " | retrieves what raw retrieves |"
             + (" twin minus scalar preset |" if twins else ""), "|---|" + "---|" * (len(lengths) + 1 + twins)]
    def place(tier: str) -> int:  # a twin right after its scalar preset (where the run has it)
        scalar = tier.removesuffix("-tcq")
        return tiers.index(scalar if twins and scalar in tiers else tier)

    for tier in sorted(tiers, key=place):
        cells = [f"{got[tier, n]['retrieved']} / {got[tier, n]['trials']}" for n in lengths]
        same = "-" if tier.startswith("raw") else "yes" if all(got[tier, n]["matches_raw"] for n in lengths) else "no"
        if twins:
            scalar = tier.removesuffix("-tcq")
            diff = (" / ".join(_signed(got[tier, n]["retrieved"] - got[scalar, n]["retrieved"]) for n in lengths)
                    if tier != scalar and (scalar, lengths[0]) in got else "-")
            same += f" | {diff}"
        lines.append(f"| {tier} | " + " | ".join(cells) + f" | {same} |")
    return "\n".join(lines) + "\n\n" + provenance(name)


def _as_run(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with a preset tier's name followed by the recipe it ran with (``recipe``: presets change)."""
    recipe = row.get("recipe")
    if not recipe or "key_options" not in recipe:
        return row
    k, v = recipe["key_options"], recipe["value_options"]
    return dict(row, tier=f"{row['tier']} (as run: K{k['quant_bits']} W{k.get('window', 0)} + V{v['quant_bits']} "
                          f"W{v.get('window', 0)})")


BUDGET_RUNS = {"budget_search_a": "streaming, 2 x 1k", "budget_search_b": "streaming, 2 x 1k",
               "budget_search_decode": "token by token: prefill 896, then 128 tokens one at a time, 6 windows"}


def budget_table() -> str:
    """The in-budget recipe search (bench_ppl on SmolLM2): the presets' earlier recipes and the candidates within
    their names' bits, on the streaming protocol (budget_search_a / _b.json) and token by token
    (budget_search_decode.json); bits as stored and KL."""
    import bench_ppl

    columns = [c for c in bench_ppl.COLUMNS if c[1] in ("tier", "family", "bits_end", "bits_worst", "kl", "ppl")]
    parts = [f"*{name}.json: {how}*\n\n" + markdown([_as_run(r) for r in next(iter(load(name)["models"].values()))["rows"]],
                                                    columns) for name, how in BUDGET_RUNS.items()]
    return "\n\n".join(parts) + "\n\n" + provenance(*BUDGET_RUNS)


TRELLIS_RUNS = ("ppl_trellis_presets", "ppl_trellis_search_2")  # issue 42: the twins, then the 3.0-bit search


def trellis_table() -> str:
    """Each scalar preset beside its trellis twin (``NAME-tcq``) on bench_ppl's streaming protocol (SmolLM2): bits as
    stored (equal), KL of each and their ratio; then the trellis recipes searched within 3.0 bits."""
    import bench_ppl

    prefix = f"{bench_ppl.FLASHCODEC} "
    rows = [r for name in TRELLIS_RUNS for r in load(name)["models"]["SmolLM2-135M-Instruct"]["rows"]]
    by_tier = {r["tier"]: r for r in rows}
    lines = ["| preset | bits (worst) | KL vs raw, scalar codes | KL vs raw, `-tcq` twin | ratio |",
             "|---|---:|---:|---:|---:|"]
    for name in (r["tier"][len(prefix):] for r in rows if r["tier"].startswith(prefix) and "-tcq" not in r["tier"]):
        scalar, twin = by_tier[prefix + name], by_tier[f"{prefix}{name}-tcq"]
        assert (scalar["bits_end"], scalar["bits_worst"]) == (twin["bits_end"], twin["bits_worst"]), name
        lines.append(f"| `{name}` / `{name}-tcq` | {scalar['bits_end']:.2f} ({scalar['bits_worst']:.2f}) | "
                     f"{kl_cell(scalar)} | {kl_cell(twin)} | {twin['kl'] / scalar['kl']:.2f} |")
    search = [by_tier[f"{prefix}3bit"], by_tier[f"{prefix}3bit-tcq"]] + [r for r in rows if "search" in r["family"]]
    lines += ["", "| recipe (3-bit budget) | bits (worst) | KL vs raw | ppl |", "|---|---:|---:|---:|"]
    lines += [f"| {_as_run(r)['tier']} | {r['bits_end']:.3f} ({r['bits_worst']:.3f}) | {kl_cell(r)} | {r['ppl']:.3f} |"
              for r in search]
    return "\n".join(lines) + "\n\n" + provenance(*TRELLIS_RUNS)


# Issue 42's other protocols: (JSON, model) of bench_ppl runs with every scalar preset beside its trellis twin.
TRELLIS_CHECKS = (("ppl_trellis_presets", "SmolLM2-135M-Instruct"), ("ppl_trellis_gemma3", "gemma-3-270m"),
                  ("ppl_trellis_decode", "SmolLM2-135M-Instruct"), ("ppl_trellis_texts", "SmolLM2-135M-Instruct"),
                  ("ppl_trellis_4k", "SmolLM2-135M-Instruct"), ("ppl_trellis_outliers", "SmolLM2-135M-Instruct"),
                  ("ppl_trellis_outliers_6w", "SmolLM2-135M-Instruct"))


def _protocol(result: dict[str, Any]) -> str:
    p = result["protocol"]
    if p["chunk"] == 1:
        text = f"token by token, {p['windows']} x ({p['prefill']} + {p['scored_tokens_per_window']})"
    else:
        text = f"streaming, {p['windows']} x {p['window_tokens']}"
    if p.get("outliers"):
        text += f", x{p['outliers']:g} outlier channels"
    return text


def _kl_parts(result: dict[str, Any], model: str, row: dict[str, Any]) -> list[tuple[str, float, list[float]]]:
    """``(label, KL, KL per window)`` of a bench_ppl row: per text where the run's texts are not the default prose
    (each text's kind: dialogue, code; the windows of that text), else its mean and every window."""
    texts = result["protocol"].get("texts", ["prose"])
    if texts == ["prose"]:
        return [("", row["kl"], row["kl_per_window"])]
    info = result["models"][model]
    kinds = info["text_kinds"]
    return [(f", {kinds[name]}", kl, [w for w, t in zip(row["kl_per_window"], info["window_texts"], strict=True)
                                      if t == name])
            for name, kl in row["kl_per_text"].items()]


def trellis_checks_table() -> str:
    """Each scalar preset beside its trellis twin in every run of ``TRELLIS_CHECKS`` whose JSON is committed: model
    and protocol, bits as stored (equal), KL of each, the twin's over the scalar preset's, and the least and most of
    that ratio window by window (the same windows: how far one window's ratio strays from the mean's)."""
    import bench_ppl

    prefix = f"{bench_ppl.FLASHCODEC} "
    runs = [(name, model) for name, model in TRELLIS_CHECKS if (RESULTS / f"{name}.json").exists()]
    lines = ["| model, protocol | preset | bits (worst) | KL vs raw, scalar codes | KL vs raw, `-tcq` twin | ratio | "
             "ratio per window (least-most) |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, model in runs:
        result = load(name)
        by_tier = {r["tier"]: r for r in result["models"][model]["rows"]}
        for tier, scalar in by_tier.items():
            twin = by_tier.get(f"{tier}-tcq")
            if not tier.startswith(prefix) or twin is None:
                continue
            assert (scalar["bits_end"], scalar["bits_worst"]) == (twin["bits_end"], twin["bits_worst"]), tier
            preset = tier[len(prefix):]
            for (label, kl_scalar, scalar_windows), (_, kl_twin, twin_windows) in zip(
                    _kl_parts(result, model, scalar), _kl_parts(result, model, twin), strict=True):
                ratios = [t / s for s, t in zip(scalar_windows, twin_windows, strict=True)]
                lines.append(f"| {_short(model)}, {_protocol(result)}{label} | `{preset}` / `{preset}-tcq` | "
                             f"{scalar['bits_end']:.2f} ({scalar['bits_worst']:.2f}) | "
                             f"{kl_cell({**scalar, 'kl': kl_scalar})} | {kl_cell({**twin, 'kl': kl_twin})} | "
                             f"{kl_twin / kl_scalar:.2f} | {min(ratios):.2f}-{max(ratios):.2f} |")
    return "\n".join(lines) + "\n\n" + provenance(*(name for name, _ in runs))


TRELLIS_PASSKEY = ("passkey_trellis", "passkey_trellis_3keys", "passkey_trellis_9keys")  # issue 42: 1, 3, 9 keys per depth


def trellis_passkey_table() -> str:
    """The passkey runs of ``TRELLIS_PASSKEY`` whose JSON is committed, each as :func:`passkey_table`."""
    runs = [name for name in TRELLIS_PASSKEY if (RESULTS / f"{name}.json").exists()]
    return "\n\n".join(f"*{name}.json: {len(load(name)['keys'])} key(s) per depth*\n\n" + passkey_table(name)
                       for name in runs)


def reconstruct_table() -> str:
    import bench_reconstruct

    text = bench_reconstruct.markdown(load("reconstruct"))
    real = text.rsplit("\n\n", 1)[-1]  # the last table: real K/V of the model
    return real + "\n\n" + provenance("reconstruct")


ATTENTION_RESULTS = ("attention_cpu_1thread", "attention_cpu")  # 1 thread (the targets'), 2 threads


def _attention_cells(at: dict, path: str, tier: str, seqs: list[int], ratio: bool) -> str:
    """A path's ms per S (and its ratio to SDPA), then at the last S its bytes read and GB/s (and that over the copy
    path's GB/s on the same working set)."""
    times = [at[(path, tier, s)]["time_us"] / 1000 for s in seqs]
    sdpa = [at[("sdpa_gqa", "raw", s)]["time_us"] / 1000 for s in seqs]
    shown = [f"{t:.2f} ({t / b:.2f}x)" if ratio else f"{t:.2f}" for t, b in zip(times, sdpa, strict=True)]
    row, copy = at[(path, tier, seqs[-1])], at.get(("copy", "raw", seqs[-1]))
    of_copy = f" ({row['gbps'] / copy['gbps']:.2f}x)" if copy else ""
    return " | ".join(shown) + f" | {row['bytes'] / 1e6:.2f} | {row['gbps']:.1f}{of_copy}"


def attention_table() -> str:
    """Per-layer decode attention (one layer, hot in the caches) at 1 and 2 threads, per layer shape: SDPA over raw
    fp32 K/V, then the fused CPU kernel per preset, each time with its ratio to SDPA; at the longest S also the bytes
    a call reads and its GB/s, next to the machine's copy bandwidth on the same working set."""
    first = load(ATTENTION_RESULTS[0])["config"]["seqs"]
    last = first[-1]
    lines = ["| shape | threads | path | tier | " + " | ".join(f"S={s // 1024}k ms (vs SDPA)" for s in first)
             + f" | MB read, S={last // 1024}k | GB/s (of copy), S={last // 1024}k |",
             "|---|---|---|---|" + "---|" * len(first) + "---|---|"]
    for name in ATTENTION_RESULTS:
        result = load(name)
        threads = result["config"]["threads"]
        rows = [r for r in result["rows"] if r["layers"] == 1]
        for shape in dict.fromkeys(r.get("shape", "smollm2") for r in rows):
            at = {(r["path"], r["tier"], r["S"]): r for r in rows if r.get("shape", "smollm2") == shape}
            lines.append(f"| {shape} | {threads} | SDPA, raw fp32 K/V | - | "
                         f"{_attention_cells(at, 'sdpa_gqa', 'raw', first, ratio=False)} |")
            for tier in dict.fromkeys(r["tier"] for r in rows if r["path"] == "kernel"):
                lines.append(f"| {shape} | {threads} | fused CPU kernel on the stored form | {tier} | "
                             f"{_attention_cells(at, 'kernel', tier, first, ratio=True)} |")
    return "\n".join(lines) + "\n\n" + provenance(*ATTENTION_RESULTS)


E2E_CONFIGS = {"eager_raw": "eager, raw DynamicCache", "eager_codec": "eager, default FlashCodecCache",
               "eager_quanto": "eager, quanto int4 QuantizedCache", "raw": "compiled, raw StaticCache",
               "codec_pass": "compiled, codec static cache + the pass"}


def e2e_config(config: str) -> str:
    """A configuration's label: the named ones, or ``eager, FlashCodecCache `<preset>``` for ``eager_<preset>``."""
    if config in E2E_CONFIGS:
        return E2E_CONFIGS[config]
    return f"eager, FlashCodecCache `{config.removeprefix('eager_')}`"


def _context(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 else str(tokens)


def e2e_table() -> str:
    """Decode speed (one thread) and KV held per model, eager and compiled, each config vs its raw twin of the run."""
    names = ("e2e_cpu_eager_1thread", "e2e_cpu_compiled_1thread")
    lines = ["| model | context | config | tok/s | vs raw | KV held vs raw |", "|---|---|---|---|---|---|"]
    for name in names:
        rows = [r for r in load(name)["rows"] if "error" not in r]
        for row in rows:
            raw = next(r for r in rows if r["model"] == row["model"] and r["context"] == row["context"]
                       and r["config"] in ("eager_raw", "raw")
                       and r["config"].startswith("eager") == row["config"].startswith("eager"))
            held = row["kv_bytes"]["total"] / raw["kv_bytes"]["total"]
            lines.append(f"| {row['model']} | {_context(row['context'])} | {e2e_config(row['config'])} | "
                         f"{row['tok_per_s']:.2f} | {row['tok_per_s'] / raw['tok_per_s']:.2f}x | {held:.3f} |")
    return "\n".join(lines) + "\n\n" + provenance(*names)


STEP_RESULTS = ("e2e_cpu_issue41_1thread", "e2e_cpu_issue41_2thread")  # bench_e2e: eager and compiled interleaved
STEP_CONFIGS = ("eager_raw", "eager_int8", "eager_4bit", "eager_3bit", "eager_2.5bit", "eager_2bit")


def e2e_step_table() -> str:
    """Per thread count, context and preset: the eager decode step (ms, median) and its time over the raw
    DynamicCache's, the compiled step and its time over the raw StaticCache's and over its own eager step, all of one
    interleaved run (below 1.00x: faster); the raw caches' own rows first."""
    lines = ["| threads | context | cache | eager ms | eager / raw eager | compiled ms | compiled / raw compiled | "
             "compiled / eager |", "|---|---|---|---|---|---|---|---|"]
    for name in STEP_RESULTS:
        rows = {(r["context"], r["config"]): r for r in load(name)["rows"] if "error" not in r}
        for context in sorted({c for c, _ in rows}):
            raw, raw_compiled = rows[(context, "eager_raw")], rows.get((context, "compiled_raw"))
            for config in [c for c in STEP_CONFIGS if (context, c) in rows]:
                eager, compiled = rows[(context, config)], rows.get((context, config.replace("eager_", "compiled_")))
                cells = ["-", "-", "-"] if compiled is None else [
                    f"{compiled['step_ms_median']:.1f}",
                    f"{compiled['step_ms_median'] / raw_compiled['step_ms_median']:.2f}x" if raw_compiled else "-",
                    f"{compiled['step_ms_median'] / eager['step_ms_median']:.2f}x"]
                lines.append(f"| {eager['threads']} | {context:,} | `{config.removeprefix('eager_')}` | "
                             f"{eager['step_ms_median']:.1f} | {eager['step_ms_median'] / raw['step_ms_median']:.2f}x | "
                             + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + provenance(*STEP_RESULTS)


BUSY_RESULTS = ("e2e_cpu_busy_1thread", "e2e_cpu_busy")  # the same decode beside CPU-burning neighbours


def e2e_busy_table() -> str:
    """Eager decode beside CPU-burning neighbours (and without), 1 and 2 threads: each config's tok/s, its ratio to
    the raw cache of the same run, and how much of the quiet run's ratio it keeps."""
    lines = ["| threads | context | neighbour | config | tok/s | vs raw | ratio kept vs no neighbour |",
             "|---|---|---|---|---|---|---|"]
    for name in BUSY_RESULTS:
        rows = [r for r in load(name)["rows"] if "error" not in r]
        quiet = {(r["context"], r["config"]): r["tok_per_s_vs_raw"] for r in rows if r["neighbour"] == "none"}
        for row in rows:
            kept = row["tok_per_s_vs_raw"] / quiet[(row["context"], row["config"])]
            lines.append(f"| {row['threads']} | {_context(row['context'])} | {row['neighbour']} | "
                         f"{e2e_config(row['config'])} | {row['tok_per_s']:.2f} | {row['tok_per_s_vs_raw']:.2f}x | "
                         f"{kept:.2f} |")
    return "\n".join(lines) + "\n\n" + provenance(*BUSY_RESULTS)


def llamacpp_table() -> str:
    """llama.cpp next to the project on SmolLM2-135M (bench_llamacpp.py): per KV configuration its bits as stored, its
    KL against its engine's reference, and ms per decode step (vs the project's raw cache in the same rounds) per
    thread count and context."""
    import bench_llamacpp

    return bench_llamacpp.markdown(load("llamacpp")) + "\n\n" + provenance("llamacpp")


LOSSLESS_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _short(model: str) -> str:
    return model.split("-Instruct")[0]


def lossless_table() -> str:
    """Exact coding of real K/V (bench_lossless.py): bits per value and encode / decode MB/s (CPU time) per named
    method and dtype on every model; then, bf16, every transform x coder of the exponent plane."""
    result = load("lossless")
    models = result["models"]
    head = "| K/V | method | " + " | ".join(f"{_short(m['model'])}: bits/value (vs raw) | encode / decode MB/s"
                                          for m in models) + " |"
    lines = [head, "|---|---|" + "---|---|" * len(models)]
    for dtype, short in LOSSLESS_DTYPES.items():
        for method in ("zstd", "ppmd"):
            cells = []
            for m in models:
                row = next(r for r in m["kv"][dtype]["methods"] if r["method"] == method)
                cells += [f"{row['bits_per_value']:.2f} ({row['fraction_of_raw']:.3f})",
                          f"{1000 * row['encode_GBps']['cpu']:.0f} / {1000 * row['decode_GBps']['cpu']:.0f}"]
            lines.append(f"| {short} | `{method}` | " + " | ".join(cells) + " |")
    combos = ["| bf16 planes | exponent plane coder | " + " | ".join(f"{_short(m['model'])}: bits/value"
                                                                   for m in models) + " |",
              "|---|---|" + "---|" * len(models)]
    for i, row in enumerate(models[0]["kv"]["bfloat16"]["combos"]):
        if "bits_per_value" not in row:
            continue
        cells = [f"{m['kv']['bfloat16']['combos'][i]['bits_per_value']:.2f}" for m in models]
        combos.append(f"| `{row['transform']}` | {row['exponent_coder']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(combos) + "\n\n" + provenance("lossless")


def disk_table() -> str:
    """Bytes per token on disk (bench_lossless.py's ``disk``): every preset saved with each compression, next to a
    bf16 DynamicCache's bytes and the lossless form of its K/V."""
    models = load("lossless")["models"]
    head = "| cache | " + " | ".join(f"{_short(m['model'])}: raw / zstd / ppmd file | ppmd vs DynamicCache"
                                    for m in models) + " |"
    lines = [head, "|---|" + "---|---|" * len(models)]
    dynamic = []
    for m in models:
        d = m["disk"]["dynamic_cache"]
        dynamic += [f"{d['bytes_per_token']:.0f} (in memory); lossless form {d['lossless_ppmd_bytes_per_token']:.0f}",
                    f"1 ; {d['lossless_vs_dynamic_cache']:.3f}"]
    lines.append("| DynamicCache (bf16) | " + " | ".join(dynamic) + " |")
    for preset in sorted({r["preset"] for r in models[0]["disk"]["presets"]}):
        cells = []
        for m in models:
            rows = {r["compression"]: r for r in m["disk"]["presets"] if r["preset"] == preset}
            cells += [" / ".join(f"{rows[c]['bytes_per_token']:.0f}" for c in ("raw", "zstd", "ppmd")),
                      f"{rows['ppmd']['vs_dynamic_cache']:.3f}"]
        lines.append(f"| `{preset}` | " + " | ".join(cells) + " |")
    tokens = {m["disk"]["tokens"] for m in models}
    return "\n".join(lines) + f"\n\n<sub>bytes per token of a {'/'.join(map(str, sorted(tokens)))}-token prompt; " \
        + provenance("lossless").removeprefix("<sub>")


def vllm_table() -> str:
    """The vLLM plugin vs stock vLLM (bench_vllm.py): capacity, bits, concurrency, throughput, greedy tokens."""
    import bench_vllm

    result = load("vllm")
    if not result.get("serving"):
        return "Not measured in this vllm.json (its serving part did not finish).\n\n" + provenance("vllm")
    return bench_vllm.serving_markdown(result, markdown) + "\n\n" + provenance("vllm")


def vllm_quality_table() -> str:
    """Perplexity through vLLM (chunks of 16) per configuration, then the FlashCodecCache twins (same protocol)."""
    import bench_vllm

    result = load("vllm")
    if "quality" not in result:
        return "Not measured in this vllm.json (its quality part did not run).\n\n" + provenance("vllm")
    return bench_vllm.quality_markdown(result, markdown) + "\n\n" + provenance("vllm")


def vllm_memory_table() -> str:
    """Memory-bound serving (bench_vllm.py's memory_bound parts): many decode-heavy requests in a KV space that binds."""
    import bench_vllm

    result = load("vllm")
    if not any(part in result for part in bench_vllm.LOAD_PARTS):
        return "Not measured in this vllm.json (its memory-bound parts did not run).\n\n" + provenance("vllm")
    return bench_vllm.memory_markdown(result, markdown) + "\n\n" + provenance("vllm")


def architectures_table() -> str:
    """bench_architectures.py: every CausalLM architecture x conformance check (pass / FAIL: reason / skip: reason),
    the failures grouped by cause, the architectures not run and why."""
    import bench_architectures

    return bench_architectures.markdown(load("architectures")) + "\n\n" + provenance("architectures")


TABLES: dict[str, Callable[[], str]] = {
    "main_job": main_job_table, "presets": presets_table, "ppl": ppl_table, "bits": bits_table,
    "targets": targets_table, "beyond": beyond_table, "passkey": passkey_table,
    "budget": budget_table, "trellis": trellis_table, "trellis-checks": trellis_checks_table,
    "trellis-passkey": trellis_passkey_table, "reconstruct": reconstruct_table,
    "attention": attention_table,
    "e2e": e2e_table, "e2e_step": e2e_step_table, "e2e_busy": e2e_busy_table, "llamacpp": llamacpp_table,
    "lossless": lossless_table,
    "disk": disk_table,
    "vllm": vllm_table, "vllm-quality": vllm_quality_table, "vllm-memory": vllm_memory_table,
    "architectures": architectures_table,
}


def regenerate(text: str, document: Path = README) -> str:
    """``text`` (the contents of ``document``) with every table block rendered anew, its links relative to the
    document's folder; ValueError for an unknown or repeated table."""
    found = [m.group("name") for m in BLOCK.finditer(text)]
    unknown = sorted(set(found) - set(TABLES))
    if unknown or len(found) != len(set(found)):
        raise ValueError(f"{document.name} table blocks: unknown {unknown}, found {found}")
    up = Path(os.path.relpath(HERE.parent, document.parent)).as_posix()
    relative = (lambda table: table) if up == "." else (lambda table: table.replace("](benchmarks/", f"]({up}/benchmarks/"))
    return BLOCK.sub(lambda m: m.group(1) + relative(TABLES[m.group("name")]()) + "\n" + m.group(4), text)


def check_complete(texts: dict[Path, str]) -> None:
    """ValueError unless every table of ``TABLES`` sits in exactly one of the documents ``texts``."""
    found = [m.group("name") for text in texts.values() for m in BLOCK.finditer(text)]
    missing, repeated = sorted(set(TABLES) - set(found)), sorted({n for n in found if found.count(n) > 1})
    if missing or repeated:
        raise ValueError(f"table blocks: missing {missing}, in more than one place {repeated}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when a document is out of date")
    parser.add_argument("--document", type=Path, action="append",
                        help="a document to update or check (repeatable; default: README.md, docs/results.md, "
                             "docs/architectures.md and docs/quantization.md, which must hold every table between "
                             "them)")
    args = parser.parse_args(argv)
    documents = args.document or list(DOCUMENTS)
    texts = {path: path.read_text() for path in documents}
    if args.document is None:
        check_complete(texts)
    stale = 0
    for path, text in texts.items():
        fresh = regenerate(text, path)
        if not args.check:
            path.write_text(fresh)
        elif fresh != text:
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), fresh.splitlines(True), path.name,
                                                       f"{path.name} from benchmarks/results"))
            stale = 1
    return stale


if __name__ == "__main__":
    sys.exit(main())
