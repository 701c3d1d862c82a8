"""Per-layer bit allocation within a bits budget: calibrate on one kind of text, judge on bench_ppl's protocol.

    python benchmarks/bench_allocate.py --out benchmarks/results/allocate_smollm2.json   # ~20 minutes, one thread

Calibration (``flashcodec_fx.evaluate.allocate.layer_gains``): ``--calibration-windows`` windows of
``--calibration-texts`` (default: 2 x 1024 tokens of dialogue, text the judged windows do not hold) streamed through
the raw cache, the base recipe (3-bit trellis keys, 2-bit trellis values, 4 raw sinks each, no raw window) and, for
every layer, the base with that layer's values at 3 bits; the layers whose upgrade lowered the KL most are upgraded,
as many as fit ``--budget`` bits/value as stored (bench_ppl's counts, a bf16 cache: the more of the streaming run's
at its end and the most over lengths 897..1024 with one prefill then single tokens). Judged on bench_ppl's streaming
protocol (6 x 1024 tokens of prose, prefill 128, chunks of 16; ``--prefill 896 --chunk 1``: token by token, as
``generate()`` reads the cache) beside the ``3bit`` preset, its trellis twin, the best uniform recipe found within 3.0
bits on SmolLM2 (keys' newest 23 raw, docs/quantization.md), the base, and the same number of upgraded layers taken
from the front (a rule that needs no calibration).
``--calibration FILE`` takes the layer ranking of an earlier run's JSON instead of calibrating again (the same model
and base), then fits the budget as above:

    python benchmarks/bench_allocate.py --calibration benchmarks/results/allocate_smollm2.json --prefill 896 \
        --chunk 1 --out benchmarks/results/allocate_smollm2_decode.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from bench_ppl import MODELS, Candidate, _kv_shape, stored_bits, stream_all
from common import write_result
from corpus import KINDS, leading_tokens, load_tokens, windows

from flashcodec_fx.evaluate import Tier
from flashcodec_fx.evaluate.allocate import layer_gains, upgraded

FAMILY = "flashcodec per-layer allocation (issue 42)"
PREFILL, CHUNK = 128, 16  # the calibration's streaming protocol, and the bits' count (bench_ppl's)


def _trellis(bits: int, window: int, center: bool) -> dict[str, Any]:
    return {"mode": "jpeg", "block_size": 1, "quant_bits": bits, "levels": "tcq", "rotate": True, "center": center,
            "normalize": True, "scale_search": "fit", "sinks": 4, "window": window}


BASE = {"key_options": _trellis(3, 0, True), "value_options": _trellis(2, 0, False)}
UPGRADE = {"value_options": {"quant_bits": 3}}
BEST_UNIFORM = {"key_options": _trellis(3, 23, True), "value_options": _trellis(2, 0, False)}


def stored(bits: dict[str, float | int]) -> float:
    """The most of a recipe's bits/value as stored, streaming (at the end) or decoding (worst over the last lengths):
    on sliding-window layers the streaming count can be the larger."""
    return max(bits["bits_end"], bits["bits_worst"])


def fitting(model: Any, ranked: list[int], budget: float, count: int, length: int) -> tuple[int, dict]:
    """The most layers of ``ranked`` (in order) whose upgrade keeps the recipe within ``budget`` bits (:func:`stored`),
    with its bits."""
    best = (0, stored_bits(model, Tier("base", BASE), count, length, PREFILL, CHUNK))
    lo, hi = 1, len(ranked)
    while lo <= hi:
        mid = (lo + hi) // 2
        bits = stored_bits(model, Tier("try", upgraded(BASE, UPGRADE, ranked[:mid])), count, length, PREFILL, CHUNK)
        if stored(bits) <= budget:
            best, lo = (mid, bits), mid + 1
        else:
            hi = mid - 1
    if stored(best[1]) > budget:
        raise SystemExit(f"the base recipe alone stores {stored(best[1]):.3f} bits/value, over --budget {budget}")
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--budget", type=float, default=3.0, help="bits/value as stored, worst case (default 3.0)")
    parser.add_argument("--calibration-texts", choices=sorted(KINDS), default="dialogue")
    parser.add_argument("--calibration-windows", type=int, default=2)
    parser.add_argument("--judge-texts", choices=sorted(KINDS), default="prose")
    parser.add_argument("--windows", type=int, default=6, help="judged windows (default 6, bench_ppl's)")
    parser.add_argument("--window-tokens", type=int, default=1024)
    parser.add_argument("--prefill", type=int, default=PREFILL, help=f"judged protocol's prefill (default {PREFILL})")
    parser.add_argument("--chunk", type=int, default=CHUNK, help=f"judged protocol's chunk (default {CHUNK}; 1: token "
                        "by token)")
    parser.add_argument("--calibration", type=Path, default=None, metavar="JSON",
                        help="take the layer ranking of this earlier run (same model and base) instead of "
                        "calibrating, then fit --budget")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON path (default results/allocate.json)")
    args = parser.parse_args(argv)
    earlier = json.loads(args.calibration.read_text()) if args.calibration is not None else None
    if earlier is not None and earlier["model"] != MODELS[args.model]:
        parser.error(f"--calibration {args.calibration} calibrated {earlier['model']}, this run judges "
                     f"{MODELS[args.model]} (--model)")
    if earlier is not None and earlier["calibration"]["base"] != BASE:
        parser.error(f"--calibration {args.calibration} ranked upgrades over another base recipe than this run's {BASE}")
    calibration_texts = args.calibration_texts if earlier is None else earlier["calibration"]["texts"]
    if calibration_texts == args.judge_texts:
        parser.error(f"the calibration text ({calibration_texts}) must differ from --judge-texts (a layer ranking "
                     "judged on its own text is in-sample)")
    torch.set_num_threads(args.threads)
    from flashcodec_fx.pretrained import load_pretrained

    start = time.perf_counter()
    model, tokenizer = load_pretrained(MODELS[args.model], dtype=torch.float32)
    lead = leading_tokens(tokenizer)
    if earlier is None:
        calibration = windows(load_tokens(tokenizer, KINDS[args.calibration_texts]), args.calibration_windows,
                              args.window_tokens, lead)
        gains = layer_gains(model, calibration, BASE, UPGRADE, prefill=PREFILL, chunk=CHUNK)
        ranked = gains.ranked()
        print(f"calibrated on {args.calibration_windows} x {args.window_tokens} tokens of {args.calibration_texts}: "
              f"base KL {gains.base_kl:.4e}; layers by gain {[(i, round(gains.gains[i], 5)) for i in ranked]}",
              flush=True)
        calibrated = {"texts": args.calibration_texts, "windows": args.calibration_windows,
                      "window_tokens": args.window_tokens, "base": BASE, "upgrade": UPGRADE,
                      "base_kl": gains.base_kl, "layer_kl": dict(gains.layer_kl), "ranked": ranked}
    else:
        calibrated = dict(earlier["calibration"], source=str(args.calibration))
        ranked = calibrated["ranked"]
    upgraded_count, bits = fitting(model, ranked, args.budget, args.windows, args.window_tokens)
    chosen = ranked[:upgraded_count]
    calibrated["upgraded"] = chosen
    print(f"{upgraded_count} layers fit {args.budget} bits ({stored(bits):.3f} at most): {chosen}", flush=True)
    layers = _kv_shape(model.config)[0]
    tiers = [
        Candidate("flashcodec", Tier("flashcodec 3bit", {"preset": "3bit"})),
        Candidate("flashcodec", Tier("flashcodec 3bit-tcq", {"preset": "3bit-tcq"})),
        Candidate(FAMILY, Tier("tcq K3 W23 + V2 W0 (best uniform)", BEST_UNIFORM)),
        Candidate(FAMILY, Tier("base: tcq K3 W0 + V2 W0", BASE)),
        Candidate(FAMILY, Tier(f"base + V3 in {upgraded_count} calibrated layers", upgraded(BASE, UPGRADE, chosen))),
        Candidate(FAMILY, Tier(f"base + V3 in the first {upgraded_count} layers",
                               upgraded(BASE, UPGRADE, list(range(upgraded_count))))),
    ]
    judged = windows(load_tokens(tokenizer, KINDS[args.judge_texts]), args.windows, args.window_tokens, lead)
    rows = stream_all(model, judged, tiers, args.prefill, args.chunk)
    for row, cand in zip(rows, [None] + tiers, strict=True):
        if cand is not None:
            row.update(stored_bits(model, cand.tier, args.windows, args.window_tokens, PREFILL, CHUNK))
        print(f"  {row['tier']}: KL {row['kl']:.4e}, bits {row.get('bits_worst', 16):.3f} (worst)", flush=True)
    payload = {
        "model": MODELS[args.model], "layers": layers, "budget": args.budget,
        "calibration": calibrated,
        "protocol": {"texts": args.judge_texts, "windows": args.windows, "window_tokens": args.window_tokens,
                     "prefill": args.prefill, "chunk": args.chunk, "threads": args.threads},
        "rows": rows, "total_seconds": time.perf_counter() - start,
    }
    print(f"wrote {write_result('allocate', payload, out=args.out)}")


if __name__ == "__main__":
    main()
