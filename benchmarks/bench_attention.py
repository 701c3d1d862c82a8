"""Single-token decode attention of one layer: raw-KV SDPA vs the codec paths, time and bytes read.

One layer, B=1, H_kv=8, H_q=32 (GQA 4), D=128, one query token; bf16 on CUDA, fp32 on CPU. The stored length
is ``S - 3`` tokens in a static archive of ``S / 8`` blocks (so a partial raw tail is attended too). Paths:

- ``sdpa_masked``: raw K/V, ``scaled_dot_product_attention`` with a bool mask and ``enable_gqa`` (whatever
  backend PyTorch picks for a masked single-token decode).
- ``sdpa_flash`` (CUDA): raw K/V, unmasked, the flash backend forced (GQA by ``enable_gqa``).
- ``materialized``: ``flashcodec::read`` of K and V (the full view, Triton on CUDA) + masked SDPA.
- ``coef_torch``: the plain-torch reference ``codec_attention`` (the op's reference implementation, also on CUDA).
- ``coef_triton`` (CUDA): the Triton split-K ``codec_attention``.

Bytes are what a path must move at least: raw paths read K and V; coefficient paths read the stored state
(codes, scales, index, raw tail); the materialized path reads the state, writes the full K/V views and reads
them back. ``GB/s`` = bytes / time; ``roofline`` = that over the device's memory bandwidth (``--peak-gbps``,
4800 for an H200; null on CPU unless given). CUDA times: ``triton.testing.do_bench`` medians (L2 flushed between
runs); CPU: medians of ``--repeats`` wall-clock runs.

    python benchmarks/bench_attention.py            # CUDA if present: S = 4k, 16k, 64k, 128k
    python benchmarks/bench_attention.py --quick    # S = 4k, 16k (CPU: torch paths only, fp32)
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from common import median_time, write_result
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashcodec_fx import make_codec
from flashcodec_fx.ops.attention import codec_attention

B, HKV, HQ, D, R = 1, 8, 32, 128, 8
TIERS = [
    ("jpeg k8 r8", {"block_size": R, "keep_freqs": 8}),
    ("jpeg k2 r8 int8", {"block_size": R, "keep_freqs": 2, "quant_bits": 8}),
    ("jpeg k8 r8 int8", {"block_size": R, "keep_freqs": 8, "quant_bits": 8}),
    ("png r8", {"block_size": R}),
]


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _timer(device: str, repeats: int):
    if device == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3
    return lambda fn: median_time(fn, repeats=repeats, warmup=1)


def _row(path: str, seconds: float | None, nbytes: int, peak_gbps: float | None, **extra) -> dict:
    gbps = None if seconds is None else nbytes / seconds / 1e9
    return {"path": path, "time_us": None if seconds is None else seconds * 1e6, "bytes": nbytes, "gbps": gbps,
            "roofline": None if gbps is None or not peak_gbps else gbps / peak_gbps, **extra}


def _stored(codec, x: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
    b, h, s, d = x.shape
    data, scale, index = codec.empty_state((b, h), s // R, d, x.dtype, x.device)
    tail = torch.zeros(b, h, R, d, dtype=x.dtype, device=x.device)
    n = torch.zeros((), dtype=torch.int64, device=x.device)
    torch.ops.flashcodec.append(data, scale, index, tail, n, x[:, :, :length].contiguous(), codec.spec)
    return data, scale, index, tail, n


def bench_tier(name: str, codec, q, k, v, length: int, valid, time_fn, peak: float | None) -> list[dict]:
    """The three codec paths of one tier (Triton only on CUDA)."""
    (kd, ks, ki, kt, n), (vd, vs, vi, vt, _) = _stored(codec, k, length), _stored(codec, v, length)
    stored = _nbytes(kd, ks, ki, kt, vd, vs, vi, vt)
    args = (q, kd, ks, ki, kt, vd, vs, vi, vt, n, codec.spec, codec.spec)
    extra = {"tier": name, "compression": _nbytes(k, v) / stored}

    def materialized():
        views = [torch.ops.flashcodec.read(*st, n, codec.spec) for st in ((kd, ks, ki, kt), (vd, vs, vi, vt))]
        return F.scaled_dot_product_attention(q, views[0], views[1], attn_mask=valid, enable_gqa=True)

    rows = [_row("materialized", time_fn(materialized), stored + 2 * _nbytes(k, v), peak, **extra),
            # the op's plain-torch reference, called directly so that CUDA does not dispatch to Triton
            _row("coef_torch", time_fn(lambda: codec_attention._init_fn(*args)), stored, peak, **extra)]
    if q.is_cuda:
        from flashcodec_fx.ops.triton_attention import triton_codec_attention

        err = (triton_codec_attention(*args).float() - codec_attention._init_fn(*args).float()).abs().max().item()
        rows.append(_row("coef_triton", time_fn(lambda: triton_codec_attention(*args)), stored, peak,
                         max_abs_diff_vs_torch=err, **extra))
    return rows


def bench_length(s: int, device: str, dtype: torch.dtype, time_fn, peak: float | None) -> list[dict]:
    gen = torch.Generator().manual_seed(s)
    length = s - 3
    k = (torch.randn(B, HKV, s, D, generator=gen).cumsum(2) * 0.05).to(dtype).to(device)
    v = torch.randn(B, HKV, s, D, generator=gen).to(dtype).to(device)
    q = torch.randn(B, HQ, 1, D, generator=gen).to(dtype).to(device)
    valid = (torch.arange(s, device=device) < length).view(1, 1, 1, s)
    rows = []

    def raw_masked():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=valid, enable_gqa=True)

    rows.append(_row("sdpa_masked", time_fn(raw_masked), _nbytes(k, v), peak))
    if device == "cuda":
        def raw_flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length], enable_gqa=True)
        try:
            rows.append(_row("sdpa_flash", time_fn(raw_flash), _nbytes(k, v), peak))
        except RuntimeError as err:  # recorded, not hidden: the flash backend may refuse this shape on this build
            rows.append(_row("sdpa_flash", None, _nbytes(k, v), peak, error=str(err).splitlines()[0]))

    for name, opts in TIERS:
        codec = make_codec("jpeg", **opts) if name.startswith("jpeg") else make_codec("png", **opts)
        rows += bench_tier(name, codec, q, k, v, length, valid, time_fn, peak)
    for row in rows:
        row["S"] = s
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="S = 4k, 16k only")
    parser.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (multiples of 8)")
    parser.add_argument("--repeats", type=int, default=3, help="CPU timing repeats")
    parser.add_argument("--peak-gbps", type=float, help="device memory bandwidth, GB/s (default: 4800 on CUDA)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/attention_<device>.json)")
    args = parser.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    seqs = args.seqs or ([4096, 16384] if args.quick else [4096, 16384, 65536, 131072])
    if any(s % R or s < 2 * R for s in seqs):
        parser.error(f"--seqs must be multiples of {R}, at least {2 * R}")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    peak = args.peak_gbps if args.peak_gbps else (4800.0 if device == "cuda" else None)
    time_fn = _timer(device, args.repeats)
    rows = []
    for s in seqs:
        rows += bench_length(s, device, dtype, time_fn, peak)
        if device == "cuda":
            torch.cuda.empty_cache()
    print("| S | path | tier | time us | MB read | GB/s | roofline |\n|---|---|---|---|---|---|---|")
    for r in rows:
        t = "n/a" if r["time_us"] is None else f"{r['time_us']:.1f}"
        gbps = "n/a" if r["gbps"] is None else f"{r['gbps']:.1f}"
        roof = "n/a" if r["roofline"] is None else f"{r['roofline']:.2f}"
        print(f"| {r['S']} | {r['path']} | {r.get('tier', 'raw')} | {t} | {r['bytes'] / 1e6:.1f} | {gbps} | {roof} |")
    config = {"B": B, "H_kv": HKV, "H_q": HQ, "D": D, "dtype": str(dtype), "device": device, "seqs": seqs,
              "stored_length": "S - 3", "peak_gbps": peak, "timer": "triton do_bench median" if device == "cuda"
              else f"median of {args.repeats} runs", "scale": 1 / math.sqrt(D)}
    path = write_result(f"attention_{device}", {"config": config, "rows": rows}, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
