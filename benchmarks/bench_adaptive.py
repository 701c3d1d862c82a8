"""Per-layer presets by calibration vs a uniform preset at equal stored bits (``flashcodec_fx.PRESETS``).

    python benchmarks/bench_adaptive.py [--quick] [--out FILE]

1. Calibration, on windows of the calibration text (``corpus.py``'s "pride", which no quality benchmark scores): for
   every codec layer ``i`` and every rung ``r`` of the ladder (presets 2.5bit, 3bit, 4bit, int8), only layer ``i``
   is compressed at ``r`` (every other layer native: ``per_layer={j: None}``) and the mean KL(raw || that cache)
   per scored token of bench_ppl's streaming protocol (prefill exact, then chunks through the cache) is layer
   ``i``'s damage at ``r``.
2. Costs: the stored bits of each codec layer at each rung, as a bf16 cache keeps them (raw = 16 bits/value), on a
   replica of the cache fed random states by the evaluation protocol's updates (bytes depend on lengths only), the
   accounting of bench_ppl's ``bits_end``.
3. Allocation: for a budget equal to a uniform preset's stored bits (2.5bit, 3bit, 4bit on every layer), an exact
   multiple-choice knapsack picks one rung per layer minimizing the summed single-layer damage within the budget.
4. Evaluation, on held-out windows of bench_ppl's texts (alice29, lcet10): raw, each uniform preset and its adaptive
   twin (``per_layer={i: preset_options(rung_i)}``), every codec layer compressed, all in lockstep with the raw
   cache: KL vs raw, ppl, bits as stored (bf16 replica: at the end of the windows and the worst over the last 128
   lengths; and the run's own ``cache.bits_per_value()`` in the run dtype).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from bench_ppl import STORED_DTYPE, WORST_SPAN, Candidate, _kv_shape, _store, stored_bits, stream_all
from common import RESULTS_DIR, write_result
from corpus import STREAMING_TEXTS, TEXTS, leading_tokens, load_tokens, windows

from flashcodec_fx.evaluate import RAW, Tier, make_cache, markdown_table, stream_steps
from flashcodec_fx.presets import PRESETS, preset_options

LADDER = ("2.5bit", "3bit", "4bit", "int8")  # rungs a layer may take, cheapest first
UNIFORM = ("2.5bit", "3bit", "4bit")  # uniform presets whose stored bits the adaptive twins must not exceed
CALIBRATION_TEXT = "pride"  # calibration text; evaluation reads bench_ppl's STREAMING_TEXTS (disjoint)
FAMILY = "adaptive"
SIZES = {"cal_windows": "calibration windows", "cal_tokens": "tokens per calibration window",
         "eval_windows": "evaluation windows", "eval_tokens": "tokens per evaluation window"}
FULL = {"cal_windows": 1, "cal_tokens": 384, "eval_windows": 2, "eval_tokens": 1024}  # 26 min measured, load 6-7
QUICK = {"cal_windows": 1, "cal_tokens": 256, "eval_windows": 1, "eval_tokens": 256}
COLUMNS = [("tier", "tier", "s"), ("per-layer rungs", "allocation", "s"), ("bits end", "bits_end", ".3f"),
           ("bits worst", "bits_worst", ".3f"), ("run bits", "reported_bits_per_value", ".3f"),
           ("KL vs raw", "kl", ".3e"), ("ppl", "ppl", ".3f"), ("Δppl", "delta_ppl", "+.3f"),
           ("predicted damage", "predicted_damage", ".3e")]


def codec_layers(model: Any) -> list[int]:
    """Indices of the layers that carry a codec in a ``FlashCodecCache`` of ``model`` (the ones per_layer may name)."""
    return make_cache(model, Tier("probe", {})).codec_layers


def per_layer_tier(name: str, model: Any, rungs: Mapping[int, str]) -> Tier:
    """A tier whose codec layer ``i`` runs preset ``rungs[i]`` (its full options, no cache-wide preset underneath,
    so nothing of another preset is merged in) and whose other codec layers stay native."""
    per_layer = {i: (preset_options(rungs[i]) if i in rungs else None) for i in codec_layers(model)}
    return Tier(name, {"per_layer": per_layer})


def layer_costs(model: Any, ladder: Sequence[str], rows: int, length: int, prefill: int, chunk: int) -> dict[str, list[int]]:
    """``{rung: [stored bits of codec layer i]}`` as a bf16 cache keeps them, after the streaming protocol's updates
    of ``rows`` windows of ``length`` tokens fed to a replica of the uniform-``rung`` cache (random states: the bytes
    of every preset depend on the lengths only)."""
    layers, heads, head_dim = _kv_shape(model.config)
    costs = {}
    for rung in ladder:
        cache = make_cache(model, Tier(rung, {"preset": rung}))
        gen = torch.Generator().manual_seed(0)
        for fed, _ in stream_steps(length, prefill, chunk):
            for layer in range(layers):
                k, v = (torch.randn(rows, heads, fed.stop - fed.start, head_dim, generator=gen).to(STORED_DTYPE)
                        for _ in range(2))
                _store(cache, k, v, layer)
        costs[rung] = [cache.layers[i].stored_bits() for i in cache.codec_layers]
    return costs


def allocate(damage: Mapping[str, Sequence[float]], cost: Mapping[str, Sequence[int]],
             budget: int) -> tuple[list[str], float, int]:
    """Exact multiple-choice knapsack: one rung per layer with the summed ``cost`` (ints) at most ``budget``,
    minimizing the summed ``damage``. ``damage[rung][i]`` / ``cost[rung][i]``: layer ``i`` at ``rung``.
    Returns (rung per layer, summed damage, summed cost).

    Dynamic programming over the layers keeping the Pareto front of (cost, damage) of partial allocations: a partial
    allocation that costs at least as much as another and does at least as much damage cannot complete better."""
    rungs = list(damage)
    if not rungs or set(cost) != set(rungs):
        raise ValueError(f"damage and cost must name the same non-empty rungs, got {sorted(damage)} and {sorted(cost)}")
    layers = len(damage[rungs[0]])
    if any(len(damage[r]) != layers or len(cost[r]) != layers for r in rungs):
        raise ValueError(f"every rung needs one damage and one cost per layer ({layers} layers)")
    cheapest = sum(min(cost[r][i] for r in rungs) for i in range(layers))
    if budget < cheapest:
        raise ValueError(f"budget {budget} is below the cheapest allocation ({cheapest})")
    front: list[tuple[int, float, tuple[str, ...]]] = [(0, 0.0, ())]
    for i in range(layers):
        grown = sorted((spent + cost[r][i], total + damage[r][i], picks + (r,))
                       for spent, total, picks in front for r in rungs if spent + cost[r][i] <= budget)
        front, best = [], math.inf
        for state in grown:
            if state[1] < best:
                front.append(state)
                best = state[1]
    spent, total, picks = min(front, key=lambda state: state[1])
    return list(picks), total, spent


def calibrate(model: Any, batch: torch.Tensor, ladder: Sequence[str], prefill: int, chunk: int) -> dict[str, list[float]]:
    """``{rung: [damage of codec layer i]}``: mean KL vs raw over the scored tokens of ``batch (W, L)`` when only
    layer ``i`` is compressed at ``rung`` (all layers of one rung in lockstep with one raw cache)."""
    damage = {}
    for rung in ladder:
        tiers = [Candidate("calibration", per_layer_tier(f"{rung} @ layer {i}", model, {i: rung}))
                 for i in codec_layers(model)]
        rows = stream_all(model, batch, tiers, prefill, chunk)[1:]
        damage[rung] = [row["kl"] for row in rows]
        worst = max(range(len(rows)), key=damage[rung].__getitem__)
        print(f"  calibrated {rung}: summed KL {sum(damage[rung]):.3e}, largest {damage[rung][worst]:.3e} at layer "
              f"{codec_layers(model)[worst]}", flush=True)
    return damage


def _compact(picks: Sequence[str], ladder: Sequence[str]) -> str:
    """Rung per layer as one digit each (its index in the ladder)."""
    return "".join(str(ladder.index(r)) for r in picks)


def run(model: Any, cal_batch: torch.Tensor, eval_batch: torch.Tensor, ladder: Sequence[str] = LADDER,
        uniform: Sequence[str] = UNIFORM, prefill: int = 128, chunk: int = 16) -> dict[str, Any]:
    """Calibrate on ``cal_batch``, allocate at every uniform budget, evaluate on ``eval_batch``: the result payload."""
    unknown = [name for name in (*ladder, *uniform) if name not in PRESETS]
    if unknown:
        raise ValueError(f"ladder and uniform must name presets among {sorted(PRESETS)}, got {unknown}")
    missing = [name for name in uniform if name not in ladder]
    if missing:
        raise ValueError(f"every uniform preset must be a ladder rung (its allocation is then feasible), got {missing}")
    layers = codec_layers(model)
    start = time.perf_counter()
    damage = calibrate(model, cal_batch, ladder, prefill, chunk)
    calibration_s = time.perf_counter() - start
    costs = layer_costs(model, ladder, eval_batch.shape[0], eval_batch.shape[1], prefill, chunk)
    tiers, allocations = [], {}
    for name in uniform:
        budget = sum(costs[name])
        picks, predicted, spent = allocate(damage, costs, budget)
        allocations[name] = {"rungs": dict(zip(map(str, layers), picks, strict=True)), "budget_bits": budget,
                             "allocated_bits": spent, "predicted_damage": predicted,
                             "uniform_predicted_damage": sum(damage[name])}
        tiers.append((Candidate("uniform", Tier(f"uniform {name}", {"preset": name})), f"{name} x {len(layers)}",
                      sum(damage[name])))
        tiers.append((Candidate(FAMILY, per_layer_tier(f"adaptive @ {name} bits", model, dict(zip(layers, picks,
                                                                                                strict=True)))),
                      _compact(picks, ladder), predicted))
    start = time.perf_counter()
    rows = stream_all(model, eval_batch, [cand for cand, _, _ in tiers], prefill, chunk)
    span = min(WORST_SPAN, eval_batch.shape[1] - 1)
    for row, (cand, allocation, predicted) in zip(rows, [(Candidate("raw", RAW), "-", 0.0), *tiers],
                                                  strict=True):
        row.update(stored_bits(model, cand.tier, eval_batch.shape[0], eval_batch.shape[1], prefill, chunk, span),
                   allocation=allocation, predicted_damage=predicted)
    evaluation_s = time.perf_counter() - start
    print(markdown_table(rows, COLUMNS), flush=True)
    return {"ladder": list(ladder), "uniform": list(uniform), "codec_layers": layers,
            "protocol": {"prefill": prefill, "chunk": chunk, "worst_span": span,
                         "calibration": {"windows": cal_batch.shape[0], "window_tokens": cal_batch.shape[1],
                                         "seconds": calibration_s},
                         "evaluation": {"windows": eval_batch.shape[0], "window_tokens": eval_batch.shape[1],
                                        "seconds": evaluation_s}},
            "damage": damage, "layer_cost_bits": costs, "allocations": allocations, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 x 256 tokens each (smoke run, a few minutes)")
    parser.add_argument("--model", default=None, help="model for load_pretrained (default SmolLM2-135M-Instruct)")
    for key, what in SIZES.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                            help=f"{what} (default {FULL[key]}; quick {QUICK[key]})")
    parser.add_argument("--prefill", type=int, default=128, help="exact prefill tokens per window (default 128)")
    parser.add_argument("--chunk", type=int, default=16, help="tokens per streamed chunk (default 16)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as bench_ppl)")
    parser.add_argument("--out", default=None, help="JSON path (default results/adaptive.json; --quick or other sizes: "
                        "results/adaptive_experiment.json, ignored by git)")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    sizes = {key: getattr(args, key) or value for key, value in shape.items()}
    for key in ("cal_tokens", "eval_tokens"):
        if sizes[key] <= args.prefill:
            parser.error(f"--{key.replace('_', '-')} must exceed --prefill ({args.prefill}), got {sizes[key]}")
    torch.set_num_threads(args.threads)

    from flashcodec_fx.pretrained import load_pretrained

    model, tokenizer = load_pretrained(args.model, dtype=torch.float32)
    lead = leading_tokens(tokenizer)
    cal_batch = windows(load_tokens(tokenizer, (CALIBRATION_TEXT,)), sizes["cal_windows"], sizes["cal_tokens"], lead)
    eval_batch = windows(load_tokens(tokenizer, STREAMING_TEXTS), sizes["eval_windows"], sizes["eval_tokens"], lead)
    print(f"calibration: {sizes['cal_windows']} x {sizes['cal_tokens']} tokens of {CALIBRATION_TEXT}; evaluation: "
          f"{sizes['eval_windows']} x {sizes['eval_tokens']} of {'+'.join(STREAMING_TEXTS)}; ladder {LADDER}", flush=True)
    start = time.perf_counter()
    payload = run(model, cal_batch, eval_batch, prefill=args.prefill, chunk=args.chunk)
    path = write_result(FAMILY, {
        "model": args.model or "SmolLM2-135M-Instruct", "dtype": "float32", "stored_dtype": "bfloat16",
        "quick": args.quick, "threads": args.threads,
        "texts": {"calibration": str(TEXTS[CALIBRATION_TEXT].relative_to(TEXTS[CALIBRATION_TEXT].parents[1])),
                  "evaluation": [str(TEXTS[t].relative_to(TEXTS[t].parents[1])) for t in STREAMING_TEXTS]},
        "method": "damage = mean KL(raw || cache) per scored token with only that layer at that rung (streaming "
                  "protocol, calibration text); cost = that layer's stored bits on a bf16 replica fed by the "
                  "evaluation protocol's updates; allocation = exact multiple-choice knapsack of summed damage "
                  "within the uniform preset's stored bits; bits_end / bits_worst as bench_ppl (bf16 replica), "
                  "reported_bits_per_value = the run's own cache.bits_per_value() (fp32 run: raw tokens at 32 bits)",
        "total_seconds": time.perf_counter() - start, **payload,
    }, out=args.out or RESULTS_DIR / ("adaptive.json" if sizes == FULL and not args.quick else "adaptive_experiment.json"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
