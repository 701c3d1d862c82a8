"""Storage, fill time and read time of one layer's ``CodecKVCache`` per tier and sequence length, on CPU.

One layer, B=1, H=8, D=128, bf16 streams (the usual KV dtype; the baseline is a raw bf16 cache of the same
length), dynamic layout. Keys and values are random normal (storage does not depend on the values).
Tiers: jpeg r=8 with K=8, 4 (stream dtype) and K=8, 4 int8; png keep 1.0 and 0.5 (K=2 tiers store K/r of K=8's
archive: see bench_reconstruct for their sizes). Times are medians of ``--repeats`` runs up to S=8k, one run above.

- storage: ``CodecKVCache.storage_breakdown()`` after a fill of S tokens: archive held (allocated: data + scales +
  kept-delta index) and used (filled blocks), its parts, raw tail, memo; totals with and without the memo, and both
  against a raw bf16 K+V cache.
- fill: ``CodecKVCache(...).forward(k, v)`` into a fresh cache (allocate, append every block, return the views),
  next to the raw cache's fill (a copy of k and v), in the same run.
- read: ``cache.read()`` (the memoized view) next to ``torch.ops.flashcodec.read`` (a full decode of the archive),
  in the same run, on the same filled cache.
Each time is reported as wall clock and as the process's CPU time (steadier when other work shares the machine).

    python benchmarks/bench_footprint.py [--quick] [--out PATH] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import median_times, write_result

from flashcodec_fx import CodecKVCache, make_codec
from flashcodec_fx.codecs import Codec

B, H, D = 1, 8, 128
DTYPE = torch.bfloat16
LENGTHS = (4096, 8192, 16384, 32768, 65536)
LONG = 8192  # above this length each figure is one timed run (a fill takes seconds there), recorded as "repeats": 1
TIERS = [
    ("jpeg r8 K8", "jpeg", {"block_size": 8, "keep_freqs": 8}),
    ("jpeg r8 K4", "jpeg", {"block_size": 8, "keep_freqs": 4}),
    ("jpeg r8 K8 int8", "jpeg", {"block_size": 8, "keep_freqs": 8, "quant_bits": 8}),
    ("jpeg r8 K4 int8", "jpeg", {"block_size": 8, "keep_freqs": 4, "quant_bits": 8}),
    ("png r8 keep1.0", "png", {"block_size": 8, "keep_ratio": 1.0}),
    ("png r8 keep0.5", "png", {"block_size": 8, "keep_ratio": 0.5}),
]
QUICK_TIERS = ("jpeg r8 K8", "jpeg r8 K4 int8", "png r8 keep1.0")


def decode_read(cache: CodecKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Both streams rebuilt from their stored state by the ``flashcodec::read`` op (no memo)."""
    return tuple(torch.ops.flashcodec.read(*s.state, s.tail, s.length, s.spec) for s in (cache.keys, cache.values))


def measure(codec: Codec, k: torch.Tensor, v: torch.Tensor, raw_fill: dict, repeats: int, warmup: int) -> dict:
    """Fill, read and storage of one tier at one length; the last timed fill's cache is the one read and measured."""
    seq, last = k.shape[2], {}

    def fill() -> None:
        last["cache"] = None
        last["cache"] = CodecKVCache(codec)
        last["cache"].forward(k, v)

    def full_decode() -> None:
        last["decoded"] = decode_read(last["cache"])

    fill_t = median_times(fill, repeats, warmup)
    cache = last["cache"]
    memo_t = median_times(cache.read, repeats, warmup)
    decode_t = median_times(full_decode, repeats, warmup)
    (memo_k, memo_v), (dec_k, dec_v) = cache.read(), last.pop("decoded")
    if not (torch.equal(memo_k, dec_k[:, :, :seq]) and torch.equal(memo_v, dec_v[:, :, :seq])):
        raise RuntimeError(f"{codec}: the memo and the read op disagree at S={seq}")
    parts = cache.storage_breakdown()
    raw = 2 * k.nbytes
    without_memo = parts["total"] - parts["memo"]
    held = parts["archive"] + parts["scales"] + parts["index"]
    storage = {"archive_held": held, "archive_used": parts["archive_used"], "archive_data": parts["archive"],
               "scales": parts["scales"], "index": parts["index"], "tail": parts["tail"], "memo": parts["memo"],
               "total": parts["total"], "total_without_memo": without_memo}
    return {"repeats": repeats, "storage_bytes": storage, "raw_bytes": raw, "bytes_vs_raw": parts["total"] / raw,
            "bytes_vs_raw_without_memo": without_memo / raw,
            "fill_s": fill_t["wall_s"], "raw_fill_s": raw_fill["wall_s"], "fill_vs_raw": fill_t["wall_s"] / raw_fill["wall_s"],
            "fill_cpu_s": fill_t["cpu_s"], "raw_fill_cpu_s": raw_fill["cpu_s"],
            "read_memo_s": memo_t["wall_s"], "read_decode_s": decode_t["wall_s"],
            "read_decode_vs_memo": decode_t["wall_s"] / memo_t["wall_s"],
            "read_memo_cpu_s": memo_t["cpu_s"], "read_decode_cpu_s": decode_t["cpu_s"]}


def markdown(rows: list[dict]) -> str:
    lines = ["Times in ms: wall (CPU time of the process, all threads)", "",
             "| tier | S | bytes vs raw bf16 (no memo) | bytes vs raw (with memo) | fill | raw fill | read memo | "
             "read decode |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tier']} | {r['seq_len']} | {r['bytes_vs_raw_without_memo']:.3f} | {r['bytes_vs_raw']:.3f} | "
                     f"{1e3 * r['fill_s']:.0f} ({1e3 * r['fill_cpu_s']:.0f}) | "
                     f"{1e3 * r['raw_fill_s']:.1f} ({1e3 * r['raw_fill_cpu_s']:.1f}) | "
                     f"{1e3 * r['read_memo_s']:.3f} ({1e3 * r['read_memo_cpu_s']:.3f}) | "
                     f"{1e3 * r['read_decode_s']:.0f} ({1e3 * r['read_decode_cpu_s']:.0f}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="S = 4k, 8k and 3 tiers (smoke run)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/footprint.json)")
    parser.add_argument("--repeats", type=int, default=3, help=f"timed repeats per measurement up to S={LONG} (median)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    lengths = LENGTHS[:2] if args.quick else LENGTHS
    tiers = [t for t in TIERS if not args.quick or t[0] in QUICK_TIERS]
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for seq in lengths:
        k = torch.randn(B, H, seq, D, generator=gen).to(DTYPE)
        v = torch.randn(B, H, seq, D, generator=gen).to(DTYPE)
        repeats = args.repeats if seq <= LONG else 1
        warmup = 1 if seq == lengths[0] else 0  # one-time costs (basis caches, first allocations) are paid at the first S
        raw_fill = median_times(lambda k=k, v=v: (k.clone(), v.clone()), repeats, warmup=1)
        for label, mode, options in tiers:
            codec = make_codec(mode, **options)
            rows.append({"tier": label, "seq_len": seq, **measure(codec, k, v, raw_fill, repeats, warmup)})
            print(f"S={seq} {label}: {time.perf_counter() - start:.0f} s", flush=True)
    config = {"batch": B, "heads": H, "head_dim": D, "dtype": "bfloat16", "layout": "dynamic", "device": "cpu",
              "repeats": args.repeats, "repeats_above": {str(LONG): 1}, "quick": args.quick, "lengths": list(lengths),
              "tiers": [{"label": t[0], "mode": t[1], "options": t[2]} for t in tiers],
              "raw_baseline": "a bf16 K+V cache of the same length; raw fill = k.clone() and v.clone()"}
    payload = {"config": config, "rows": rows, "runtime_s": round(time.perf_counter() - start, 1)}
    path = write_result("footprint", payload, args.out)
    print(markdown(rows))
    print(f"\nwrote {path} in {payload['runtime_s']} s")


if __name__ == "__main__":
    main()
