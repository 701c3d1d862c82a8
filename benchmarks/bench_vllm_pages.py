"""The vLLM page format's options under bench_vllm's quality protocol, by fake quantization (one forward pass per tier).

    python benchmarks/bench_vllm_pages.py                                  # every tier -> results/vllm_pages.json
    python benchmarks/bench_vllm_pages.py --presets 3bit --tiers "3bit twin" "3bit ring" --out /tmp/pages.json
    python benchmarks/bench_vllm_pages.py --markdown                        # the table of results/vllm_pages.json

bench_vllm's quality part reads windows through vLLM in chunks of 16 tokens: each chunk attends its own tokens
exactly and everything before it from the pages. This tool computes the same for a whole window at once, per layer
(bench_fakequant's method): a key or value is read exactly where the paged cache holds it raw when the chunk reads
it, and as its code decodes everywhere else. tests/benchmarks/test_bench_vllm_pages.py checks it against the pages'
reference store and attention (``flashcodec_fx.vllm.reference``) run chunk by chunk on a tiny model. ``twin`` tiers
are the ``FlashCodecCache`` twins of bench_vllm's quality part under the same protocol (bench_fakequant's model of
the streaming cache: prefill 16, chunks of 16). A tool for choosing the format; bench_vllm measures it in vLLM.

Tiers (:class:`PageTier`), the preset's per-token codes in every code slot:

- ``layout="head"``: the format before issue 33, the first ``A`` tokens of every page raw (anchors).
  ``"ring"``: the format of ``flashcodec_fx.vllm.page`` (its docstring): a sequence's first page keeps its sinks
  raw, every later page its newest tokens (a ring of ``A`` raw rows; its last ``A`` once complete). Same bytes.
- ``center``: keys coded minus a page mean of raw rows (``head``: the page's anchors; ``ring``: the page before's raw
  rows, as ``page.py``); ``normalize``: channel exponents (``codecs.channel_norm``) measured on those same rows.
- ``window``: ``(keys, values)`` newest tokens before a call held raw per request outside the pages, counted as
  stored; ``newest_bits``: the request's newest page held again at that many bits (mid-rise, rotated) outside the
  pages, counted likewise.

Bits per value as stored by one request of the window's length (``PageTier.bits``): its whole pages (bf16 raw rows,
SmolLM2's head_dim 64) and what it holds outside them.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_fakequant import FakeQuant, check_model, register
from common import RESULTS_DIR, write_result
from corpus import STREAMING_TEXTS, leading_tokens, load_tokens, windows

from flashcodec_fx.codecs import JPEGCodec
from flashcodec_fx.codecs.channel_norm import channel_exponents, channel_factors
from flashcodec_fx.config import cache_config
from flashcodec_fx.evaluate import token_kl, token_nll
from flashcodec_fx.presets import TRELLIS_PRESETS
from flashcodec_fx.vllm.page import PageFormat, page_format

CHUNK = 16  # bench_vllm's quality protocol: max_num_batched_tokens=16, scored from position 16
HEAD_DIM, STORED = 64, torch.bfloat16  # bits as a bf16 SmolLM2 page stores them
LOSSY = ("4bit", "3bit", "2.5bit", "2bit")
LAYOUTS = ("head", "ring")


@dataclass(frozen=True)
class PageTier:
    """A page format for preset ``preset`` (module docstring), or a ``FlashCodecCache`` twin (``twin``: its options;
    the page fields unused)."""

    name: str
    preset: str
    block_size: int = 128
    anchors: int | None = None  # None: the preset's sinks
    layout: str = "head"
    center: bool = False
    normalize: bool = False
    window: tuple[int, int] = (0, 0)
    newest_bits: int | None = None
    twin: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    def format(self, layer_idx: int, head_dim: int = HEAD_DIM, dtype: torch.dtype = STORED) -> PageFormat:
        """The page's codes (centering is this tool's own, ``center``)."""
        return page_format(self.preset, layer_idx, head_dim, dtype, self.anchors)

    def bits(self, length: int) -> float:
        """Bits per value as stored by one request of ``length`` tokens: its whole pages, its raw window and its
        newest page held outside them."""
        fmt = self.format(0)
        total = 8 * -(-length // self.block_size) * self.block_size * fmt.state_content_bytes(self.block_size)
        total += 16 * HEAD_DIM * sum(self.window)
        if self.newest_bits is not None:
            slot = _newest_codec(self.newest_bits).quantizer.row_bytes(HEAD_DIM) + 2  # codes, fp16 scale
            total += 8 * self.block_size * 2 * slot
        return total / (2 * HEAD_DIM * length)


def _newest_codec(bits: int) -> JPEGCodec:
    return JPEGCodec(block_size=1, quant_bits=bits, levels="midrise", scale_axis="token", rotate=0)


def _side_rows(tier: PageTier, pages: torch.Tensor, a: int) -> torch.Tensor:
    """``(B, H, P, bs, D)`` pages -> the raw rows page ``p``'s mean and exponents are measured on, ``(B, H, P, a,
    D)``: ``head``, its anchors; ``ring``, the page before's raw rows (page 0's are its sinks; page 0 uses its own)."""
    if tier.layout == "head":
        return pages[:, :, :, :a]
    raw = torch.cat([pages[:, :, :1, :a], pages[:, :, 1:, -a:]], dim=2)  # each page's raw rows once complete
    return torch.cat([raw[:, :, :1], raw[:, :, :-1]], dim=2)


def paged_values(tier: PageTier, codec: JPEGCodec, x: torch.Tensor, key: bool) -> torch.Tensor:
    """``x (B, H, L, D)`` as the page's code slots give it back (fp32): per-page side information from raw rows (a
    mean for the keys only)."""
    b, h, length, d = x.shape
    bs = tier.block_size
    a = tier.format(0, d).raw_rows(bs)
    count = -(-length // bs)
    pages = torch.cat([x.float(), x.new_zeros(b, h, count * bs - length, d).float()], 2).view(b, h, count, bs, d)
    side = _side_rows(tier, pages, a) if tier.center or tier.normalize else None
    n = torch.ones(b, h, count, 1, d)
    if tier.normalize:
        n = channel_factors(channel_exponents(side, torch.ones(a, dtype=torch.bool)))[:, :, :, None]
    mean = (side / n).mean(3, keepdim=True) if key and tier.center else torch.zeros_like(n)
    body = (pages / n - mean).reshape(b, h, count * bs, d)
    decoded = codec.decode(codec.encode(body), torch.float32).view(b, h, count, bs, d)
    return ((decoded + mean) * n).reshape(b, h, count * bs, d)[:, :, :length]


def raw_reads(tier: PageTier, length: int, stream: int, chunk: int, head_dim: int = HEAD_DIM) -> torch.Tensor:
    """``(L, L)`` bool: query ``i`` (in the call of positions ``[s, e)``, calls of ``chunk``) reads position ``j``
    exactly: its call's own tokens, the raw rows holding ``j`` when that call reads (after its store, before its
    ring writes), the raw window."""
    bs, a = tier.block_size, tier.format(0, head_dim).raw_rows(tier.block_size)
    pos = torch.arange(length)
    start = (pos // chunk * chunk)[:, None]
    end = (start + chunk).clamp_max(length)
    j = pos[None, :]
    page, offset = j // bs, j % bs
    exact = (j >= start) | (j >= start - tier.window[stream])
    if tier.layout == "head":
        return exact | (offset < a)
    complete = (page + 1) * bs <= end
    newest = page == (start - 1).clamp_min(0) // bs
    ring = ((page == 0) & (offset < a)) | ((page > 0) & complete & (offset >= bs - a))
    return exact | ring | ((page > 0) & ~complete & newest & (j >= start - a))


def newest_reads(tier: PageTier, length: int, chunk: int) -> torch.Tensor:
    """``(L, L)`` bool: ``j`` lies in the page of query ``i``'s newest history token."""
    pos = torch.arange(length)
    start = pos // chunk * chunk
    return (pos[None, :] // tier.block_size) == ((start - 1).clamp_min(0) // tier.block_size)[:, None]


class FakePages:
    """The attention function: SDPA where each key and value is read as the paged cache gives it back."""

    def __init__(self, tier: PageTier, chunk: int = CHUNK):
        self.tier, self.chunk = tier, chunk

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        b, hq, length, d = query.shape
        groups = hq // key.shape[1]
        fmt = self.tier.format(module.layer_idx, d)
        q = query.float()
        scale = scaling if scaling is not None else 1 / math.sqrt(d)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        reads = []
        for stream, (x, codec) in enumerate(zip((key, value), (fmt.key, fmt.value), strict=True)):
            exact = raw_reads(self.tier, length, stream, self.chunk, d)
            sources = [(exact, x.float())]
            if self.tier.newest_bits is not None:
                newest = newest_reads(self.tier, length, self.chunk) & ~exact
                alt = _newest_codec(self.tier.newest_bits)
                sources.append((newest, alt.decode(alt.encode(x.float()), torch.float32)))
                exact = exact | newest
            sources.append((~exact, paged_values(self.tier, codec, x, key=stream == 0)))
            reads.append([(m, y.repeat_interleave(groups, 1)) for m, y in sources])
        scores = sum(m * (q @ k.transpose(-1, -2)) for m, k in reads[0]) * scale
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = sum((p * m) @ v for m, v in reads[1])
        return out.transpose(1, 2).contiguous().to(query.dtype), None


@torch.no_grad()
def logprobs(model: Any, ids: torch.Tensor, function: Any, chunk: int = CHUNK) -> torch.Tensor:
    """``(B, L - chunk, V)`` fp32 log-probs of the scored tokens (targets ``chunk .. L - 1``) with attention
    ``function`` (FakePages, or bench_fakequant's FakeQuant)."""
    register(function)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kv_fakequant")  # the name bench_fakequant.register gives the function
    try:
        logits = model(input_ids=ids, use_cache=False).logits[:, chunk - 1: -1]
    finally:
        model.set_attn_implementation(previous)
    return torch.log_softmax(logits.float(), dim=-1)


def tier_rows(model: Any, ids: torch.Tensor, tiers: list[PageTier]) -> list[dict[str, Any]]:
    """One row per tier (raw first): KL vs raw per scored token, ppl and its increase over raw, bits as stored."""
    check_model(model)
    ref = logprobs(model, ids, FakeQuant(None, CHUNK, CHUNK))
    targets = ids[:, CHUNK:]
    raw_ppl = math.exp(float(token_nll(ref, targets).mean()))
    rows = [{"tier": "raw", "ppl": raw_ppl, "kl": 0.0, "delta_ppl": 0.0, "bits": 16.0}]
    for tier in tiers:
        start = time.perf_counter()
        if tier.twin is not None:
            got, bits = logprobs(model, ids, FakeQuant(cache_config(**tier.twin), CHUNK, CHUNK)), None
        else:
            got, bits = logprobs(model, ids, FakePages(tier)), tier.bits(ids.shape[1])
        ppl = math.exp(float(token_nll(got, targets).mean()))
        kl = token_kl(ref, got).double()
        rows.append({"tier": tier.name, **{k: v for k, v in asdict(tier).items() if k != "name"}, "bits": bits,
                     "kl": float(kl.mean()), "kl_per_window": kl.mean(1).tolist(), "ppl": ppl,
                     "delta_ppl": ppl - raw_ppl, "seconds": time.perf_counter() - start})
        print(f"{tier.name:45s} bits {'-' if bits is None else f'{bits:.3f}':>6} KL {rows[-1]['kl']:.4f} "
              f"dppl {ppl - raw_ppl:+.3f}", flush=True)
    return rows


def default_tiers(presets: list[str]) -> list[PageTier]:
    """Per preset: its twin, the format before issue 33 and each option on it, the ring format alone and centered
    (what ``page.py`` stores)."""
    tiers = []
    for p in presets:
        tiers += [
            PageTier(f"{p} twin", p, twin={"preset": p}),
            PageTier(f"{p} anchors", p),
            PageTier(f"{p} anchors, centered", p, center=True),
            PageTier(f"{p} anchors, exponents", p, normalize=True),
            PageTier(f"{p} anchors, raw window 8", p, window=(8, 8)),
            PageTier(f"{p} anchors, newest page 8-bit", p, newest_bits=8),
            PageTier(f"{p} ring", p, layout="ring"),
            PageTier(f"{p} ring, centered", p, layout="ring", center=True),
        ]
    return tiers


COLUMNS = [("tier", "tier", "s"), ("bits", "bits", ".2f"), ("KL vs raw", "kl", ".2e"), ("ppl", "ppl", ".3f"),
           ("Δppl", "delta_ppl", "+.3f")]


def markdown(result: dict[str, Any]) -> str:
    """The rows as a table (twins' bits: '-', they are FlashCodecCache's, not a page's)."""
    from flashcodec_fx.evaluate import markdown_table

    return markdown_table(result["rows"], COLUMNS)


def main(argv: list[str] | None = None) -> None:
    from flashcodec_fx.pretrained import DEFAULT_MODEL, load_pretrained

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(LOSSY), choices=(*LOSSY, *TRELLIS_PRESETS),
                        help="default: the scalar presets; a trellis twin (NAME-tcq) runs the same tiers")
    parser.add_argument("--tiers", nargs="*", default=None, help="tier names to run (default: every one)")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--window-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="default results/vllm_pages.json")
    parser.add_argument("--markdown", action="store_true", help="print the table of --out (or results/vllm_pages.json)")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads((args.out or RESULTS_DIR / "vllm_pages.json").read_text())))
        return
    tiers = default_tiers(args.presets)
    if args.tiers is not None:
        tiers = [t for t in tiers if t.name in args.tiers]
    torch.set_num_threads(args.threads)
    model, tokenizer = load_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    ids = windows(load_tokens(tokenizer, STREAMING_TEXTS), args.windows, args.window_tokens, leading_tokens(tokenizer))
    start = time.perf_counter()
    rows = tier_rows(model, ids, tiers)
    print(markdown({"rows": rows}))
    payload = {"model": DEFAULT_MODEL, "dtype": "float32",
               "protocol": {"windows": args.windows, "window_tokens": args.window_tokens, "chunk": CHUNK,
                            "scored_from": CHUNK, "texts": list(STREAMING_TEXTS)},
               "method": "fake quantization of bench_vllm's quality protocol, one forward pass per tier (module "
                         "docstring); KL(raw || tier) per scored token",
               "total_seconds": time.perf_counter() - start, "rows": rows}
    print(f"wrote {write_result('vllm_pages', payload, out=args.out or RESULTS_DIR / 'vllm_pages.json')}")


if __name__ == "__main__":
    main()
