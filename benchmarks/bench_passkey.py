"""Passkey retrieval at long context: does each preset retrieve what the raw cache retrieves?

    python benchmarks/bench_passkey.py                          # SmolLM2, 2k / 4k / 8k tokens, every preset
    python benchmarks/bench_passkey.py --lengths 2048 --keys 1  # a quick look

Protocol (the passkey test of Mohtashami & Jaggi, 2023): a haystack of ``L`` tokens of repeated filler sentences
holds one line "The pass key is NNNNN. Remember it. NNNNN is the pass key." at a relative depth (10%, 50%, 90%), and
ends with the question "What is the pass key? The pass key is". The haystack up to the question goes through prefill
(exact, as every prompt does); the question is then fed in one call through the cache (its queries read the whole
history as stored), and the answer is decoded greedily, every step reading the cache. A trial retrieves when the
decoded digits are the key. One raw prefill per haystack serves every tier: each tier's cache receives the prefill's
exact keys and values as its first update (what a prefill through that cache would store).
Output: ``results/passkey.json`` (per tier, length and depth: retrieved keys, the answers), ``results/passkey.png``.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path
from typing import Any

import torch
from common import RESULTS_DIR, write_result

import flashcodec_fx
from flashcodec_fx.evaluate import RAW, Tier, make_cache, prepared
from flashcodec_fx.evaluate.drive import cache_kwarg

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz "
         "you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
LENGTHS = (2048, 4096, 8192)
DEPTHS = (0.1, 0.5, 0.9)
ANSWER_TOKENS = 8


def haystacks(tokenizer: Any, length: int, depths: tuple[float, ...], key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(context (len(depths), C), question (1, Q))`` token ids: intro, filler with the needle at each relative depth,
    cut so that context + question is ``length`` tokens."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    intro, needle, question = ids(INTRO), ids(NEEDLE.format(key=key)), ids(QUESTION)
    lead = list(tokenizer("")["input_ids"])
    room = length - len(lead) - len(intro) - len(needle) - len(question)
    if room < 1:
        raise ValueError(f"length {length} cannot hold the intro, needle and question")
    filler = ids(FILLER * (room // 8 + 2))[:room]
    rows = []
    for depth in depths:
        at = int(room * depth)
        rows.append(lead + intro + filler[:at] + needle + filler[at:])
    return torch.tensor(rows, dtype=torch.int64), torch.tensor([question], dtype=torch.int64)


@torch.no_grad()
def prefill_states(model: Any, context: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The exact ``(keys, values)`` ``(B, H, C, D)`` of every layer after a raw prefill of ``context (B, C)``."""
    cache = make_cache(model, RAW)
    model(input_ids=context, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    return [(layer.keys, layer.values) for layer in cache.layers]


@torch.no_grad()
def answer(model: Any, tier: Tier, states: list[tuple[torch.Tensor, torch.Tensor]], question: torch.Tensor,
           new_tokens: int = ANSWER_TOKENS) -> torch.Tensor:
    """Greedy answer tokens ``(B, new_tokens)``: ``tier``'s cache takes ``states`` as its first update, then the
    question ``(1, Q)`` (one call through the cache) and the answer steps read it."""
    cache = make_cache(model, tier)
    for i, (k, v) in enumerate(states):
        cache.update(k, v, i)
        if hasattr(cache.layers[i], "attention_bound"):  # the raw prefill attended exactly, as the "kvcodec"
            cache.layers[i].attention_bound = True  # attention serves a prefill (what a loaded cache file records)
    kwarg, ids = cache_kwarg(model), question.expand(states[0][0].shape[0], -1)
    out = []
    with prepared(model, tier):
        for _ in range(new_tokens):
            logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache}).logits[:, -1]
            ids = logits.argmax(-1, keepdim=True)
            out.append(ids)
    return torch.cat(out, dim=1)


def retrieved(text: str, key: int) -> bool:
    """Whether the first number in ``text`` is ``key``."""
    found = re.search(r"\d+", text)
    return found is not None and int(found.group()) == key


def tiers(names: list[str]) -> list[Tier]:
    """The raw cache, then ``flashcodec <preset>`` for each preset name."""
    return [RAW] + [Tier(f"flashcodec {name}", {"preset": name}) for name in names]


def run(model: Any, tokenizer: Any, tier_list: list[Tier], lengths: tuple[int, ...], keys: list[int]) -> list[dict]:
    """One row per (tier, length, depth): the keys tried, which were retrieved, the decoded answers."""
    rows: dict[tuple[str, int, float], dict] = {}
    for length in lengths:
        for key in keys:
            context, question = haystacks(tokenizer, length, DEPTHS, key)
            start = time.perf_counter()
            states = prefill_states(model, context)
            print(f"  {length} tokens, key {key}: prefill {time.perf_counter() - start:.0f} s", flush=True)
            for tier in tier_list:
                tokens = answer(model, tier, states, question)
                for depth, row in zip(DEPTHS, tokens, strict=True):
                    text = tokenizer.decode(row, skip_special_tokens=True)
                    entry = rows.setdefault((tier.name, length, depth), {
                        "tier": tier.name, "length": length, "depth": depth, "keys": [], "retrieved": [],
                        "answers": []})
                    entry["keys"].append(key)
                    entry["retrieved"].append(retrieved(text, key))
                    entry["answers"].append(text)
            del states
    out = list(rows.values())
    for row in out:
        row["accuracy"] = sum(row["retrieved"]) / len(row["retrieved"])
    return out


def summary(rows: list[dict]) -> list[dict]:
    """Per (tier, length): trials retrieved over all depths and keys, and whether the tier retrieved every trial
    that the raw cache retrieved."""
    raw = {(r["length"], r["depth"]): r["retrieved"] for r in rows if r["tier"] == RAW.name}
    out: dict[tuple[str, int], dict] = {}
    for r in rows:
        s = out.setdefault((r["tier"], r["length"]), {"tier": r["tier"], "length": r["length"], "retrieved": 0,
                                                      "trials": 0, "matches_raw": True})
        s["retrieved"] += sum(r["retrieved"])
        s["trials"] += len(r["retrieved"])
        base = raw[(r["length"], r["depth"])]
        s["matches_raw"] &= all(got or not want for got, want in zip(r["retrieved"], base, strict=True))
    return list(out.values())


def plot(result: dict, path: Path) -> Path:
    """Retrieved fraction per tier and length (grouped bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]
    names = list(dict.fromkeys(r["tier"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        got = {r["length"]: r["retrieved"] / r["trials"] for r in rows if r["tier"] == name}
        ax.bar([j + i * width for j in range(len(lengths))], [got[n] for n in lengths], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [f"{n} tokens" for n in lengths])
    ax.set_ylabel("pass keys retrieved (fraction)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{result['model']}: passkey retrieval, depths {list(DEPTHS)}, {len(result['keys'])} keys each",
                 fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="haystack lengths in tokens")
    parser.add_argument("--keys", type=int, default=3, help="pass keys per length and depth (default 3)")
    parser.add_argument("--presets", nargs="+", default=[p for p in flashcodec_fx.PRESETS if p != "lossless"],
                        choices=sorted(flashcodec_fx.PRESETS), help="presets to test (default: every lossy one)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "passkey.json")
    args = parser.parse_args(argv)
    if args.keys < 1 or any(n < 256 for n in args.lengths):
        parser.error(f"need --keys >= 1 and lengths >= 256, got keys={args.keys}, lengths={args.lengths}")
    from flashcodec_fx.pretrained import load_pretrained

    torch.set_num_threads(args.threads)
    model, tokenizer = load_pretrained(dtype=torch.float32)
    keys = random.Random(0).sample(range(10_000, 100_000), args.keys)
    start = time.perf_counter()
    rows = run(model, tokenizer, tiers(args.presets), tuple(args.lengths), keys)
    result = {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "depths": list(DEPTHS), "keys": keys,
              "answer_tokens": ANSWER_TOKENS, "method": __doc__.split("\n\n")[1], "rows": rows,
              "summary": summary(rows), "total_seconds": time.perf_counter() - start}
    for s in result["summary"]:
        print(f"  {s['tier']:24s} {s['length']:6d} tokens: {s['retrieved']}/{s['trials']} retrieved"
              f"{'' if s['matches_raw'] else '  (misses a key the raw cache retrieves)'}")
    path = write_result("passkey", result, out=args.out)
    print(f"wrote {path} and {plot(result, path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
