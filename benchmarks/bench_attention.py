"""Single-token decode attention of one layer: raw-KV SDPA vs the codec paths, time and bytes read, side by side.

Shapes (``--shapes``): on CPU SmolLM2-135M's layer (``smollm2``: B=1, H_kv=3, H_q=9: GQA 3, D=64) and Gemma 3
270M's (``gemma3``: B=1, H_kv=1, H_q=4: GQA 4, D=256), fp32, ``--threads`` (2); on CUDA B=1, H_kv=8, H_q=32, D=128,
bf16. The stored length is ``S - 3`` tokens (so a partial raw tail is attended too).

Codecs (``--presets``): the lossy presets of ``flashcodec_fx.PRESETS`` by name (their key and value options as the
cache resolves them for layer 0, read from ``presets.py`` at run time, so a retuned preset is measured as it is;
per-token codes: the CPU's token kernel), and ``jpeg-r8-int8`` (jpeg r=8, all 8 coefficients, int8 per token: the
block kernel, the cache's default before the presets). Raw rows as the cache stores them in the run's dtype
(``Codec.resolved``: bf16 sinks and windows in an fp32 stream of a lossy preset); ``--raw-dtypes auto stream`` times
each codec with its raw rows in the stream dtype too (``<name>@raw_dtype=stream``), in the same rounds.

Paths, timed in interleaved rounds (each round runs every path once), medians of wall and process CPU time:

- ``sdpa_gqa``: raw fp32 K/V, ``scaled_dot_product_attention(..., enable_gqa=True)`` (no mask: one decode query
  sees every stored token); ``sdpa_repeat_kv``: K/V expanded per query head the way transformers' ``repeat_kv``
  does, then SDPA; ``sdpa_flash`` (CUDA): the flash backend forced. ``vs_sdpa`` divides by the faster raw path.
- ``copy`` (CPU): ``copy_`` of the raw K and V into spare buffers, the machine's copy bandwidth on the same working
  set in the same rounds: the physical floor. ``roofline`` = a path's GB/s over the copy's (CUDA: over
  ``--peak-gbps``, 4800).
- ``kernel``: ``torch.ops.flashcodec.codec_attention``, the op's registered kernel (the C++ kernel on CPU, Triton on
  CUDA), called as a model calls it (validation included).
- ``reference``: ``codec_attention_reference`` (the spec; CPU: only up to ``--reference-max`` tokens).
- ``materialized``: ``flashcodec::read`` of K and V, then SDPA (the view the codec avoids; same limit on CPU).
  These two slow paths are timed after the others, in rounds of their own (a quarter as many).

``--layers 1 30``: each timed call reads the next of N layers' caches (N=1: one layer, hot in the caches, the
per-layer target; N=30, SmolLM2's depth: what a decode step sees, each layer's KV evicted by the other layers'
before it is read again). Bytes are what a path must read at least: raw K and V, or the stored state (codes,
scales, zero points, sinks, tail). ``GB/s`` = bytes / time. ``--neighbour python|omp``: the whole run next to
CPU-burning processes (``common.neighbour``).

    python benchmarks/bench_attention.py --device cpu --quick     # S = 4k, 16k, layers 1 and 30
    python benchmarks/bench_attention.py --device cuda            # S = 4k .. 128k
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F
from common import NEIGHBOURS, neighbour, write_result
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashcodec_fx import PRESETS, presets
from flashcodec_fx.codecs import Codec
from flashcodec_fx.config import cache_config
from flashcodec_fx.ops import empty_state
from flashcodec_fx.ops.reference.attention import codec_attention_reference

SHAPES = {"smollm2": (1, 3, 9, 64), "gemma3": (1, 1, 4, 256), "cuda": (1, 8, 32, 128)}  # B, H_kv, H_q, D
CPU_SHAPES = ("smollm2", "gemma3")
BLOCK = "jpeg-r8-int8"  # jpeg r=8, all coefficients, int8 per token: the block kernel
BLOCK_OPTIONS = {"mode": "jpeg", "block_size": 8, "quant_bits": 8}
DEFAULT_PRESETS = (*(name for name in PRESETS if name != "lossless"), BLOCK)


def preset_codecs(name: str) -> tuple[Codec, Codec]:
    """The key and value codecs preset ``name`` (or ``BLOCK``) gives a cache's layer 0 (the cache's own option
    resolution)."""
    return presets.preset_codecs(name) if name != BLOCK else cache_config(**BLOCK_OPTIONS).layers.build(0)


def tier_codecs(names: list[str], raw_dtypes: list[str], dtype: torch.dtype) -> dict[str, tuple[Codec, Codec]]:
    """``{tier: (key codec, value codec)}`` as a stream of ``dtype`` stores with them (``Codec.resolved``), per name
    and ``raw_dtype`` (``"auto"``: the name itself; else ``<name>@raw_dtype=<value>``)."""
    tiers = {}
    for raw in raw_dtypes:
        for name in names:
            codecs = preset_codecs(name) if raw == "auto" else (c.with_raw_dtype(raw) for c in preset_codecs(name))
            tiers[name if raw == "auto" else f"{name}@raw_dtype={raw}"] = tuple(c.resolved(dtype) for c in codecs)
    return tiers


def kernel_path(ck: Codec, cv: Codec, q: torch.Tensor) -> str:
    """Which kernel serves the pair on q's device (CPU: the C++ kernel's own answer, e.g. ``token:avx2/avx2``)."""
    if q.device.type != "cpu":
        return "triton"
    from flashcodec_fx.ops.cpu import EXTENSION, kernel_mode
    from flashcodec_fx.ops.cpu.plan import codec_plan

    module = EXTENSION.module()
    if kernel_mode() == "reference" or module is None:
        return "reference"
    d = q.shape[-1]
    return module.attention_path(codec_plan(ck.spec, d), codec_plan(cv.spec, d), True)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """transformers' ``repeat_kv``: (B, H_kv, S, D) -> (B, H_kv * groups, S, D) by expand + reshape."""
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def stored(codec, x: torch.Tensor) -> list[torch.Tensor]:
    """The state of stream ``x`` appended in one call (the op's kernel: the C++ one on CPU)."""
    b, h, s, d = x.shape
    state = list(empty_state(codec, b, h, -(-s // codec.group) + 1, d, x.dtype, x.device))
    torch.ops.flashcodec.append(state, x, codec.spec, None)
    return state


class Layers:
    """N independent layers' raw caches and codec states of one length; ``next()`` cycles through them."""

    def __init__(self, n: int, s: int, shape, dtype, device: str, seed: int):
        b, hkv, hq, d = shape
        gen = torch.Generator().manual_seed(seed)
        self.q = [torch.randn(b, hq, 1, d, generator=gen).to(dtype).to(device) for _ in range(n)]
        self.k = [(torch.randn(b, hkv, s, d, generator=gen).cumsum(2) * 0.05).to(dtype).to(device) for _ in range(n)]
        self.v = [torch.randn(b, hkv, s, d, generator=gen).to(dtype).to(device) for _ in range(n)]
        self.n, self.at, self.groups = n, 0, hq // hkv

    def next(self) -> int:
        self.at = (self.at + 1) % self.n
        return self.at


def interleaved(paths: dict, rounds: int, warmup: int = 3, shuffle: bool = False) -> dict[str, dict[str, float]]:
    """Median and minimum wall seconds and median CPU seconds of each path, the paths run in turn every round (same
    conditions for all). On a shared machine the minimum is the least disturbed run; both are reported. ``shuffle``:
    each round runs the paths in another order (seeded), so no path always runs right after the same one (the copy
    path evicts the caches the path after it then refills)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in paths.values():
        for _ in range(warmup):
            fn()
    wall = {name: [] for name in paths}
    cpu = {name: [] for name in paths}
    for r in range(rounds):
        names = list(paths)
        if shuffle:
            random.Random(r).shuffle(names)
        for name in names:
            fn = paths[name]
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {name: {"wall_s": statistics.median(wall[name]), "min_s": min(wall[name]), "cpu_s": statistics.median(cpu[name])}
            for name in paths}


def bench(s: int, n_layers: int, device: str, dtype, shape_name: str, rounds: int, reference_max: int,
          peak: float | None, tiers: dict[str, tuple[Codec, Codec]], shuffle: bool = False):
    length = s - 3
    layers = Layers(n_layers, length, SHAPES[shape_name], dtype, device, seed=s + n_layers)
    raw_bytes = _nbytes(layers.k[0], layers.v[0])

    def raw(fn):
        def run():
            i = layers.next()
            return fn(layers.q[i], layers.k[i], layers.v[i])
        return run

    paths = {"sdpa_gqa": raw(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
             "sdpa_repeat_kv": raw(lambda q, k, v: F.scaled_dot_product_attention(
                 q, repeat_kv(k, layers.groups), repeat_kv(v, layers.groups)))}
    if device == "cuda":
        def flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        paths["sdpa_flash"] = raw(flash)
    else:
        spare = (torch.empty_like(layers.k[0]), torch.empty_like(layers.v[0]))
        paths["copy"] = raw(lambda q, k, v: (spare[0].copy_(k), spare[1].copy_(v)))
    sizes = {name: raw_bytes for name in paths}
    extras = {}  # slow paths, timed in a phase of their own so that they do not disturb the main comparison
    errors, kernel_paths = {}, {}
    for tier, (ck, cv) in tiers.items():
        ks = [stored(ck, k) for k in layers.k]
        vs = [stored(cv, v) for v in layers.v]
        state_bytes = _nbytes(*ks[0], *vs[0])

        def codec_path(fn, ks=ks, vs=vs, ck=ck, cv=cv):
            def run():
                i = layers.next()
                return fn(layers.q[i], ks[i], vs[i], ck, cv)
            return run

        kernel = codec_path(lambda q, k, v, ck, cv: torch.ops.flashcodec.codec_attention(q, k, v, ck.spec, cv.spec))
        paths[f"{tier}/kernel"], sizes[f"{tier}/kernel"] = kernel, state_bytes
        with torch.no_grad():
            out = torch.ops.flashcodec.codec_attention(layers.q[0], ks[0], vs[0], ck.spec, cv.spec)
            ref = codec_attention_reference(layers.q[0], ks[0], vs[0], ck.spec, cv.spec)
        errors[tier] = (out.float() - ref.float()).abs().max().item()
        kernel_paths[tier] = kernel_path(ck, cv, layers.q[0])
        if device == "cuda" or s <= reference_max:
            extras[f"{tier}/reference"] = codec_path(lambda q, k, v, ck, cv: codec_attention_reference(q, k, v, ck.spec,
                                                                                                     cv.spec))
            sizes[f"{tier}/reference"] = state_bytes

            def materialized(q, k, v, ck, cv):
                views = (torch.ops.flashcodec.read(k, ck.spec)[:, :, :length],
                         torch.ops.flashcodec.read(v, cv.spec)[:, :, :length])
                return F.scaled_dot_product_attention(q, *views, enable_gqa=True)
            extras[f"{tier}/materialized"] = codec_path(materialized)
            sizes[f"{tier}/materialized"] = state_bytes + 2 * raw_bytes
    load_before = os.getloadavg()
    times = interleaved(paths, rounds, shuffle=shuffle)
    load_after = os.getloadavg()
    times.update(interleaved(extras, max(3, rounds // 4), warmup=1) if extras else {})
    sdpa = min(("sdpa_gqa", "sdpa_repeat_kv"), key=lambda name: times[name]["wall_s"])
    copy = sizes["copy"] / times["copy"]["wall_s"] / 1e9 if "copy" in times else None
    floor = peak if peak else copy
    rows = []
    for name, t in times.items():
        tier, _, path = name.rpartition("/")
        gbps = sizes[name] / t["wall_s"] / 1e9
        row = {"S": s, "layers": n_layers, "shape": shape_name, "tier": tier or "raw", "path": path,
               "time_us": t["wall_s"] * 1e6, "min_us": t["min_s"] * 1e6, "cpu_us": t["cpu_s"] * 1e6,
               "bytes": sizes[name], "gbps": gbps, "copy_gbps": copy, "roofline": gbps / floor if floor else None,
               "load_avg_before": list(load_before), "load_avg_after": list(load_after)}
        if path in ("kernel", "reference", "materialized"):
            row.update(vs_sdpa=t["wall_s"] / times[sdpa]["wall_s"], vs_sdpa_min=t["min_s"] / times[sdpa]["min_s"],
                       vs_sdpa_cpu=t["cpu_s"] / times[sdpa]["cpu_s"],
                       sdpa_baseline=sdpa, compression=raw_bytes / sizes[f"{tier}/kernel"])
        if path == "kernel":
            row["max_abs_diff_vs_reference"] = errors[tier]
            row["kernel_path"] = kernel_paths[tier]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="S = 4k, 16k only")
    parser.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (at least 8)")
    parser.add_argument("--layers", type=int, nargs="+", help="layers cycled per call (default: CPU 1 30, CUDA 1)")
    parser.add_argument("--shapes", nargs="+", choices=CPU_SHAPES, help=f"CPU layer shapes (default: {CPU_SHAPES})")
    parser.add_argument("--repeats", type=int, default=41, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--reference-max", type=int, default=4096, help="CPU: longest S timed for reference paths")
    parser.add_argument("--peak-gbps", type=float, help="device memory bandwidth, GB/s (default: 4800 on CUDA)")
    parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS), choices=[BLOCK, *sorted(PRESETS)],
                        help=f"codecs timed: preset names and {BLOCK} (default: all but lossless, and {BLOCK})")
    parser.add_argument("--raw-dtypes", nargs="+", default=["auto"], choices=("auto", "stream"),
                        help="raw rows as the cache stores them (auto), and/or in the stream dtype (stream)")
    parser.add_argument("--shuffle", action="store_true", help="each timing round runs the paths in another order")
    parser.add_argument("--neighbour", choices=NEIGHBOURS, default="none", help="CPU-burning processes beside the run")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/attention_<device>.json)")
    args = parser.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    seqs = args.seqs or ([4096, 16384] if args.quick else [4096, 16384, 65536, 131072])
    if any(s < 8 for s in seqs):
        parser.error("--seqs must be at least 8")
    layers = args.layers or ([1, 30] if device == "cpu" else [1])
    shapes = ["cuda"] if device == "cuda" else list(args.shapes or CPU_SHAPES)
    if device == "cpu":
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    peak = args.peak_gbps if args.peak_gbps else (4800.0 if device == "cuda" else None)
    tiers = tier_codecs(args.presets, args.raw_dtypes, dtype)
    rows = []
    with torch.inference_mode(), neighbour(args.neighbour):
        for shape in shapes:
            for s in seqs:
                for n in layers:
                    rows += bench(s, n, device, dtype, shape, args.repeats, args.reference_max, peak, tiers,
                                  args.shuffle)
                    if device == "cuda":
                        torch.cuda.empty_cache()
    print("| shape | S | layers | tier | path | median us | min us | vs SDPA (median, min) | MB read | GB/s | of copy |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['vs_sdpa']:.2f}, {r['vs_sdpa_min']:.2f}" if "vs_sdpa" in r else ""
        roof = f"{r['roofline']:.2f}" if r["roofline"] else ""
        print(f"| {r['shape']} | {r['S']} | {r['layers']} | {r['tier']} | {r['path']} | {r['time_us']:.0f} | "
              f"{r['min_us']:.0f} | {ratio} | {r['bytes'] / 1e6:.2f} | {r['gbps']:.1f} | {roof} |")
    config = {"shapes": {name: dict(zip(("B", "H_kv", "H_q", "D"), SHAPES[name], strict=True)) for name in shapes},
              "dtype": str(dtype), "device": device, "seqs": seqs, "layers": layers,
              "threads": torch.get_num_threads(), "stored_length": "S - 3", "peak_gbps": peak,
              "neighbour": args.neighbour,
              "timer": f"median and min of {args.repeats} interleaved rounds (wall), median process CPU time",
              "shuffled_rounds": args.shuffle,
              "scale": "1 / sqrt(D)", "kernels": os.environ.get("FLASHCODEC_KERNELS", "auto"),
              "presets": {name: {"k": ck.spec, "v": cv.spec} for name, (ck, cv) in tiers.items()},
              "load_avg_end": list(os.getloadavg())}
    path = write_result(f"attention_{device}", {"config": config, "rows": rows}, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
