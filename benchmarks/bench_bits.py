"""Bits per cached value as stored, by length: every preset and peer at 1k, 4k and 16k tokens (issue 20).

    python benchmarks/bench_bits.py --model smollm2  # 1024 / 4096 / 16384 tokens: minutes (both models: longer)
    python benchmarks/bench_bits.py --lengths 512 1024 --model smollm2

The raw sinks and newest tokens are a fixed cost, so a preset's bits fall with the length. Per length ``L``: one
prefill of ``L - 128`` tokens, then single tokens (decode) up to ``L`` (bench_ppl's worst-case schedule); ``bits``
at ``L`` and ``bits_worst``, the most over lengths ``L - 127 .. L`` (where a raw window or an open group costs
most). Counted on a bf16 replica of each cache fed random states (bench_ppl's ``decode_bits``: every method here
keeps bytes that depend on the lengths only), bits = 8 * bytes kept / values a raw ``DynamicCache`` keeps (a
sliding layer's window only), so a bf16 cache is 16.
Output: ``results/bits.json``.
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_ppl import MODELS, WORST_SPAN, candidates, decode_bits
from common import write_result

from flashcodec_fx.pretrained import load_pretrained

LENGTHS = (1024, 4096, 16384)


def bits_by_length(model, tier, lengths: tuple[int, ...], span: int = WORST_SPAN) -> list[dict[str, float | int]]:
    """``[{"length", "bits", "bits_worst", "worst_at"}]`` per length (one decode run of ``span`` tokens each)."""
    rows = []
    for length in lengths:
        curve = decode_bits(model, tier, 1, length, span)
        worst_at, worst = max(curve, key=lambda point: point[1])
        rows.append({"length": length, "bits": curve[-1][1], "bits_worst": worst, "worst_at": worst_at})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=sorted(MODELS), default=None,
                        help="model (repeatable; default both)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="cache lengths (default "
                        f"{' '.join(map(str, LENGTHS))})")
    parser.add_argument("--out", default=None, help="JSON path (default results/bits.json)")
    args = parser.parse_args(argv)
    if any(length <= WORST_SPAN for length in args.lengths):
        parser.error(f"--lengths must all be > {WORST_SPAN}, got {args.lengths}")
    start, models = time.perf_counter(), {}
    for key in args.model or list(MODELS):
        model, _ = load_pretrained(MODELS[key], dtype=torch.float32)
        rows = []
        for cand in candidates(None, []):
            try:
                rows.append({"tier": cand.tier.name, "family": cand.family,
                             "by_length": bits_by_length(model, cand.tier, tuple(args.lengths))})
            except (ImportError, ValueError, TypeError) as err:
                rows.append({"tier": cand.tier.name, "family": cand.family, "skipped": f"{type(err).__name__}: {err}"})
            print(cand.tier.name, rows[-1].get("by_length", rows[-1].get("skipped")), flush=True)
        models[MODELS[key]] = {"rows": rows}
    payload = {"stored_dtype": "bfloat16", "raw_bits_per_value": 16, "lengths": args.lengths, "worst_span": WORST_SPAN,
               "method": "per length L: a bf16 replica of each cache, random states, one prefill of L - 128 tokens "
                         "then single tokens to L; bits at L and the most over lengths L - 127 .. L",
               "total_seconds": time.perf_counter() - start, "models": models}
    print(f"wrote {write_result('bits', payload, out=args.out)}")


if __name__ == "__main__":
    main()
