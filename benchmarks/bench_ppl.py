"""Streaming perplexity and KL per KV tier vs the raw cache, with the peers, on real text; the bits/KL frontier.

    python benchmarks/bench_ppl.py                       # both models, 6 windows x 1024 tokens, every tier and peer
    python benchmarks/bench_ppl.py --quick               # SmolLM2, 2 windows x 256 tokens: smoke run, about a minute
    python benchmarks/bench_ppl.py --model smollm2 --tiers KIVI-2 --tier-json '{"name": "try", "options": {...}}'
    python benchmarks/bench_ppl.py --model smollm2 --windows 4 --texts dialogue code --out PATH  # other kinds of text
    python benchmarks/bench_ppl.py --plot-only           # redraw results/frontier.png from results/ppl.json
    python benchmarks/bench_ppl.py --merge A.json B.json # one ppl.json from single-model runs (e.g. run in parallel)
    python benchmarks/bench_ppl.py --model smollm2 --windows 2 --tiers --tier-file benchmarks/data/preset_search.json \
        --out benchmarks/results/preset_search.json      # the ablations that chose the presets

Protocol (issue 9): non-overlapping windows of real text (``corpus.py``: Alice in Wonderland and the Library of
Congress' Workshop on Electronic Texts, alternately; ``--texts dialogue code``: Pride and Prejudice's conversation
chapters and CPython's difflib.py source, other kinds of text in the same run), all windows of a model in one
batch. Per window the first ``--prefill`` (128) tokens go through prefill (exact), then the rest is fed in chunks
of ``--chunk`` (16) tokens through the cache: a chunk's queries read the history through the cache, and every token
after the prefill is scored (``flashcodec_fx.evaluate.streaming``); the KL is also kept per text and per bin of
64 positions (``kl_per_position``: how the error grows with the length read). Every tier runs in lockstep with
the raw ``DynamicCache`` on the same calls, so KL(raw || tier) is taken per scored token and averaged over all of
them; perplexity over the same tokens.

The model runs in fp32 (``--dtype``): in bf16 any change of the K/V states, even the lossless jpeg K=8 round trip,
moves SmolLM2's next-token distributions about as much as the 8-bit tier (bf16 rounding through 30 layers).
Bits per cached value are counted as a bf16 cache keeps them (a raw cache is 16 bits/value): every byte the cache
keeps (codes, scales, raw tokens) over the values the raw cache keeps (a sliding layer's window only), measured on a
bf16 replica of each cache fed random states by the same updates (the bytes of every method here depend only on
the lengths): ``bits_end`` after the protocol's own updates, and ``bits_worst``, the most over every length from
``L - 127`` to ``L`` when one prefill of ``L - 128`` tokens is followed by single tokens, which is where groups
waiting for completion and raw windows cost most. ``run_bits_end``: the run's own caches, in the run dtype.

Tiers: every ``flashcodec_fx.PRESETS`` entry when the package has presets, else the existing tiers (png keep=1,
jpeg r=8 K=8 / 4 / 2 int8), plus ``--tier-json`` ones; peers (``benchmarks/peers``): KIVI-2/4, TurboQuant-style
K4V4 / K3V3 / K3V2, quanto int4 (transformers' QuantizedCache; skipped with the reason where it cannot run).
Output: ``results/ppl.json`` (default run; any narrower run writes ``results/ppl_experiment.json`` unless ``--out``)
and ``results/frontier.png`` (bits/value vs KL, one curve per method family, one panel per model).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import RESULTS_DIR, write_result
from corpus import KINDS, TEXTS, kind_texts, leading_tokens, load_tokens, windows
from peers import peer_tiers

import flashcodec_fx
from flashcodec_fx.evaluate import (
    RAW,
    Tier,
    bits_per_value,
    cache_bytes,
    cached_values,
    make_cache,
    markdown_table,
    prepared,
    stream_steps,
    streaming,
    token_kl,
    token_nll,
)
from flashcodec_fx.evaluate.outliers import add_outlier_channels
from flashcodec_fx.presets import preset_options

FLASHCODEC = "flashcodec"
CUSTOM = "flashcodec (--tier-json)"
MODELS = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "gemma-3-270m"}
STORED_DTYPE = torch.bfloat16  # bits are counted as a bf16 cache keeps them (raw = 16 bits/value)
WORST_SPAN = 128  # lengths L-127..L: one period of the longest grouping in use (128-token groups / raw windows)
POSITION_BIN = 64  # kl_per_position: mean KL over bins of this many scored positions
FULL = {"windows": 6, "window_tokens": 1024}
QUICK = {"windows": 2, "window_tokens": 256}
COLUMNS = [("tier", "tier", "s"), ("family", "family", "s"), ("bits end", "bits_end", ".2f"),
           ("bits worst", "bits_worst", ".2f"), ("KL vs raw", "kl", ".2e"), ("ppl", "ppl", ".3f"),
           ("Δppl", "delta_ppl", "+.3f"), ("seconds", "seconds", ".1f")]


@dataclass(frozen=True)
class Candidate:
    family: str
    tier: Tier


def flashcodec_tiers() -> list[Candidate]:
    """Every ``flashcodec_fx.PRESETS`` entry (``preset=NAME``) when the package has presets; else today's tiers."""
    presets = getattr(flashcodec_fx, "PRESETS", None)
    if presets:
        return [Candidate(FLASHCODEC, Tier(f"flashcodec {name}", {"preset": name})) for name in presets]
    jpeg = {"mode": "jpeg", "block_size": 8, "quant_bits": 8}
    return [Candidate(FLASHCODEC, Tier("png keep=1.0", {"mode": "png", "block_size": 8, "keep_ratio": 1.0})),
            *(Candidate(FLASHCODEC, Tier(f"jpeg r=8 K={k} int8", {**jpeg, "keep_freqs": k})) for k in (8, 4, 2))]


def json_tier(text: str) -> Candidate:
    """A tier from ``'{"name": str, "options": {FlashCodecCache options}, "family": optional str}'``."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--tier-json must be a JSON object, got {text!r}: {err}") from err
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("options"), dict):
        raise ValueError(f'--tier-json must look like {{"name": "...", "options": {{...}}}}, got {text!r}')
    return Candidate(spec.get("family", CUSTOM), Tier(spec["name"], spec["options"], note="--tier-json"))


def candidates(names: list[str] | None, extra: list[Candidate]) -> list[Candidate]:
    """Flashcodec tiers + peers + ``extra``; ``names`` (tier or family names) selects among the first two."""
    known = flashcodec_tiers() + [Candidate(family, tier) for family, tier in peer_tiers()]
    if names is not None:
        labels = {c.tier.name for c in known} | {c.family for c in known}
        unknown = [n for n in names if n not in labels]
        if unknown:
            raise ValueError(f"--tiers: unknown {unknown}; choose among {sorted(labels)}")
        known = [c for c in known if c.tier.name in names or c.family in names]
    return known + extra


def runnable(model: Any, tiers: list[Candidate]) -> tuple[list[Candidate], list[dict]]:
    """The tiers whose cache can be built for ``model``, and the others with the reason."""
    ok, skipped = [], []
    for cand in tiers:
        try:
            make_cache(model, cand.tier)
        except (ImportError, ValueError, TypeError) as err:
            skipped.append({"tier": cand.tier.name, "family": cand.family,
                            "reason": f"{type(err).__name__}: {err}".splitlines()[0]})
            continue
        ok.append(cand)
    return ok, skipped


def stream_all(model: Any, batch: torch.Tensor, tiers: list[Candidate], prefill: int, chunk: int,
               window_texts: list[str] | None = None) -> list[dict]:
    """Run the raw cache and every tier in lockstep over ``batch (W, L)``; one row per tier (raw first), with the
    mean KL per window, per text (``window_texts``: the text of each window) and per bin of ``POSITION_BIN``
    scored positions (``kl_per_position``: how the error grows along the window)."""
    tiers = [Candidate("raw", RAW)] + tiers
    caches = [make_cache(model, c.tier) for c in tiers]
    streams = [streaming(model, batch, cache, prefill, chunk) for cache in caches]
    kl = torch.zeros(len(tiers), batch.shape[0], dtype=torch.float64)
    kl_pos = torch.zeros(len(tiers), batch.shape[1] - prefill, dtype=torch.float64)
    nll = torch.zeros(len(tiers), batch.shape[0], dtype=torch.float64)
    seconds = [0.0] * len(tiers)
    for ref_step in _timed(streams[0], seconds, 0, model, RAW):
        targets = batch[:, ref_step.targets]
        nll[0] += token_nll(ref_step.logprobs, targets).sum(-1).double()
        for i in range(1, len(tiers)):
            step = _timed_next(streams[i], seconds, i, model, tiers[i].tier)
            token = token_kl(ref_step.logprobs, step.logprobs).double()
            kl[i] += token.sum(-1)
            kl_pos[i, ref_step.targets.start - prefill: ref_step.targets.stop - prefill] += token.sum(0)
            nll[i] += token_nll(step.logprobs, targets).sum(-1).double()
    scored = batch.shape[1] - prefill
    values = cached_values(caches[0])
    rows = []
    texts = window_texts or ["?"] * batch.shape[0]
    for cand, cache, k, kp, n, s in zip(tiers, caches, kl, kl_pos, nll, seconds, strict=True):
        kv = cache_bytes(cache)["kv"]
        reported = getattr(cache, "bits_per_value", None)
        rows.append({
            "tier": cand.tier.name, "family": cand.family, "options": None if cand.tier.options is None else
            dict(cand.tier.options), "recipe": _recipe(cand.tier), "note": cand.tier.note, "run_kv_bytes_end": kv,
            "run_values_end": values,
            "run_bits_end": bits_per_value(kv, values),
            "reported_bits_per_value": reported() if callable(reported) else None,
            "kl": float(k.sum() / (scored * batch.shape[0])), "kl_per_window": (k / scored).tolist(),
            "kl_per_text": {t: float(sum(float(k[w]) for w in range(len(texts)) if texts[w] == t)
                                     / (scored * texts.count(t))) for t in dict.fromkeys(texts)},
            "kl_per_position": position_bins(kp / batch.shape[0], prefill),
            "nll": float(n.sum() / (scored * batch.shape[0])), "seconds": s,
        })
        rows[-1]["ppl"] = math.exp(rows[-1]["nll"])
        rows[-1]["delta_ppl"] = rows[-1]["ppl"] - rows[0]["ppl"]
    return rows


def _recipe(tier: Tier) -> dict[str, Any] | None:
    """The options a preset tier resolves to when it ran (presets change between releases), else None."""
    name = (tier.options or {}).get("preset")
    return None if name is None else preset_options(name)


def position_bins(kl: torch.Tensor, prefill: int, width: int = POSITION_BIN) -> dict[str, Any]:
    """``kl (L - prefill,)``: the mean KL at each scored position -> ``{"start": [first position of each bin],
    "width": width, "kl": [mean KL over the bin]}`` (the last bin may be shorter)."""
    starts = list(range(0, kl.numel(), width))
    return {"start": [prefill + s for s in starts], "width": width,
            "kl": [float(kl[s: s + width].mean()) for s in starts]}


def _timed(stream, seconds: list[float], i: int, model: Any, tier: Tier):
    while True:
        try:
            yield _timed_next(stream, seconds, i, model, tier)
        except StopIteration:
            return


def _timed_next(stream, seconds: list[float], i: int, model: Any, tier: Tier):
    start = time.perf_counter()
    with prepared(model, tier):
        step = next(stream)
    seconds[i] += time.perf_counter() - start
    return step


def _kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a model config."""
    text = config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, text.num_key_value_heads, head_dim


def _store(cache: Any, k: torch.Tensor, v: torch.Tensor, layer: int) -> None:
    """Store ``k, v`` in ``cache``'s layer: a codec layer appends without reading back (only bytes are counted
    here; no attention runs; a sliding ring first drops what leaves its window), any other cache through
    ``update``."""
    codec_layer = cache.layers[layer] if layer < len(getattr(cache, "layers", ())) else None
    if hasattr(codec_layer, "codec_cache"):
        if getattr(codec_layer, "is_sliding", False):
            codec_layer.slide()
        codec_layer.codec_cache.append(k, v)
    else:
        cache.update(k, v, layer)


def replica_bits(model: Any, tier: Tier, batch: int, steps: list[tuple[int, int]], record_from: int,
                 dtype: torch.dtype = STORED_DTYPE) -> list[tuple[int, float]]:
    """``(length, bits/value)`` after every update that reaches ``record_from`` tokens, when a fresh cache of
    ``tier`` (and a raw ``DynamicCache``, whose kept values are the denominator) receive random ``dtype`` states of
    ``batch`` rows by the update ``steps`` (``(start, end)`` token ranges, in order), every layer per step.
    Every method measured here keeps bytes that depend only on the lengths and the schedule, not on the values."""
    layers, heads, head_dim = _kv_shape(model.config)
    gen = torch.Generator().manual_seed(0)
    cache, raw = make_cache(model, tier), make_cache(model, RAW)
    curve = []
    for start, end in steps:
        for layer in range(layers):
            k, v = (torch.randn(batch, heads, end - start, head_dim, generator=gen).to(dtype) for _ in range(2))
            _store(cache, k, v, layer)
            raw.update(k, v, layer)
        if end >= record_from:
            curve.append((end, bits_per_value(cache_bytes(cache)["kv"], cached_values(raw))))
    return curve


def decode_bits(model: Any, tier: Tier, batch: int, length: int, span: int = WORST_SPAN) -> list[tuple[int, float]]:
    """``(length, bits/value)`` at lengths ``length - span + 1 .. length`` when one prefill of ``length - span``
    tokens is followed by single tokens (decode): the worst-case schedule."""
    steps = [(0, length - span)] + [(n - 1, n) for n in range(length - span + 1, length + 1)]
    return replica_bits(model, tier, batch, steps, length - span + 1)


def stored_bits(model: Any, tier: Tier, batch: int, length: int, prefill: int, chunk: int,
                span: int = WORST_SPAN) -> dict[str, float | int]:
    """Bits/value of ``tier`` as a bf16 cache keeps them: ``bits_end`` after the streaming protocol's own updates
    (``batch`` windows of ``length``), ``bits_worst`` / ``worst_at`` the most over lengths ``length - span + 1 ..
    length`` when one prefill of ``length - span`` tokens is followed by single tokens (decode)."""
    if not 1 <= span < length:
        raise ValueError(f"span must be in [1, length), got span={span}, length={length}")
    streamed = replica_bits(model, tier, batch, [(f.start, f.stop) for f, _ in stream_steps(length, prefill, chunk)],
                            length)
    worst_at, worst = max(decode_bits(model, tier, batch, length, span), key=lambda point: point[1])
    return {"bits_end": streamed[-1][1], "bits_worst": worst, "worst_at": worst_at}


def run_model(name: str, tiers: list[Candidate], count: int, length: int, prefill: int, chunk: int,
              dtype: torch.dtype, text_names: tuple[str, ...] = KINDS["prose"], outliers: float | None = None) -> dict:
    from flashcodec_fx.pretrained import load_pretrained

    model, tokenizer = load_pretrained(name, dtype=dtype)
    if outliers is not None:
        add_outlier_channels(model, outliers)
    texts = load_tokens(tokenizer, text_names)
    batch = windows(texts, count, length, leading_tokens(tokenizer))
    window_texts = [text_names[i % len(text_names)] for i in range(count)]
    ok, skipped = runnable(model, tiers)
    layers, heads, head_dim = _kv_shape(model.config)
    print(f"\n{name}: {layers} layers, {heads} KV heads, head_dim {head_dim}, {dtype}; {count} windows x {length} "
          f"tokens (prefill {prefill}, chunks of {chunk}); {len(ok)} tiers; skipped: "
          f"{[s['tier'] for s in skipped] or 'none'}", flush=True)
    for s in skipped:
        print(f"  skipped {s['tier']}: {s['reason']}", flush=True)
    start = time.perf_counter()
    rows = stream_all(model, batch, ok, prefill, chunk, window_texts)
    print(f"  streamed {len(rows)} caches in lockstep: {time.perf_counter() - start:.0f} s", flush=True)
    for row, cand in zip(rows, [Candidate("raw", RAW)] + ok, strict=True):
        row.update(stored_bits(model, cand.tier, count, length, prefill, chunk, min(WORST_SPAN, length - 1)))
    print(markdown_table(rows, COLUMNS), flush=True)
    return {"layers": layers, "kv_heads": heads, "head_dim": head_dim,
            "layer_types": list(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []),
            "texts": {t: str(TEXTS[t].relative_to(TEXTS[t].parents[1])) for t in text_names},
            "text_kinds": {t: kind for kind, names in KINDS.items() for t in names if t in text_names},
            "window_texts": window_texts, "text_tokens": [int(t.numel()) for t in texts], "rows": rows,
            "skipped": skipped}


def plot(result: Mapping[str, Any], path: Path) -> Path:
    """Bits/value vs KL (log scale), one curve per method family, one panel per model; lossless tiers (KL <= 1e-7)
    cannot sit on a log axis and are left out (listed in the JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5.2), squeeze=False)
    markers = {"KIVI": "s", "TurboQuant-style": "^", "quanto": "D", FLASHCODEC: "o"}
    for ax, (model, data) in zip(axes[0], models.items(), strict=True):
        families: dict[str, list[dict]] = {}
        for row in data["rows"]:
            if row["family"] != "raw" and row["kl"] > 1e-7:
                families.setdefault(row["family"], []).append(row)
        for family, rows in families.items():
            rows = sorted(rows, key=lambda r: r["bits_end"])
            ax.plot([r["bits_end"] for r in rows], [r["kl"] for r in rows], marker=markers.get(family, "*"),
                    label=family, linewidth=1.5 if family.startswith(FLASHCODEC) else 1)
            for r in rows:
                ax.annotate(r["tier"].removeprefix("flashcodec "), (r["bits_end"], r["kl"]), fontsize=7,
                            textcoords="offset points", xytext=(4, 4))
        ax.set_yscale("log")
        ax.set_xlabel("bits per cached value (as stored, bf16 = 16; at the end of the windows)")
        ax.set_ylabel("KL(raw || tier), nats/token")
        p = data.get("protocol") or result["protocol"]
        ax.set_title(f"{model}: {p['windows']} x {p['window_tokens']} tokens, prefill {p['prefill']}, chunks {p['chunk']}",
                     fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_positions(result: Mapping[str, Any], path: Path) -> Path | None:
    """KL vs position in the window (bins of ``kl_per_position``, log scale), one curve per tier, one panel per
    model: how the error grows with the length read. None when no row has per-position figures."""
    models = {m: [r for r in d["rows"] if r.get("kl_per_position") and r["family"] != "raw" and r["kl"] > 1e-7]
              for m, d in result["models"].items()}
    models = {m: rows for m, rows in models.items() if rows}
    if not models:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.8), squeeze=False)
    for ax, (model, rows) in zip(axes[0], models.items(), strict=True):
        for r in rows:
            bins = r["kl_per_position"]
            ax.plot([s + bins["width"] / 2 for s in bins["start"]], bins["kl"], label=r["tier"],
                    linewidth=1.6 if r["family"].startswith(FLASHCODEC) else 0.9,
                    linestyle="-" if r["family"].startswith(FLASHCODEC) else "--")
        ax.set_yscale("log")
        ax.set_xlabel(f"position in the window (mean over bins of {rows[0]['kl_per_position']['width']} tokens)")
        ax.set_ylabel("KL(raw || tier), nats/token")
        p = result["models"][model].get("protocol") or result["protocol"]
        ax.set_title(f"{model}: {p['windows']} x {p['window_tokens']} tokens, texts {p.get('texts', ['prose'])}",
                     fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def merge(paths: list[Path]) -> dict:
    """One payload from bench_ppl results of different models run with the same protocol (window counts may differ)
    and dtype; each model's entry keeps its protocol and the date, machine and versions of its run (``run``)."""
    results = [json.loads(Path(path).read_text()) for path in paths]
    keys = ("dtype", "stored_dtype", "raw_bits_per_value", "quick", "method")
    same = {k: v for k, v in results[0]["protocol"].items() if k != "windows"}  # window counts may differ by model
    for path, result in zip(paths, results, strict=True):
        if result.get("benchmark") != "ppl" or any(result.get(k) != results[0].get(k) for k in keys) \
                or {k: v for k, v in result["protocol"].items() if k != "windows"} != same:
            raise ValueError(f"--merge: {path} is not a bench_ppl result with the protocol and dtype of {paths[0]}")
    models = {}
    for path, result in zip(paths, results, strict=True):
        for model, data in result["models"].items():
            if model in models:
                raise ValueError(f"--merge: model {model!r} appears twice (in {path})")
            run = {k: result[k] for k in ("date", "machine", "versions", "total_seconds", "quality_measured")
                   if k in result}
            models[model] = {**data, "protocol": result["protocol"], "run": {"file": Path(path).name, **run}}
    return {**{k: results[0][k] for k in keys}, "protocol": {**same, "windows": {m: d["protocol"]["windows"] for m, d in
            models.items()}}, "merged_from": [Path(p).name for p in paths], "models": models}


def recount_bits(path: Path) -> Path:
    """Recount ``bits_end`` / ``bits_worst`` of every row of a result file with the current accounting; the quality
    figures stay as measured. The file's metadata becomes the recount's; the measurement's moves to
    ``quality_measured`` (date, machine, versions)."""
    from flashcodec_fx.pretrained import load_pretrained

    result = json.loads(path.read_text())
    known = {c.tier.name: c.tier for c in candidates(None, [])} | {RAW.name: RAW}
    protocol = result["protocol"]
    for name, data in result["models"].items():
        model, _ = load_pretrained(name, dtype=torch.float32)
        for row in data["rows"]:
            tier = known.get(row["tier"]) or Tier(row["tier"], row["options"])
            row.update(stored_bits(model, tier, protocol["windows"], protocol["window_tokens"], protocol["prefill"],
                                   protocol["chunk"], protocol["worst_span"]))
    measured = {key: result.pop(key) for key in ("date", "machine", "versions")}
    result.pop("benchmark", None)
    return write_result("ppl", {**result, "quality_measured": result.get("quality_measured", measured)}, out=path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", choices=sorted(MODELS), default=None,
                        help="model(s) to run (default: both; --quick: smollm2)")
    parser.add_argument("--quick", action="store_true", help="2 windows x 256 tokens on SmolLM2: about a minute")
    parser.add_argument("--windows", type=int, default=None, help="windows per model (default 6; quick 2)")
    parser.add_argument("--window-tokens", type=int, default=None, help="tokens per window (default 1024; quick 256)")
    parser.add_argument("--prefill", type=int, default=128, help="exact prefill tokens per window (default 128)")
    parser.add_argument("--chunk", type=int, default=16, help="tokens per streamed chunk (default 16)")
    parser.add_argument("--tiers", nargs="*", default=None, metavar="NAME",
                        help="only these tiers or families (e.g. KIVI-2 'TurboQuant-style' flashcodec); none: only "
                             "the --tier-json / --tier-file ones")
    parser.add_argument("--tier-json", action="append", default=[], metavar="JSON",
                        help='extra tier: \'{"name": ..., "options": {FlashCodecCache options}}\' (repeatable)')
    parser.add_argument("--tier-file", type=Path, default=None, metavar="JSON",
                        help="extra tiers: a JSON list of tier-json objects (e.g. data/preset_search.json)")
    parser.add_argument("--texts", nargs="+", choices=sorted(KINDS), default=["prose"], metavar="KIND",
                        help=f"kinds of text the windows come from, in turn (default prose; {KINDS})")
    parser.add_argument("--outliers", type=float, default=None, metavar="FACTOR",
                        help="make a few key and value channels FACTOR times larger first, the model's function "
                             "unchanged (flashcodec_fx.evaluate.outliers; Llama-family models)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="model dtype for the quality run (default float32: in bf16 even a lossless round "
                             "trip of the K/V states moves the outputs about as much as the 8-bit tier); bits are "
                             "always counted as a bf16 cache keeps them")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: small ops on a shared "
                        "2-core machine run faster on one thread)")
    parser.add_argument("--out", default=None, help="JSON path (default results/ppl.json for the full default run, "
                        "results/ppl_experiment.json otherwise)")
    parser.add_argument("--plot", default=None, help="plot path (default next to the JSON: frontier.png for ppl.json)")
    parser.add_argument("--plot-only", action="store_true", help="only redraw the plot from the JSON (--out)")
    parser.add_argument("--recount-bits", action="store_true", help="recount the bits of every row of the JSON "
                        "(--out) with the current accounting, keeping its quality figures")
    parser.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                        help="write one result (--out, default results/ppl.json) from single-model result files")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    count, length = args.windows or shape["windows"], args.window_tokens or shape["window_tokens"]
    default_run = not (args.quick or args.tiers is not None or args.tier_json or args.tier_file or args.model
                       or args.windows or args.window_tokens or args.prefill != 128 or args.chunk != 16
                       or args.dtype != "float32" or args.texts != ["prose"] or args.outliers is not None)
    whole = default_run or args.plot_only or args.merge or args.recount_bits
    out = Path(args.out) if args.out else RESULTS_DIR / ("ppl.json" if whole else "ppl_experiment.json")
    plot_path = Path(args.plot) if args.plot else out.with_name("frontier.png" if out.name == "ppl.json" else f"{out.stem}.png")
    if args.plot_only:
        print(f"wrote {plot(json.loads(out.read_text()), plot_path)}")
        return
    if args.recount_bits:
        path = recount_bits(out)
        print(f"wrote {path} and {plot(json.loads(path.read_text()), plot_path)}")
        return
    if args.merge:
        try:
            payload = merge(args.merge)
        except ValueError as err:
            parser.error(str(err))
        path = write_result("ppl", payload, out=out)
        written = json.loads(path.read_text())
        print(f"wrote {path}, {plot(written, plot_path)} and "
              f"{plot_positions(written, plot_path.with_name(f'{plot_path.stem}_positions.png'))}")
        return
    if count < 1 or length < 2 or not 1 <= args.prefill < length or args.chunk < 1:
        parser.error(f"need windows >= 1, 1 <= prefill < window tokens, chunk >= 1; got windows={count}, "
                     f"window tokens={length}, prefill={args.prefill}, chunk={args.chunk}")
    try:
        extra = [json_tier(text) for text in args.tier_json]
        if args.tier_file is not None:
            extra += [json_tier(json.dumps(spec)) for spec in json.loads(args.tier_file.read_text())]
        tiers = candidates(args.tiers, extra)
    except ValueError as err:
        parser.error(str(err))
    models = args.model or (["smollm2"] if args.quick else sorted(MODELS, key=list(MODELS).index))
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    start = time.perf_counter()
    text_names = kind_texts(args.texts)
    results = {MODELS[m]: run_model(MODELS[m], tiers, count, length, args.prefill, args.chunk, dtype, text_names,
                                    args.outliers) for m in models}
    payload = {
        "dtype": args.dtype, "stored_dtype": "bfloat16", "raw_bits_per_value": 16, "quick": args.quick,
        "protocol": {"windows": count, "window_tokens": length, "prefill": args.prefill, "chunk": args.chunk,
                     "scored_tokens_per_window": length - args.prefill, "worst_span": min(WORST_SPAN, length - 1),
                     "texts": args.texts, "outliers": args.outliers},
        "method": "windows batched; prefill exact, then chunks through the cache (a call attends to its own new "
                  "states exactly in every peer; flashcodec tiers as the package does); KL(raw || tier) per scored "
                  "token, mean over all; bits = 8 * bytes kept / values the raw cache keeps, counted on a bf16 "
                  "replica of each cache fed random states by the same updates (bytes depend on lengths only): "
                  "bits_end after the protocol's updates, bits_worst over lengths L-127..L (one prefill of L-128 "
                  "then token by token); run_* fields: the run's own caches in the run dtype",
        "total_seconds": time.perf_counter() - start, "models": results,
    }
    path = write_result("ppl", payload, out=out)
    written = json.loads(path.read_text())
    print(f"\nwrote {path}, {plot(written, plot_path)} and "
          f"{plot_positions(written, plot_path.with_name(f'{plot_path.stem}_positions.png'))}", file=sys.stderr)


if __name__ == "__main__":
    main()
