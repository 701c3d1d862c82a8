"""bench_ppl's streaming protocol in one forward pass per tier (fake quantization): a fast way to choose recipes.

    python benchmarks/bench_fakequant.py --tiers 3bit 2.5bit                  # presets, SmolLM2, 2 x 1024 tokens
    python benchmarks/bench_fakequant.py --bits --tier-file benchmarks/data/fakequant_search.json \
        --out benchmarks/results/fakequant_search.json                        # the recipe ideas of docs/quantization.md

What the streaming protocol's cache does, computed for the whole window at once, per layer: each stream's tokens are
stored as the tier's codecs store them (the package's own encode and decode, with the mean and the channel exponents
the first call past the sinks sets: the prefill's), and a query reads a key or value exactly where the cache keeps it
exactly (a sink, a token of its own call, the raw tail after its call's append: ``ops.state.advance``), its coded
value everywhere else. So one forward pass per tier replaces the 57 calls of a window, 10-30x faster than bench_ppl;
the KL agrees with bench_ppl's (tests/benchmarks/test_bench_fakequant.py: within 5% on a tiny model; SmolLM2's
presets, 6 x 1k, results/fakequant_presets.json against ppl.json: within 1%, `int8` 3%): codes can differ at rounding
ties, as a group encoded in another call shape may. A tool for choosing recipes: bench_ppl (the real cache, bits as
stored) measures what the README shows.

Full-attention models only (a sliding-window layer's ring is not modelled; Gemma 3 is refused); any codec (its own
encode and decode: block sizes, quantizers, rotation, center, normalize, sinks, window) and per-layer options. Output: KL vs
the raw cache per scored token (mean, and per window), ppl; ``results/fakequant_experiment.json`` unless ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from common import RESULTS_DIR, write_result
from corpus import KINDS, kind_texts, leading_tokens, load_tokens, windows

from flashcodec_fx.codecs import Codec
from flashcodec_fx.codecs.channel_norm import channel_exponents, channel_factors
from flashcodec_fx.config import cache_config
from flashcodec_fx.evaluate import token_kl, token_nll
from flashcodec_fx.ops.state import advance

IMPLEMENTATION = "kv_fakequant"  # (a name with "flash" in it would be taken for a flash-attention kernel)
MODELS = {"smollm2": "SmolLM2-135M-Instruct"}


def exact_reads(codec: Codec, length: int, prefill: int, chunk: int) -> torch.Tensor:
    """``(L, L)`` bool: query ``i`` reads position ``j`` exactly (a sink, its own call, or the raw tail its call's
    append leaves), else from its code. Calls: the prefill ``[0, prefill)``, then chunks of ``chunk``."""
    pos = torch.arange(length)
    streamed = (pos - prefill).clamp_min(0) // chunk
    call_start = torch.where(pos < prefill, torch.zeros_like(pos), prefill + streamed * chunk)
    call_end = torch.where(pos < prefill, torch.full_like(pos, prefill), prefill + (streamed + 1) * chunk).clamp(
        max=length)
    archive_end = advance(codec, torch.full_like(pos, codec.sinks), call_end)
    j = pos[None, :]
    return (j < codec.sinks) | (j >= call_start[:, None]) | (j >= archive_end[:, None])


def own_calls(length: int, prefill: int, chunk: int) -> torch.Tensor:
    """``(L, L)`` bool: query ``i`` and position ``j`` belong to one call (the prefill, then chunks of ``chunk``)."""
    pos = torch.arange(length)
    call = torch.where(pos < prefill, torch.zeros_like(pos), 1 + (pos - prefill).clamp_min(0) // chunk)
    return call[:, None] == call[None, :]


def stored_tokens(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """``x (B, H, L, D)`` as a stream of ``codec`` takes them in: rounded to its raw rows' dtype (an fp32 stream of a
    quantized codec keeps bf16 raw rows: ``Codec.resolved``), the dtype of ``x`` kept."""
    raw = codec.resolved(x.dtype).raw_rows_dtype(x.dtype)
    return x if raw == x.dtype else x.to(raw).to(x.dtype)


def coded(codec: Codec, x: torch.Tensor, prefill: int) -> torch.Tensor:
    """``x (B, H, L, D)`` as the stream's codes give it back (fp32; positions past the sinks), the mean and channel
    exponents taken from the prefill (the first call past the sinks)."""
    measured = torch.arange(prefill) >= codec.sinks
    n = channel_factors(channel_exponents(x[:, :, :prefill], measured))[:, :, None] if codec.normalize else None
    stored = x.float() if n is None else x.float() / n
    mean = stored[:, :, codec.sinks: prefill].mean(2) if codec.center else None
    body = stored[:, :, codec.sinks:]
    pad = -body.shape[2] % codec.group  # the open group: never read from codes (the tail holds it)
    body = torch.cat([body, body.new_zeros(*body.shape[:2], pad, body.shape[3])], 2)
    decoded = codec.decode(codec.encode(body, mean), torch.float32, mean)[:, :, : x.shape[2] - codec.sinks]
    out = torch.cat([stored[:, :, : codec.sinks], decoded], 2)
    return out if n is None else out * n


class FakeQuant:
    """The attention function: SDPA where every key and value a query reads from codes is its coded value, and every
    one it reads from raw rows outside its own call is the token as stored (:func:`stored_tokens`)."""

    def __init__(self, config: Any, prefill: int, chunk: int):
        self.config, self.prefill, self.chunk = config, prefill, chunk

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        b, hq, length, d = query.shape
        groups = hq // key.shape[1]
        q = query.float()
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        parts = []
        layer = None if self.config is None else self.config.layer(module.layer_idx)
        if layer is None:  # the raw cache, or a layer kept native
            exact = [torch.ones(length, length, dtype=torch.bool)] * 2
            stored = [key.float(), value.float()]
            raw = [key, value]
        else:
            codecs = layer.build(module.layer_idx)
            exact = [exact_reads(c, length, self.prefill, self.chunk) for c in codecs]
            raw = [stored_tokens(c, x) for c, x in zip(codecs, (key, value), strict=True)]
            stored = [coded(c, x, self.prefill) for c, x in zip(codecs, raw, strict=True)]
        for x, r, y in zip((key, value), raw, stored, strict=True):
            parts.append([t.float().repeat_interleave(groups, 1) for t in (x, r)] + [y.repeat_interleave(groups, 1)])
        (k, k_raw, k_coded), (v, v_raw, v_coded) = parts
        own = own_calls(length, self.prefill, self.chunk)
        scale = scaling if scaling is not None else 1 / math.sqrt(d)
        scores = torch.where(exact[0], q @ k.transpose(-1, -2), q @ k_coded.transpose(-1, -2))
        if raw[0] is not key:  # raw rows outside the query's own call hold the rounded tokens
            scores = torch.where(exact[0] & ~own, q @ k_raw.transpose(-1, -2), scores)
        p = (scores * scale).masked_fill(~causal, float("-inf")).softmax(-1)
        if raw[1] is value:
            out = (p * exact[1]) @ v + (p * ~exact[1]) @ v_coded
        else:
            out = (p * (exact[1] & own)) @ v + (p * (exact[1] & ~own)) @ v_raw + (p * ~exact[1]) @ v_coded
        return out.transpose(1, 2).contiguous().to(query.dtype), None


def register(function: FakeQuant) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, function)


@torch.no_grad()
def logprobs(model: Any, ids: torch.Tensor, config: Any, prefill: int, chunk: int) -> torch.Tensor:
    """``(B, L - prefill, V)`` fp32 log-probs of the scored tokens (targets ``prefill .. L - 1``)."""
    register(FakeQuant(config, prefill, chunk))
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    try:
        logits = model(input_ids=ids, use_cache=False).logits[:, prefill - 1: -1]
    finally:
        model.set_attn_implementation(previous)
    return torch.log_softmax(logits.float(), dim=-1)


def check_model(model: Any) -> None:
    text = model.config.get_text_config(decoder=True)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(text, "sliding_window", None):
        raise ValueError(f"bench_fakequant models full-attention layers only, got layer types {sorted(kinds)}")


def tier_kl(model: Any, ids: torch.Tensor, tiers: list[dict[str, Any]], prefill: int, chunk: int) -> list[dict]:
    """One row per tier (``{"name", "options"}``): mean KL vs raw per scored token, per window, and ppl."""
    check_model(model)
    ref = logprobs(model, ids, None, prefill, chunk)
    targets = ids[:, prefill:]
    rows = []
    for tier in tiers:
        start = time.perf_counter()
        got = logprobs(model, ids, cache_config(**tier["options"]), prefill, chunk)
        kl = token_kl(ref, got).double()
        rows.append({"tier": tier["name"], "options": tier["options"], "kl": float(kl.mean()),
                     "kl_per_window": kl.mean(1).tolist(), "ppl": math.exp(float(token_nll(got, targets).mean())),
                     "seconds": time.perf_counter() - start})
    return rows


def tiers_from(args: argparse.Namespace) -> list[dict[str, Any]]:
    tiers = [{"name": f"preset {name}", "options": {"preset": name}} for name in args.tiers]
    for text in args.tier_json:
        tiers.append(json.loads(text))
    if args.tier_file is not None:
        tiers += json.loads(args.tier_file.read_text())
    for tier in tiers:
        if not isinstance(tier, dict) or not isinstance(tier.get("name"), str) or not isinstance(tier.get("options"), dict):
            raise ValueError(f'a tier must look like {{"name": "...", "options": {{...}}}}, got {tier!r}')
    return tiers


def main(argv: list[str] | None = None) -> None:
    from flashcodec_fx.evaluate import markdown_table
    from flashcodec_fx.pretrained import load_pretrained

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--windows", type=int, default=2, help="windows of real text (default 2)")
    parser.add_argument("--window-tokens", type=int, default=1024)
    parser.add_argument("--prefill", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--texts", nargs="+", choices=sorted(KINDS), default=["prose"])
    parser.add_argument("--tiers", nargs="*", default=[], metavar="PRESET", help="presets to run")
    parser.add_argument("--tier-json", action="append", default=[], metavar="JSON",
                        help='a tier: \'{"name": ..., "options": {FlashCodecCache options}}\' (repeatable)')
    parser.add_argument("--tier-file", type=Path, default=None, metavar="JSON", help="a JSON list of tiers")
    parser.add_argument("--bits", action="store_true", help="also count each tier's bits as stored (bench_ppl's "
                        "bits_end / bits_worst, on a bf16 replica: about a minute per tier)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON path (default results/fakequant_experiment.json)")
    args = parser.parse_args(argv)
    try:
        tiers = tiers_from(args)
    except (ValueError, json.JSONDecodeError) as err:
        parser.error(str(err))
    if not tiers:
        parser.error("name at least one tier (--tiers, --tier-json, --tier-file)")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_pretrained(MODELS[args.model], dtype=torch.float32)
    ids = windows(load_tokens(tokenizer, kind_texts(args.texts)), args.windows, args.window_tokens,
                  leading_tokens(tokenizer))
    start = time.perf_counter()
    rows = tier_kl(model, ids, tiers, args.prefill, args.chunk)
    if args.bits:
        import bench_ppl

        from flashcodec_fx.evaluate import Tier

        for row in rows:
            row.update(bench_ppl.stored_bits(model, Tier(row["tier"], row["options"]), args.windows,
                                             args.window_tokens, args.prefill, args.chunk))
    print(markdown_table(rows, [("tier", "tier", "s"), ("bits end", "bits_end", ".2f"),
                                ("bits worst", "bits_worst", ".2f"), ("KL vs raw", "kl", ".3e"), ("ppl", "ppl", ".3f"),
                                ("seconds", "seconds", ".1f")]))
    payload = {"model": MODELS[args.model], "dtype": "float32",
               "protocol": {"windows": args.windows, "window_tokens": args.window_tokens, "prefill": args.prefill,
                            "chunk": args.chunk, "texts": args.texts},
               "method": "fake quantization of bench_ppl's streaming protocol, one forward pass per tier (module "
                         "docstring); KL(raw || tier) per scored token, mean over all",
               "total_seconds": time.perf_counter() - start, "rows": rows}
    out = Path(args.out) if args.out else RESULTS_DIR / "fakequant_experiment.json"
    print(f"wrote {write_result('fakequant', payload, out=out)}")


if __name__ == "__main__":
    main()
