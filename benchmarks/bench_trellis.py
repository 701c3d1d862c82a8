"""Issue 42's probe: trellis-coded quantization (TCQ) of the rotated per-token rows against the scalar Lloyd-Max codes.

    python benchmarks/bench_trellis.py                      # Gaussian MSE, then KL on SmolLM2 (3 x 1024 tokens)
    python benchmarks/bench_trellis.py --mse-only --rows 2000
    python benchmarks/bench_trellis.py --speed --threads 1    # attention on the stored form: presets vs their tcq codes
    python benchmarks/bench_trellis.py --streams --windows 2  # each stream's error: presets vs twins, with outliers
    python benchmarks/bench_trellis.py --scales --rows 3000   # the encoder's candidate scales per bit width
    python benchmarks/bench_trellis.py --encode --threads 1 --repeats 21   # encode of a prefill: presets vs twins

Trellises (``trellis_probe_lib.py``, plain torch): an 8-state Ungerboeck TCQ (alphabet ``0.9 x`` the ``(b+1)``-bit
Lloyd-Max levels in four subsets, state = the last three branch bits), the same trellis with its ``8 x 2**b`` table
trained on Gaussian rows (Lloyd iterations through the Viterbi encoder), and QTIP-style bitshift trellises (state =
the last ``m`` bits of the code stream, a trained ``2**(m+b)`` table). Every row of 64 values starts in state 0 (no
side bits); the scale is one fp16 per row: two candidates (0.9 and 1.1 x the RMS), a Viterbi pass each, the least
error kept, then the least-squares scale of the kept codes where it errs less.

MSE: unit-Gaussian rows of 64, normalized (sum of squared errors over sum of squares), against the package's
Lloyd-Max quantizer with its scale search. KL: ``bench_fakequant``'s one-pass model of bench_ppl's streaming protocol
(SmolLM2-135M, fp32, prefill 128, chunks of 16), the presets' recipes as they are (sinks, windows, center,
normalize, rotation) with the archived rows' codes replaced by the trellis' (same bits per value: ``b`` bits per code,
one fp16 scale per token and head, so the stored bits are the presets'). Output: results/trellis_probe.json.

Speed (``--speed``): ``bench_attention.bench`` (single-token decode attention of one SmolLM2 layer, fp32, interleaved
rounds, the C++ kernel through ``torch.ops.flashcodec.codec_attention``) for each preset and the same preset with
``levels="tcq"`` (the package's trellis codes, ``codecs/trellis.py``), at 4k and 16k tokens, 1 and 30 layers cycled.
Output: results/trellis_speed.json.

Streams (``--streams``): where a twin's gain goes, stream by stream. SmolLM2's keys and values of ``--windows``
windows of prose (the raw cache's, after rotary), as given and with x16 outlier channels
(``evaluate.outliers.add_outlier_channels``, as bench_ppl's ``--outliers``), pass through a ``FlashCodecCache`` of each
scalar preset and of its twin by bench_ppl's streaming protocol (prefill 128, chunks of 16); per stream, the squared
error of the decoded view over the squared values, on the positions the stream archives (past its sinks, before its
raw window), summed over layers, heads and windows, and the twin's over the scalar preset's. Output:
results/trellis_streams.json.

Encode (``--encode``): one SmolLM2 layer's prefill (``--encode-tokens`` tokens, 3 KV heads, head_dim 64, fp32; keys a
random walk, values Gaussian, as ``bench_attention.Layers``) stored by each preset and by its twin, K and V, each
through one ``flashcodec::append`` call on an empty state (the C++ kernel: the rotation, the codes' search, packing),
interleaved rounds in shuffled order; median and minimum wall ms and the twin's over its scalar preset's. Output:
results/trellis_encode.json.

Scales (``--scales``): the package encoder's candidate scales (``trellis.FACTORS``). Unit-Gaussian rows of 64 coded
at each factor of a grid (0.7 .. 1.3 x the RMS, the package's Viterbi and least-squares refit); per bit width,
factors added one at a time to the pair (0.9, 1.05), each the one that lowers the error most on one set of rows
(``--rows``, seed 0), and each list's error (the least over its candidates per row) measured on another set (seed
1), up to ``--most-factors``; then the whole grid's, and the package's ``trellis.encode`` on the second set (fp16
scales). Output: results/trellis_scales.json.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import bench_fakequant
import torch
import trellis_probe_lib as tl
from common import RESULTS_DIR, write_result
from corpus import kind_texts, leading_tokens, load_tokens, windows

from flashcodec_fx.codecs import Codec
from flashcodec_fx.codecs.quant import Quantizer
from flashcodec_fx.config import cache_config
from flashcodec_fx.evaluate import markdown_table, token_kl, token_nll
from flashcodec_fx.presets import preset_options

FACTORS = (0.9, 1.1)


def trellises(bits: int, train_rows: int, fast: bool) -> dict[str, tl.Trellis]:
    out = {"tcq8": tl.ungerboeck(bits, 0.9)}
    out["tcq8-trained"] = tl.train_table(out["tcq8"], bits, rows=train_rows, iterations=8)
    if not fast:
        for m in (4, 6):
            tr = tl.train_table(tl.bitshift(bits, m), bits, rows=train_rows, iterations=10)
            out[f"bitshift{1 << m}-trained"] = tr
    return out


def mse_rows(rows: int, train_rows: int, bit_list: tuple[int, ...]) -> tuple[list[dict], dict]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 64, generator=gen)
    out, tables = [], {}
    for bits in bit_list:
        q = Quantizer((bits,), ("lloyd",), search=True)
        packed, s, z = q.quantize(x[:, None, None, :])
        rec = q.dequantize(packed, s, z, 64)[:, 0, 0]
        out.append({"bits": bits, "codes": "lloyd + scale search", "mse": float((rec - x).square().sum() / x.square().sum())})
        trs = trellises(bits, train_rows, fast=bits in (1, 4))
        tables[bits] = trs
        for name, tr in trs.items():
            start = time.perf_counter()
            rec, _ = tl.quantize(x, tr, FACTORS)
            out.append({"bits": bits, "codes": name, "states": tr.states,
                        "mse": float((rec - x).square().sum() / x.square().sum()),
                        "encode_s_per_1k_rows": (time.perf_counter() - start) * 1000 / rows})
    return out, tables


_ACTIVE: dict[int, tl.Trellis] | None = None  # bits -> trellis of the tier being run (None: the codec's own codes)
_original_coded = bench_fakequant.coded


def coded(codec: Codec, x: torch.Tensor, prefill: int) -> torch.Tensor:
    """bench_fakequant.coded with the archived rows coded by the active trellis (the codec's own steps otherwise)."""
    if _ACTIVE is None:
        return _original_coded(codec, x, prefill)
    from flashcodec_fx.codecs.channel_norm import channel_exponents, channel_factors

    measured = torch.arange(prefill) >= codec.sinks
    n = channel_factors(channel_exponents(x[:, :, :prefill], measured))[:, :, None] if codec.normalize else None
    stored = x.float() if n is None else x.float() / n
    mean = stored[:, :, codec.sinks: prefill].mean(2) if codec.center else None
    body = codec.prepare(stored[:, :, codec.sinks:], mean)
    tr = _ACTIVE[codec.quantizer.bits[0]]
    rec, _ = tl.quantize(body.reshape(-1, body.shape[-1]), tr, FACTORS)
    decoded = codec.restore(rec.reshape(body.shape), mean)
    out = torch.cat([stored[:, :, : codec.sinks], decoded], 2)
    return out if n is None else out * n


def kl_rows(model, ids, presets: list[str], tables: dict[int, dict[str, tl.Trellis]], kinds: list[str],
            prefill: int, chunk: int) -> list[dict]:
    global _ACTIVE
    bench_fakequant.coded = coded
    ref = bench_fakequant.logprobs(model, ids, None, prefill, chunk)
    rows = []
    for preset in presets:
        config = cache_config(**preset_options(preset))
        for kind in ["scalar", *kinds]:
            _ACTIVE = None if kind == "scalar" else {b: t[kind] for b, t in tables.items()}
            start = time.perf_counter()
            try:
                got = bench_fakequant.logprobs(model, ids, config, prefill, chunk)
            finally:
                _ACTIVE = None
            kl = token_kl(ref, got).double()
            rows.append({"preset": preset, "codes": kind, "kl": float(kl.mean()), "kl_per_window": kl.mean(1).tolist(),
                         "ppl": math.exp(float(token_nll(got, ids[:, prefill:]).mean())),
                         "seconds": time.perf_counter() - start})
            print(rows[-1], flush=True)
    return rows


def speed(args: argparse.Namespace) -> None:
    import bench_attention

    from flashcodec_fx.presets import preset_config

    tiers = {}
    for name in args.presets:
        tiers[name] = tuple(c.resolved(torch.float32) for c in preset_config(name).layers.build(0))
        tcq = cache_config(preset=name, levels="tcq").layers.build(0)
        tiers[f"{name}-tcq"] = tuple(c.resolved(torch.float32) for c in tcq)
    rows = []
    for s in args.seqs:
        for layers in args.layers:
            rows += bench_attention.bench(s, layers, "cpu", torch.float32, "smollm2", args.repeats, 0, None, tiers,
                                          shuffle=True)
    table = [r for r in rows if r["path"] == "kernel"]
    for r in table:
        base = next(x for x in table if x["S"] == r["S"] and x["layers"] == r["layers"]
                    and x["tier"] == r["tier"].removesuffix("-tcq"))
        r["vs_scalar"] = r["time_us"] / base["time_us"]
        r["vs_scalar_min"] = r["min_us"] / base["min_us"]
    print(markdown_table(table, [("S", "S", "d"), ("layers", "layers", "d"), ("tier", "tier", "s"),
                                 ("path", "kernel_path", "s"), ("us", "time_us", ".1f"), ("min us", "min_us", ".1f"),
                                 ("vs scalar", "vs_scalar", ".2f"), ("vs scalar (min)", "vs_scalar_min", ".2f"),
                                 ("max diff", "max_abs_diff_vs_reference", ".1e")]))
    payload = {"threads": args.threads, "shape": "smollm2", "dtype": "float32", "rows": rows}
    print(f"wrote {write_result('trellis_speed', payload, out=args.out or RESULTS_DIR / 'trellis_speed.json')}")


def encode_speed(args: argparse.Namespace) -> None:
    import bench_attention

    from flashcodec_fx.presets import preset_config

    b, hkv, _, d = bench_attention.SHAPES["smollm2"]
    layers = bench_attention.Layers(1, args.encode_tokens, bench_attention.SHAPES["smollm2"], torch.float32, "cpu",
                                    seed=args.encode_tokens)
    k, v = layers.k[0], layers.v[0]
    paths = {}
    for name in [p for preset in args.presets for p in (preset, f"{preset}-tcq")]:
        ck, cv = (c.resolved(torch.float32) for c in preset_config(name).layers.build(0))
        paths[name] = lambda ck=ck, cv=cv: (bench_attention.stored(ck, k), bench_attention.stored(cv, v))
    times = bench_attention.interleaved(paths, args.repeats, shuffle=True)
    rows = [{"tier": name, "tokens": args.encode_tokens, "ms": t["wall_s"] * 1e3, "min_ms": t["min_s"] * 1e3,
             "cpu_ms": t["cpu_s"] * 1e3} for name, t in times.items()]
    for r in rows:
        base = next(x for x in rows if x["tier"] == r["tier"].removesuffix("-tcq"))
        r["vs_scalar"], r["vs_scalar_min"] = r["ms"] / base["ms"], r["min_ms"] / base["min_ms"]
    print(markdown_table(rows, [("tier", "tier", "s"), ("ms", "ms", ".2f"), ("min ms", "min_ms", ".2f"),
                                ("vs scalar", "vs_scalar", ".2f"), ("vs scalar (min)", "vs_scalar_min", ".2f")]))
    payload = {"threads": args.threads, "shape": {"batch": b, "kv_heads": hkv, "head_dim": d}, "dtype": "float32",
               "repeats": args.repeats, "rows": rows}
    print(f"wrote {write_result('trellis_encode', payload, out=args.out or RESULTS_DIR / 'trellis_encode.json')}")


OUTLIER_FACTOR = 16.0  # --streams: the outlier model's channel factor (bench_ppl --outliers 16)
STREAM_PREFILL, STREAM_CHUNK = 128, 16


def raw_states(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values ``(W, H, L, D)`` of ``ids (W, L)`` in the raw cache (after rotary)."""
    from transformers import DynamicCache

    from flashcodec_fx.evaluate import cache_kwarg

    raw = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): raw})
    return [(layer.keys, layer.values) for layer in raw.layers]


def stream_errors(model, states: list[tuple[torch.Tensor, torch.Tensor]], preset: str) -> dict[str, float]:
    """Relative squared error of preset ``preset``'s decoded keys and values (archived positions) on ``states``
    (:func:`raw_states`), fed to the cache by the streaming protocol."""
    from flashcodec_fx.evaluate import stream_steps
    from flashcodec_fx.hf import FlashCodecCache, MaterializationFreeFallback
    from flashcodec_fx.presets import preset_codecs

    cache = FlashCodecCache.from_config(model.config, preset=preset)
    codecs = preset_codecs(preset)
    length = states[0][0].shape[2]
    sums = {"keys": [0.0, 0.0], "values": [0.0, 0.0]}
    for i, (k, v) in enumerate(states):
        with warnings.catch_warnings():  # the decoded view is what this measures (no attention on the stored form)
            warnings.simplefilter("ignore", MaterializationFreeFallback)
            for step, _ in stream_steps(length, STREAM_PREFILL, STREAM_CHUNK):
                cache.update(k[:, :, step], v[:, :, step], i)
            decoded = cache.layers[i].read_view()
        for (name, x), xh, codec in zip((("keys", k), ("values", v)), decoded, codecs, strict=True):
            archived = slice(codec.sinks, length - codec.window)
            sums[name][0] += float(((x - xh)[:, :, archived].double() ** 2).sum())
            sums[name][1] += float((x[:, :, archived].double() ** 2).sum())
    return {name: err / energy for name, (err, energy) in sums.items()}


def streams(args: argparse.Namespace) -> None:
    from flashcodec_fx.evaluate.outliers import add_outlier_channels
    from flashcodec_fx.pretrained import load_pretrained

    rows = []
    for outliers in (None, OUTLIER_FACTOR):
        model, tokenizer = load_pretrained("SmolLM2-135M-Instruct", dtype=torch.float32)
        if outliers is not None:
            add_outlier_channels(model, outliers)
        ids = windows(load_tokens(tokenizer, kind_texts(["prose"])), args.windows, args.window_tokens,
                      leading_tokens(tokenizer))
        states = raw_states(model, ids)
        for preset in args.presets:
            scalar, twin = stream_errors(model, states, preset), stream_errors(model, states, f"{preset}-tcq")
            for name in ("keys", "values"):
                rows.append({"outliers": outliers, "channels": "as given" if outliers is None else f"x{outliers:g} outliers",
                             "preset": preset, "stream": name, "scalar_error": scalar[name],
                             "twin_error": twin[name], "twin_vs_scalar": twin[name] / scalar[name]})
                print(rows[-1], flush=True)
    print(markdown_table(rows, [("channels", "channels", "s"), ("preset", "preset", "s"), ("stream", "stream", "s"),
                                ("scalar error", "scalar_error", ".3e"), ("twin error", "twin_error", ".3e"),
                                ("twin / scalar", "twin_vs_scalar", ".3f")]))
    payload = {"model": "SmolLM2-135M-Instruct", "protocol": {"windows": args.windows, "window_tokens":
               args.window_tokens, "prefill": STREAM_PREFILL, "chunk": STREAM_CHUNK, "texts": ["prose"]}, "rows": rows}
    print(f"wrote {write_result('trellis_streams', payload, out=args.out or RESULTS_DIR / 'trellis_streams.json')}")


SCALE_GRID = tuple(round(0.7 + 0.025 * i, 3) for i in range(25))  # --scales: candidate factors of the RMS, 0.7..1.3
SCALE_PAIR = (0.9, 1.05)  # the candidates every bit width starts from (trellis.FACTORS[1])


def candidate_errors(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``(len(SCALE_GRID), N)``: each row of ``x (N, D)`` coded at each grid factor times its RMS (the package's
    Viterbi, ``codecs/trellis.py``), its squared error after the encoder's least-squares refit (where it errs less)."""
    from flashcodec_fx.codecs import trellis

    rms = x.square().mean(1).sqrt()
    out = []
    for f in SCALE_GRID:
        codes, cost = trellis.viterbi(x, rms * f, bits)
        lv = trellis.levels(codes, bits)
        fit = (lv * x).sum(1) / (lv * lv).sum(1).clamp_min(1e-30)
        out.append(torch.minimum(cost, (lv * fit[:, None] - x).square().sum(1)))
    return torch.stack(out)


def kept_error(errors: torch.Tensor, chosen: list[int]) -> float:
    """Mean squared error per value when each row keeps the least of the ``chosen`` grid candidates."""
    return float(errors[chosen].min(0).values.mean())


def scale_rows(rows: int, most: int) -> list[dict]:
    """Per bit width: grid candidates added greedily to :data:`SCALE_PAIR` on one set of Gaussian rows (the one that
    lowers their error most, each time), the error of each prefix measured on another set; and the package's
    ``trellis.encode`` on that other set (its ``FACTORS``)."""
    from flashcodec_fx.codecs import trellis

    fit_rows = torch.randn(rows, 64, generator=torch.Generator().manual_seed(0))
    test_rows = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1))
    out = []
    for bits in range(1, trellis.MAX_BITS + 1):
        fit_err, test_err = candidate_errors(fit_rows, bits), candidate_errors(test_rows, bits)
        chosen = [SCALE_GRID.index(f) for f in SCALE_PAIR]
        pair = kept_error(test_err, chosen) / 64
        while True:
            mse = kept_error(test_err, chosen) / 64
            out.append({"bits": bits, "factors": [SCALE_GRID[i] for i in chosen], "candidates": len(chosen),
                        "mse": mse, "vs_pair": mse / pair})
            print(out[-1], flush=True)
            if len(chosen) == most:
                break
            chosen.append(min((i for i in range(len(SCALE_GRID)) if i not in chosen),
                              key=lambda i: kept_error(fit_err, chosen + [i])))
        grid = kept_error(test_err, list(range(len(SCALE_GRID)))) / 64
        out.append({"bits": bits, "factors": "grid", "candidates": len(SCALE_GRID), "mse": grid, "vs_pair": grid / pair})
        codes, scale = trellis.encode(test_rows, bits, True)
        mse = float((trellis.levels(codes, bits) * scale[:, None] - test_rows).square().mean())
        out.append({"bits": bits, "factors": f"package {list(trellis.FACTORS[bits])} (fp16 scales)",
                    "candidates": len(trellis.FACTORS[bits]), "mse": mse, "vs_pair": mse / pair})
        print(out[-2:], flush=True)
    return out


def scales(args: argparse.Namespace) -> None:
    rows = scale_rows(args.rows, args.most_factors)
    table = [{**r, "factors": str(r["factors"])} for r in rows]
    print(markdown_table(table, [("bits", "bits", "d"), ("factors", "factors", "s"), ("MSE", "mse", ".5f"),
                                ("vs the pair", "vs_pair", ".4f")]))
    payload = {"grid": SCALE_GRID, "pair": SCALE_PAIR, "rows_per_set": args.rows, "head_dim": 64, "rows": rows}
    print(f"wrote {write_result('trellis_scales', payload, out=args.out or RESULTS_DIR / 'trellis_scales.json')}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4000, help="Gaussian rows for the MSE (default 4000)")
    parser.add_argument("--train-rows", type=int, default=4000)
    parser.add_argument("--mse-only", action="store_true")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--window-tokens", type=int, default=1024)
    parser.add_argument("--presets", nargs="+", default=["3bit", "2.5bit", "2bit", "4bit"])
    parser.add_argument("--kinds", nargs="+", default=["tcq8-trained"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--speed", action="store_true", help="time attention on the stored form instead")
    parser.add_argument("--streams", action="store_true", help="each stream's error, presets vs twins, instead")
    parser.add_argument("--scales", action="store_true", help="the trellis encoder's candidate scales instead")
    parser.add_argument("--encode", action="store_true", help="time the encode of a prefill instead")
    parser.add_argument("--encode-tokens", type=int, default=1024, help="--encode: tokens per layer (default 1024)")
    parser.add_argument("--most-factors", type=int, default=8, help="--scales: the most candidates tried (default 8)")
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 30])
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.speed:
        speed(args)
        return
    if args.streams:
        streams(args)
        return
    if args.scales:
        scales(args)
        return
    if args.encode:
        encode_speed(args)
        return
    mse, tables = mse_rows(args.rows, args.train_rows, (1, 2, 3, 4))
    print(markdown_table(mse, [("bits", "bits", "d"), ("codes", "codes", "s"), ("MSE", "mse", ".4f")]))
    payload = {"factors": FACTORS, "mse": mse,
               "tables": {f"{b}:{k}": tr.table.tolist() for b, t in tables.items() for k, tr in t.items()}}
    if not args.mse_only:
        from flashcodec_fx.pretrained import load_pretrained

        model, tokenizer = load_pretrained("SmolLM2-135M-Instruct", dtype=torch.float32)
        ids = windows(load_tokens(tokenizer, kind_texts(["prose"])), args.windows, args.window_tokens,
                      leading_tokens(tokenizer))
        for t in (tables[1], tables[4]):  # 1-bit and 4-bit codes only have the TCQ tables
            for kind in args.kinds:
                t.setdefault(kind, t["tcq8-trained"])
        rows = kl_rows(model, ids, args.presets, tables, args.kinds, 128, 16)
        print(markdown_table(rows, [("preset", "preset", "s"), ("codes", "codes", "s"), ("KL", "kl", ".4f"),
                                    ("ppl", "ppl", ".3f")]))
        payload.update(model="SmolLM2-135M-Instruct", protocol={"windows": args.windows, "window_tokens":
                       args.window_tokens, "prefill": 128, "chunk": 16, "texts": ["prose"]}, kl=rows)
    print(f"wrote {write_result('trellis_probe', payload, out=args.out or RESULTS_DIR / 'trellis_probe.json')}")


if __name__ == "__main__":
    main()
