"""Per-layer budgets by calibration vs a uniform tier at equal storage (jpeg r=8 int8, keep_freqs per layer).

    python benchmarks/bench_adaptive.py [--quick] [--out FILE]

1. Calibration (on windows from the first part of the corpus): for every layer ``i`` and every truncated rung
   ``K`` of the ladder (1, 2, 4), only layer ``i`` is compressed (jpeg r=8, K coefficients, int8; every other layer native via
   ``per_layer={j: None}``) and the mean KL(raw || that cache) of next-token distributions is measured by teacher
   forcing. That is layer ``i``'s damage at ``K``. The top rung (K=8, all coefficients, int8) is taken as damage 0:
   on this model it is near lossless (see ppl.json).
2. Allocation: a jpeg int8 block with K coefficients keeps ``K * (head_dim + 4)`` bytes per head, so storage is
   proportional to the sum of the per-layer K. For a budget equal to a uniform tier's (K_u on every layer), an exact
   multiple-choice knapsack (dynamic programming) picks one rung in {1, 2, 4, 8} per layer minimizing the summed
   damage; budgets: uniform K = 2, 3, 4, 6.
3. Evaluation (on held-out windows from the rest of the corpus): raw, each uniform tier and its adaptive twin,
   every layer compressed; perplexity, delta vs raw, mean KL vs raw and the measured KV bytes.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch
from common import write_result
from corpus import TEXTS, windows

from flashcodec_fx.evaluate import Tier, cache_bytes, make_cache, markdown_table, mean_kl, nll, teacher_forced

HERE = Path(__file__).resolve().parent
CORPUS = TEXTS["pride"]
BLOCK = 8
LADDER = (1, 2, 4, 8)  # keep_freqs rungs; the last one is taken as lossless-enough (damage 0)
UNIFORM_BUDGETS = (2, 3, 4, 6)  # uniform keep_freqs whose storage the adaptive allocation must not exceed
CALIBRATION_SHARE = 0.25  # calibration windows come from the first quarter of the corpus, evaluation from the rest
COLUMNS = [("tier", "tier", "s"), ("per-layer K", "allocation", "s"), ("KV bytes", "kv_bytes", ",d"),
           ("vs raw", "kv_ratio", ".3f"), ("bits/value", "bits_per_value", ".2f"), ("ppl", "ppl", ".3f"),
           ("Δppl", "delta_ppl", "+.3f"), ("KL vs raw", "kl", ".3e")]


def jpeg_int8(keep: int, per_layer: dict | None = None) -> dict:
    options = {"mode": "jpeg", "block_size": BLOCK, "keep_freqs": keep, "quant_bits": 8}
    return options if per_layer is None else {**options, "per_layer": per_layer}


def calibrate(model: Any, batch: torch.Tensor, prefix: int, layers: int) -> dict[int, list[float]]:
    """``{K: [damage of layer i]}``: mean KL vs raw when only layer ``i`` is jpeg r=8 K int8 (others native)."""
    prefix_ids, target_ids = batch[:, :prefix], batch[:, prefix:]
    reference = teacher_forced(model, prefix_ids, target_ids, make_cache(model, Tier("raw")))
    damage = {}
    for keep in LADDER[:-1]:
        damage[keep] = []
        for layer in range(layers):
            only = {j: None for j in range(layers) if j != layer}
            cache = make_cache(model, Tier(f"K={keep} layer {layer}", jpeg_int8(keep, only)))
            damage[keep].append(mean_kl(reference, teacher_forced(model, prefix_ids, target_ids, cache)))
        print(f"  calibrated K={keep}: max layer KL {max(damage[keep]):.2e} at layer "
              f"{max(range(layers), key=damage[keep].__getitem__)}", flush=True)
    damage[LADDER[-1]] = [0.0] * layers
    return damage


def allocate(damage: dict[int, list[float]], budget: int) -> tuple[list[int], float]:
    """One rung per layer with ``sum(K) <= budget`` minimizing the summed damage (exact DP over the integer budget).
    Returns (K per layer, predicted summed damage)."""
    layers = len(next(iter(damage.values())))
    if budget < min(LADDER) * layers:
        raise ValueError(f"budget {budget} is below the cheapest allocation {min(LADDER) * layers}")
    best = {0: (0.0, [])}  # spent units -> (damage, choices) over the layers seen so far
    for layer in range(layers):
        nxt: dict[int, tuple[float, list[int]]] = {}
        for spent, (total, picks) in best.items():
            for keep in LADDER:
                cost = spent + keep
                if cost > budget:
                    continue
                cand = (total + damage[keep][layer], picks + [keep])
                if cost not in nxt or cand[0] < nxt[cost][0]:
                    nxt[cost] = cand
        best = nxt
    total, picks = min(best.values(), key=lambda item: item[0])
    return picks, total


def evaluate(model: Any, batch: torch.Tensor, prefix: int, tiers: list[tuple[Tier, str]]) -> list[dict]:
    """Teacher-forced ppl / KL / bytes per tier on ``batch``; the first tier is raw."""
    prefix_ids, target_ids = batch[:, :prefix], batch[:, prefix:]
    rows, reference, raw = [], None, None
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    for tier, allocation in tiers:
        cache = make_cache(model, tier)
        logprobs = teacher_forced(model, prefix_ids, target_ids, cache)
        nbytes = cache_bytes(cache)["kv"]
        if reference is None:
            reference, raw = logprobs, nbytes
        loss = nll(logprobs, target_ids)
        rows.append({"tier": tier.name, "allocation": allocation, "options": tier.options, "kv_bytes": nbytes,
                     "kv_ratio": nbytes / raw, "bits_per_value": 8 * nbytes / (raw / itemsize), "nll": loss,
                     "ppl": math.exp(loss), "kl": mean_kl(reference, logprobs)})
        print(f"  {tier.name}: ppl {rows[-1]['ppl']:.3f}  KL {rows[-1]['kl']:.3e}", flush=True)
    for row in rows:
        row["delta_ppl"] = row["ppl"] - rows[0]["ppl"]
    return rows


def _compact(picks: list[int]) -> str:
    return "".join(str(k) for k in picks)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows, calibration on 1 window (smoke run)")
    parser.add_argument("--model", default=None, help="model for load_pretrained (default SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/adaptive.json)")
    args = parser.parse_args(argv)
    cal_windows, cal_prefix, cal_target = (1, 64, 4) if args.quick else (1, 128, 12)
    eval_windows, eval_prefix, eval_target = (2, 64, 16) if args.quick else (3, 192, 48)

    from flashcodec_fx.pretrained import load_pretrained

    model, tokenizer = load_pretrained(args.model, dtype=torch.float32)
    layers = model.config.num_hidden_layers
    ids = torch.tensor(tokenizer(CORPUS.read_text())["input_ids"], dtype=torch.int64)
    split = int(ids.numel() * CALIBRATION_SHARE)
    cal_batch = windows([ids[:split]], cal_windows, cal_prefix + cal_target)
    eval_batch = windows([ids[split:]], eval_windows, eval_prefix + eval_target)
    print(f"calibration: {cal_windows} windows x ({cal_prefix} + {cal_target}) from tokens [0, {split}); "
          f"{layers} layers x rungs {LADDER[:-1]}", flush=True)
    start = time.perf_counter()
    damage = calibrate(model, cal_batch, cal_prefix, layers)
    calibration_s = time.perf_counter() - start

    tiers: list[tuple[Tier, str]] = [(Tier("raw DynamicCache"), "-")]
    allocations = {}
    for keep in UNIFORM_BUDGETS:
        picks, predicted = allocate(damage, keep * layers)
        allocations[keep] = {"per_layer_keep_freqs": picks, "units": sum(picks), "budget_units": keep * layers,
                             "predicted_summed_damage": predicted,
                             "uniform_predicted_summed_damage": _uniform_damage(damage, keep)}
        per_layer = {i: {"keep_freqs": k} for i, k in enumerate(picks)}
        tiers.append((Tier(f"uniform K={keep} int8", jpeg_int8(keep)), f"{keep} x {layers}"))
        tiers.append((Tier(f"adaptive @ K={keep} budget", jpeg_int8(keep, per_layer)), _compact(picks)))
    tiers.append((Tier(f"uniform K={LADDER[-1]} int8", jpeg_int8(LADDER[-1])), f"{LADDER[-1]} x {layers}"))
    print(f"evaluation: {eval_windows} windows x ({eval_prefix} + {eval_target}) from tokens [{split}, {ids.numel()})",
          flush=True)
    rows = evaluate(model, eval_batch, eval_prefix, tiers)
    print(markdown_table(rows, COLUMNS))
    path = write_result("adaptive", {
        "model": args.model or "SmolLM2-135M-Instruct", "dtype": "float32", "quick": args.quick,
        "corpus": str(CORPUS.relative_to(HERE.parent)),
        "calibration": {"windows": cal_windows, "prefix_tokens": cal_prefix, "target_tokens": cal_target,
                        "token_range": [0, split], "seconds": calibration_s,
                        "per_layer_kl": {str(k): v for k, v in damage.items()},
                        "note": f"damage of K={LADDER[-1]} int8 taken as 0 (not measured per layer)"},
        "evaluation": {"windows": eval_windows, "prefix_tokens": eval_prefix, "target_tokens": eval_target,
                       "token_range": [split, ids.numel()]},
        "allocations": {str(k): v for k, v in allocations.items()},
        "rows": rows,
    }, out=args.out)
    print(f"wrote {path}")


def _uniform_damage(damage: dict[int, list[float]], keep: int) -> float | None:
    """Predicted summed damage of the uniform tier, when its K is a calibrated rung."""
    return sum(damage[keep]) if keep in damage else None


if __name__ == "__main__":
    main()
