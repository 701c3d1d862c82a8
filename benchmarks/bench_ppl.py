"""Perplexity per KV tier on a local corpus (benchmarks/data/corpus.txt), every layer compressed.

    python benchmarks/bench_ppl.py [--quick] [--out FILE]

Method: the corpus is tokenized and cut into windows of ``prefix + target`` tokens spread evenly over it. For every
tier, all windows run as one batch: the prefix goes through prefill (exact: it attends on its own uncompressed
states), then the target tokens are fed one by one through the cache, so every target prediction after the first
reads the stored (compressed) prefix and earlier targets. Reported per tier: perplexity of the target tokens, its
delta vs the raw cache, the mean KL(raw || tier) of next-token distributions, and the KV bytes kept at the end
(vs raw, and in bits per cached value). Peers: transformers' ``QuantizedCache`` (quanto backend; hqq when importable)
and a KIVI-like 2/4-bit fake-quant cache (quality only; its bytes are computed from the format, see ``kivi_like``).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch
from common import write_result
from transformers.cache_utils import Cache, DynamicLayer

from flashcodec_fx.evaluate import Tier, cache_bytes, make_cache, markdown_table, mean_kl, nll, teacher_forced

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "data" / "corpus.txt"
KIVI_GROUP = 32
COLUMNS = [("tier", "tier", "s"), ("KV bytes", "kv_bytes", ",d"), ("vs raw", "kv_ratio", ".3f"),
           ("bits/value", "bits_per_value", ".2f"), ("ppl", "ppl", ".3f"), ("Δppl", "delta_ppl", "+.3f"),
           ("KL vs raw", "kl", ".2e"), ("seconds", "seconds", ".1f")]


def _fake_quant(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min-max quantize-dequantize of ``x`` with one (fp16 scale, fp16 minimum) per slice along ``dim``."""
    low, high = x.amin(dim, keepdim=True).half().float(), x.amax(dim, keepdim=True)
    scale = ((high - low) / ((1 << bits) - 1)).half().float().clamp_min(torch.finfo(torch.float16).tiny)
    return (torch.round((x - low) / scale).clamp(0, (1 << bits) - 1) * scale + low).to(x.dtype)


class KiviLikeLayer(DynamicLayer):
    """KIVI-style fake quantization (quality only): every complete group of ``KIVI_GROUP`` tokens is quantized once,
    keys per channel over the group's tokens, values per token over groups of ``KIVI_GROUP`` channels; the open
    group stays raw. Stores the dequantized values; :meth:`storage_breakdown` counts what the real format would keep."""

    def __init__(self, bits: int):
        super().__init__()
        self.bits, self.quantized = bits, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        first = not self.is_initialized
        super().update(key_states, value_states, *args, **kwargs)
        b, h, n, d = self.keys.shape
        full = n // KIVI_GROUP * KIVI_GROUP
        if full > self.quantized:
            k = self.keys[:, :, self.quantized: full].reshape(b, h, -1, KIVI_GROUP, d)
            v = self.values[:, :, self.quantized: full].reshape(b, h, -1, d // KIVI_GROUP, KIVI_GROUP)
            self.keys[:, :, self.quantized: full] = _fake_quant(k, self.bits, 3).reshape(b, h, -1, d)
            self.values[:, :, self.quantized: full] = _fake_quant(v, self.bits, 4).reshape(b, h, -1, d)
            self.quantized = full
        return (key_states, value_states) if first else (self.keys, self.values)

    def storage_breakdown(self) -> dict[str, int]:
        b, h, n, d = self.keys.shape
        codes = 2 * b * h * self.quantized * d * self.bits // 8
        params = 2 * 2 * 2 * b * h * self.quantized * d // KIVI_GROUP  # (scale, min) fp16 per group, keys and values
        tail = 2 * b * h * (n - self.quantized) * d * self.keys.element_size()
        return {"archive_used": codes + params, "tail": tail, "total": codes + params + tail}


class KiviLikeCache(Cache):
    """A cache of :class:`KiviLikeLayer` (full-attention models; head_dim a multiple of ``KIVI_GROUP``)."""

    def __init__(self, config: Any, bits: int):
        text = config.get_text_config(decoder=True)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        if head_dim % KIVI_GROUP:
            raise ValueError(f"KIVI-like cache needs head_dim divisible by {KIVI_GROUP}, got {head_dim}")
        super().__init__(layers=[KiviLikeLayer(bits) for _ in range(text.num_hidden_layers)])

    def storage_breakdown(self) -> dict[str, int]:
        parts = [layer.storage_breakdown() for layer in self.layers if layer.is_initialized]
        return {key: sum(p[key] for p in parts) for key in ("archive_used", "tail", "total")}


def jpeg(block_size: int, keep: int, bits: int | None) -> dict:
    return {"mode": "jpeg", "block_size": block_size, "keep_freqs": keep, "quant_bits": bits}


def codec_tiers() -> list[Tier]:
    """The main job's tiers (without the decode-path variant) plus jpeg K=r int8 at block sizes 16 and 32."""
    return [
        Tier("raw DynamicCache"),
        Tier("png keep=1.0", {"mode": "png", "block_size": 8, "keep_ratio": 1.0}),
        Tier("jpeg r=8 K=8", jpeg(8, 8, None)),
        Tier("jpeg r=8 K=8 int8", jpeg(8, 8, 8)),
        Tier("jpeg r=16 K=16 int8", jpeg(16, 16, 8)),
        Tier("jpeg r=32 K=32 int8", jpeg(32, 32, 8)),
        Tier("jpeg r=8 K=4 int8", jpeg(8, 4, 8)),
        Tier("jpeg r=8 K=2 int8", jpeg(8, 2, 8)),
    ]


def _quantized_cache_tier(backend: str, nbits: int) -> Tier:
    def factory(model: Any) -> Any:
        from transformers import QuantizedCache

        return QuantizedCache(backend, model.config, nbits=nbits)

    return Tier(f"HF QuantizedCache {backend} int{nbits}", factory=factory,
                note="transformers defaults: q_group_size=64, residual_length=128 raw recent tokens, axis 0")


def peer_tiers(model: Any) -> tuple[list[Tier], list[dict]]:
    """Peers that can run here, and the ones skipped with the reason (probed by building one cache: a backend is
    imported on construction)."""
    tiers, skipped = [], []
    for backend in ("quanto", "hqq"):
        for nbits in (4, 2):
            tier = _quantized_cache_tier(backend, nbits)
            try:
                make_cache(model, tier)
            except (ImportError, ValueError, RuntimeError) as err:
                skipped.append({"tier": tier.name, "reason": f"{type(err).__name__}: {err}".splitlines()[0]})
                continue
            tiers.append(tier)
    for nbits in (4, 2):
        tiers.append(Tier(f"KIVI-like {nbits}-bit (fake-quant)", factory=lambda m, b=nbits: KiviLikeCache(m.config, b),
                          note="simulated: keys per-channel / values per-token asymmetric, group 32, fp16 scale+zero, "
                               "recent < 32 tokens raw; quality measured, bytes computed from the format"))
    return tiers, skipped


def windows(ids: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """``count`` windows of ``length`` tokens spread evenly over ``ids (N,)`` -> ``(count, length)``."""
    if ids.numel() < length:
        raise ValueError(f"corpus has {ids.numel()} tokens, fewer than one window of {length}")
    starts = torch.linspace(0, ids.numel() - length, count).round().long()
    return torch.stack([ids[s: s + length] for s in starts.tolist()])


def run(model: Any, batch: torch.Tensor, prefix: int, tiers: list[Tier]) -> list[dict]:
    """Teacher-forced scoring of ``batch (B, prefix + T)`` under each tier; the first tier is the raw reference."""
    prefix_ids, target_ids = batch[:, :prefix], batch[:, prefix:]
    rows, reference = [], None
    for tier in tiers:
        cache = make_cache(model, tier)
        start = time.perf_counter()
        logprobs = teacher_forced(model, prefix_ids, target_ids, cache)
        seconds = time.perf_counter() - start
        nbytes = cache_bytes(cache)
        if reference is None:
            reference, raw = logprobs, nbytes["kv"]
        loss = nll(logprobs, target_ids)
        rows.append({"tier": tier.name, "options": None if tier.options is None else dict(tier.options), "note": tier.note,
                     "kv_bytes": nbytes["kv"], "held_bytes": nbytes["held"], "kv_ratio": nbytes["kv"] / raw,
                     "bits_per_value": 8 * nbytes["kv"] / (raw / torch.empty((), dtype=model.dtype).element_size()),
                     "nll": loss, "ppl": math.exp(loss), "kl": mean_kl(reference, logprobs), "seconds": seconds})
        print(f"  {tier.name}: ppl {rows[-1]['ppl']:.3f}  KL {rows[-1]['kl']:.2e}  ({seconds:.0f} s)", flush=True)
    for row in rows:
        row["delta_ppl"] = row["ppl"] - rows[0]["ppl"]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 short windows (smoke run, about a minute)")
    parser.add_argument("--model", default=None, help="model for load_pretrained (default SmolLM2-135M-Instruct)")
    parser.add_argument("--windows", type=int, default=None, help="number of windows (default 4; quick 2)")
    parser.add_argument("--prefix", type=int, default=None, help="prefill tokens per window (default 192; quick 64)")
    parser.add_argument("--target", type=int, default=None, help="teacher-forced tokens per window (default 48; quick 16)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/ppl.json)")
    args = parser.parse_args(argv)
    count = args.windows or (2 if args.quick else 4)
    prefix = args.prefix or (64 if args.quick else 192)
    target = args.target or (16 if args.quick else 48)
    if min(count, prefix, target) < 1:
        parser.error("--windows, --prefix and --target must be >= 1")

    from flashcodec_fx.pretrained import load_pretrained

    model, tokenizer = load_pretrained(args.model, dtype=torch.float32)
    ids = torch.tensor(tokenizer(CORPUS.read_text())["input_ids"], dtype=torch.int64)
    batch = windows(ids, count, prefix + target)
    peers, skipped = peer_tiers(model)
    print(f"corpus {ids.numel()} tokens; {count} windows x ({prefix} prefill + {target} teacher-forced); "
          f"peers skipped: {[s['tier'] for s in skipped] or 'none'}", flush=True)
    rows = run(model, batch, prefix, codec_tiers() + peers)
    print(markdown_table(rows, COLUMNS))
    path = write_result("ppl", {
        "model": args.model or "SmolLM2-135M-Instruct", "dtype": "float32", "corpus": str(CORPUS.relative_to(HERE.parent)),
        "corpus_tokens": ids.numel(), "windows": count, "prefix_tokens": prefix, "target_tokens": target,
        "quick": args.quick,
        "method": "windows batched; prefix prefilled exactly, target teacher-forced token by token through the cache; "
                  "ppl over all target tokens; KL(raw || tier) averaged over target positions; kv_bytes at the end",
        "rows": rows, "skipped_peers": skipped,
    }, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
