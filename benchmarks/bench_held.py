"""Bytes a preset's layer holds next to a DynamicCache's, at every length (the raw prefix: never more, lossy presets).

    python benchmarks/bench_held.py                     # every preset, bf16 and fp32, lengths 1..2048 -> results/held.json

One layer of SmolLM2-135M's shape (3 KV heads, head_dim 64, batch 1; every layer of a preset holds the same, up to its
rotation seed), dynamic layout, attention on the stored form (no memo). Two ways to reach each length: a prefill of
that many tokens, and one-token decode steps from a one-token prompt. ``held`` is ``storage_bytes()`` (every byte the
layer's tensors hold: allocated capacity, raw sinks and tail, the mean, the two 0-dim lengths, or the tokens a
stream holds raw before its codec state fits in their bytes); a DynamicCache holds ``2 * H * L * D`` values in the
dtype. Reported per preset and dtype: each stream's raw prefix length (flashcodec_fx/raw_prefix.py), the largest
ratio, the longest length where the layer holds more, and the bytes by which it does there.
"""

from __future__ import annotations

import argparse

import torch
from common import write_result

from flashcodec_fx import PRESETS
from flashcodec_fx.cache import CodecKVCache
from flashcodec_fx.presets import preset_codecs
from flashcodec_fx.raw_prefix import prefix_length

HEADS, HEAD_DIM = 3, 64  # SmolLM2-135M's KV heads and head_dim
PREFILLS = (*range(1, 257), *range(272, 2049, 16))  # every short length, then every 16th


def raw_bytes(length: int, dtype: torch.dtype) -> int:
    """What a DynamicCache layer holds for ``length`` tokens: K and V, ``(1, H, L, D)`` each."""
    return 2 * HEADS * length * HEAD_DIM * torch.empty((), dtype=dtype).element_size()


def sweep(preset: str, dtype: torch.dtype, longest: int) -> dict:
    key, value = preset_codecs(preset, layer_idx=1)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(1, HEADS, longest, HEAD_DIM, generator=gen).to(dtype)
    held = {"prefill": {}, "decode": {}}
    for n in (n for n in PREFILLS if n <= longest):
        cache = CodecKVCache(key, value)
        cache.append(tokens[:, :, :n], tokens[:, :, :n])
        held["prefill"][n] = cache.storage_bytes()
    cache = CodecKVCache(key, value)
    for n in range(1, longest + 1):
        cache.append(tokens[:, :, n - 1: n], tokens[:, :, n - 1: n])
        held["decode"][n] = cache.storage_bytes()
    row = {"preset": preset, "dtype": str(dtype).split(".")[1],
           "prefix_length": [prefix_length(codec, HEAD_DIM, dtype) for codec in (key, value)]}
    for way, by_length in held.items():
        over = {n: b - raw_bytes(n, dtype) for n, b in by_length.items() if b > raw_bytes(n, dtype)}
        ratios = {n: b / raw_bytes(n, dtype) for n, b in by_length.items()}
        row[way] = {"max_ratio": max(ratios.values()), "at": max(ratios, key=ratios.get),
                    "lengths_over": len(over), "longest_over": max(over, default=0),
                    "excess_bytes_there": over[max(over)] if over else 0,
                    "ratio_at_2048": ratios.get(longest)}
    print(f"{preset:8} {row['dtype']:8} prefill: max {row['prefill']['max_ratio']:.2f}x, over raw up to "
          f"{row['prefill']['longest_over']} tokens; decode: max {row['decode']['max_ratio']:.2f}x, over raw up to "
          f"{row['decode']['longest_over']} tokens", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--longest", type=int, default=2048)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = [sweep(p, dtype, args.longest) for p in PRESETS for dtype in (torch.bfloat16, torch.float32)]
    write_result("held", {"heads": HEADS, "head_dim": HEAD_DIM, "longest": args.longest, "rows": rows}, out=args.out)


if __name__ == "__main__":
    main()
