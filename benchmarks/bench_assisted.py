"""Speculative decoding with each preset on SmolLM2-135M: how far assisted / prompt-lookup tokens follow the same
preset's unassisted greedy tokens (and the plain model's), and the draft acceptance.

    python benchmarks/bench_assisted.py                  # fp32 and bf16, 3 chat prompts, 48 new tokens: ~10 min CPU
    python benchmarks/bench_assisted.py --dtype float32 --new-tokens 16   # a quick look

Per preset and dtype, greedy decoding three ways on each prompt: unassisted; prompt lookup
(``prompt_lookup_num_tokens=10``, transformers' default draft); assisted by the same model with the same preset on
its own cache (the assistant's drafts are crops on both caches). Reported: ``match`` (mean fraction of positions
equal to the unassisted tokens of the same preset), ``prefix`` (mean new tokens before the first difference),
``plain_match`` (fraction equal to the uncompressed model's greedy tokens). A draft's tokens attend to each other
exactly within the verification call, which single-token decoding reads from the window or the codes, so lossy
presets can differ; ``lossless`` must match exactly. Output: ``results/assisted.json``.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import write_result

import flashcodec_fx as fx
from flashcodec_fx.pretrained import load_pretrained

PROMPTS = ("Explain why the sky is blue in two sentences.", "Write a short poem about a lake at dawn.",
           "Summarize the plot of Romeo and Juliet in three sentences.")
MODES = {"unassisted": {}, "prompt lookup": {"prompt_lookup_num_tokens": 10}, "assisted (self)": "self"}


def _ids(tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


def _generate(model, ids, new: int, preset: str | None, mode) -> tuple[torch.Tensor, float]:
    kwargs = dict(assistant_model=model) if mode == "self" else dict(mode)
    if preset is not None:
        fx.apply_flash_codec(model, preset=preset)
    try:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
        return out[0, ids.shape[1]:], time.perf_counter() - start
    finally:
        if preset is not None:
            fx.remove_flash_codec(model)


def _agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    same = (a == b).long()
    prefix = int(same.cumprod(0).sum())
    return float(same.float().mean()), prefix


def run(dtype: torch.dtype, new: int) -> list[dict]:
    model, tokenizer = load_pretrained(dtype=dtype)
    prompts = [_ids(tokenizer, text) for text in PROMPTS]
    plain = [_generate(model, ids, new, None, {})[0] for ids in prompts]
    rows = []
    for preset in fx.PRESETS:
        reference = None
        for mode, kwargs in MODES.items():
            tokens, seconds = zip(*(_generate(model, ids, new, preset, kwargs) for ids in prompts), strict=True)
            if reference is None:
                reference = tokens
            match = [_agreement(t, r) for t, r in zip(tokens, reference, strict=True)]
            plain_match = [_agreement(t, p)[0] for t, p in zip(tokens, plain, strict=True)]
            rows.append({"dtype": str(dtype).split(".")[1], "preset": preset, "mode": mode,
                         "match": sum(m for m, _ in match) / len(match), "prefix": sum(p for _, p in match) / len(match),
                         "plain_match": sum(plain_match) / len(plain_match), "seconds": sum(seconds),
                         "tokens": [t.tolist() for t in tokens]})
            print(f"{rows[-1]['dtype']:9} {preset:8} {mode:16} match {rows[-1]['match']:.3f} prefix "
                  f"{rows[-1]['prefix']:5.1f} plain {rows[-1]['plain_match']:.3f} {sum(seconds):6.1f} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"), default=None)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = args.dtype or ["float32", "bfloat16"]
    rows = [row for name in dtypes for row in run(getattr(torch, name), args.new_tokens)]
    path = write_result("assisted", {"model": "SmolLM2-135M-Instruct", "new_tokens": args.new_tokens,
                                     "prompts": list(PROMPTS), "modes": {k: str(v) for k, v in MODES.items()},
                                     "rows": rows}, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
