"""Reconstruction quality and size of every codec tier: PSNR, cosine similarity, bits per value, bytes vs raw.

Signals: (a) synthetic AR(1) streams along seq (a few correlation values rho), (b) the real keys and values of
SmolLM2-135M-Instruct (loaded offline by ``flashcodec_fx.pretrained``) on a fixed prompt, every layer, keys and
values separately. Each tensor is cast to the stream dtype (``--dtype``, bf16 by default) and that cast tensor is
the reference: the figures measure the codec alone.

    python benchmarks/bench_reconstruct.py [--quick] [--out PATH] [--model NAME_OR_PATH] [--dtype bfloat16]

PSNR is ``10 log10(max|x|^2 / MSE)`` over a whole (B, H, S, D) tensor; ``null`` where the reconstruction is exact
(MSE 0). Cosine is the mean over tokens of the cosine between original and decoded (D,) vectors. Bits per value and
bytes vs raw count every stored byte (coefficients or deltas, scales, kept-delta positions) against the raw stream
dtype of the same tensor.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from common import write_result

from flashcodec_fx import make_codec
from flashcodec_fx.codecs import Codec

TIERS = [
    ("jpeg r8 K8", "jpeg", {"block_size": 8, "keep_freqs": 8}),
    ("jpeg r8 K6", "jpeg", {"block_size": 8, "keep_freqs": 6}),
    ("jpeg r8 K4", "jpeg", {"block_size": 8, "keep_freqs": 4}),
    ("jpeg r8 K2", "jpeg", {"block_size": 8, "keep_freqs": 2}),
    ("jpeg r8 K8 int8", "jpeg", {"block_size": 8, "keep_freqs": 8, "quant_bits": 8}),
    ("jpeg r8 K4 int8", "jpeg", {"block_size": 8, "keep_freqs": 4, "quant_bits": 8}),
    ("jpeg r8 K2 int8", "jpeg", {"block_size": 8, "keep_freqs": 2, "quant_bits": 8}),
    ("png r8 keep1.0", "png", {"block_size": 8, "keep_ratio": 1.0}),
    ("png r8 keep0.5", "png", {"block_size": 8, "keep_ratio": 0.5}),
]
QUICK_TIERS = ("jpeg r8 K8", "jpeg r8 K4", "jpeg r8 K8 int8", "png r8 keep1.0")
RHOS = (0.0, 0.5, 0.9, 0.99)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

PROMPT = """\
The history of lighthouses begins with fires lit on hilltops to guide ships home after dark. The Pharos of
Alexandria, finished around 280 BC, stood more than a hundred metres tall and burned wood at its summit; travellers
wrote that its light could be seen from far out at sea. For centuries afterwards most coastal lights were little
more than braziers of coal or candles behind glass, and keepers spent their nights trimming wicks and cleaning soot
from the windows. Everything changed in 1822, when the French physicist Augustin Fresnel presented a lens built
from concentric rings of glass prisms. A Fresnel lens bends the light of a small flame into a narrow, powerful beam,
and it weighs far less than a solid lens of the same size. Within a few decades the new lenses were installed along
the coasts of Europe and North America, and each station was given its own pattern of flashes so that sailors
could tell one light from another.

Modern navigation looks rather different. Ships carry satellite receivers that report their position within a few
metres, electronic charts that update themselves, and radar that sees through fog. Many lighthouses have been
automated, their keepers replaced by timers, solar panels and remote monitoring. Yet the old towers have not
disappeared. Sailors still rely on them when electronics fail, and coastal communities treat them as landmarks
worth preserving. Some have become museums or guest houses, where visitors climb narrow spiral stairs to stand
beside the great lenses and look out over the water.

A recipe for a simple loaf of bread needs only four ingredients: flour, water, salt and yeast. Mix five hundred
grams of flour with three hundred and fifty millilitres of warm water, ten grams of salt and a teaspoon of dried
yeast. Knead the dough for ten minutes until it is smooth and elastic, then leave it covered in a warm place for
about an hour, until it has doubled in size. Shape it into a round loaf, let it rise again for thirty minutes, and
bake it at two hundred and twenty degrees for thirty-five minutes. The crust should sound hollow when tapped.

In mathematics, a prime number is a natural number greater than one that has no divisors other than one and itself.
The first few primes are 2, 3, 5, 7, 11, 13, 17, 19, 23 and 29. Euclid proved more than two thousand years ago that
there are infinitely many of them: suppose the list were finite, multiply all of them together and add one, and the
result is divisible by none of the primes on the list. The distribution of primes among the integers is irregular
at small scales but remarkably smooth at large ones; the prime number theorem states that the number of primes below
n grows roughly like n divided by its natural logarithm. Questions about primes that are easy to state, such as
whether every even number greater than two is the sum of two primes, remain open to this day.

def moving_average(values, window):
    total = sum(values[:window])
    result = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        result.append(total / window)
    return result

The function above computes a moving average in linear time by keeping a running total instead of summing each
window again. Questions for the reader: what happens when the window is larger than the list, and how would you
change the code to return an empty list in that case instead of failing?
"""


def encoded_bytes(codec: Codec, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Decode(encode(x)) in x's dtype, and the bytes the encoded form holds."""
    enc = codec.encode(x)
    return codec.decode(enc, x.dtype), sum(t.nbytes for t in enc)


def quality(x: torch.Tensor, y: torch.Tensor) -> dict[str, float | None]:
    """PSNR (dB, ``None`` when exact) with peak ``max|x|``, and mean per-token cosine over D."""
    x64, y64 = x.double(), y.double()
    mse = (x64 - y64).pow(2).mean().item()
    peak = x64.abs().max().item()
    psnr = None if mse == 0 else 10 * math.log10(peak * peak / mse)
    cos = torch.nn.functional.cosine_similarity(x64, y64, dim=-1, eps=1e-30).mean().item()
    return {"psnr_db": psnr, "cosine": cos}


def measure(codec: Codec, x: torch.Tensor) -> dict[str, float | None]:
    y, nbytes = encoded_bytes(codec, x)
    return {**quality(x, y), "bits_per_value": 8 * nbytes / x.numel(), "bytes_vs_raw": nbytes / x.nbytes}


def ar1(rho: float, shape: tuple[int, int, int, int], generator: torch.Generator) -> torch.Tensor:
    """``x_t = rho x_{t-1} + sqrt(1 - rho^2) e_t`` along seq (dim 2), unit variance, fp32."""
    eps = torch.randn(shape, generator=generator)
    out = torch.empty(shape)
    out[:, :, 0] = eps[:, :, 0]
    gain = math.sqrt(1 - rho * rho)
    for t in range(1, shape[2]):
        out[:, :, t] = rho * out[:, :, t - 1] + gain * eps[:, :, t]
    return out


def summarize(per_layer: list[float | None]) -> dict:
    finite = [v for v in per_layer if v is not None]
    return {"mean": statistics.fmean(finite) if finite else None, "min": min(finite) if finite else None,
            "exact_layers": len(per_layer) - len(finite), "per_layer": per_layer}


def bench_synthetic(tiers: list, dtype: torch.dtype, shape: tuple[int, int, int, int], rhos: tuple[float, ...]) -> dict:
    gen = torch.Generator().manual_seed(0)
    signals = {str(rho): ar1(rho, shape, gen).to(dtype) for rho in rhos}
    results = {}
    for label, mode, options in tiers:
        codec = make_codec(mode, **options)
        by_rho = {rho: measure(codec, x) for rho, x in signals.items()}
        first = next(iter(by_rho.values()))
        results[label] = {"bits_per_value": first["bits_per_value"], "bytes_vs_raw": first["bytes_vs_raw"],
                          "by_rho": {rho: {"psnr_db": m["psnr_db"], "cosine": m["cosine"]} for rho, m in by_rho.items()}}
    return {"shape": list(shape), "rhos": list(rhos), "results": results}


def bench_real(tiers: list, dtype: torch.dtype, tokens: int, model_name: str | None) -> dict:
    from flashcodec_fx.pretrained import DEFAULT_MODEL, capture_kv, load_pretrained

    start = time.perf_counter()
    model, tokenizer = load_pretrained(model_name)
    load_s = time.perf_counter() - start
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        raise ValueError(f"tokens={tokens} exceeds the {ids.shape[1]} tokens of the built-in prompt")
    kv = [(k.to(dtype), v.to(dtype)) for k, v in capture_kv(model, ids[:, :tokens])]
    results = {}
    for label, mode, options in tiers:
        codec = make_codec(mode, **options)
        entry = {}
        for part, index in (("keys", 0), ("values", 1)):
            per_layer = [measure(codec, layer[index]) for layer in kv]
            entry[part] = {"psnr_db": summarize([m["psnr_db"] for m in per_layer]),
                           "cosine": summarize([m["cosine"] for m in per_layer])}
            entry["bits_per_value"], entry["bytes_vs_raw"] = per_layer[0]["bits_per_value"], per_layer[0]["bytes_vs_raw"]
        results[label] = entry
    return {"model": model_name or DEFAULT_MODEL, "model_load_s": round(load_s, 2), "tokens": tokens,
            "layers": len(kv), "kv_shape": list(kv[0][0].shape), "results": results}


def _psnr_cell(stat: dict) -> str:
    if stat["mean"] is None:
        return "exact"
    cell = f"{stat['mean']:.1f} / {stat['min']:.1f}"
    return cell + (f" ({stat['exact_layers']} exact)" if stat["exact_layers"] else "")


def markdown(payload: dict) -> str:
    syn, real = payload["synthetic"], payload["real"]
    rhos = syn["rhos"]
    lines = [f"Synthetic AR(1) {tuple(syn['shape'])} {payload['config']['dtype']}: PSNR dB (cosine) per rho",
             "", "| tier | bits/value | bytes vs raw | " + " | ".join(f"rho={r}" for r in rhos) + " |",
             "|---|---|---|" + "---|" * len(rhos)]
    for label, r in syn["results"].items():
        cells = []
        for rho in map(str, rhos):
            m = r["by_rho"][rho]
            cells.append(("exact" if m["psnr_db"] is None else f"{m['psnr_db']:.1f}") + f" ({m['cosine']:.4f})")
        lines.append(f"| {label} | {r['bits_per_value']:.2f} | {r['bytes_vs_raw']:.3f} | " + " | ".join(cells) + " |")
    lines += ["", f"{real['model']} K/V, {real['tokens']} tokens, {real['layers']} layers, {payload['config']['dtype']}: "
              "PSNR dB mean / min over layers, cosine mean / min", "",
              "| tier | bits/value | bytes vs raw | K PSNR | K cosine | V PSNR | V cosine |", "|---|---|---|---|---|---|---|"]
    for label, r in real["results"].items():
        k, v = r["keys"], r["values"]
        lines.append(f"| {label} | {r['bits_per_value']:.2f} | {r['bytes_vs_raw']:.3f} | {_psnr_cell(k['psnr_db'])} | "
                     f"{k['cosine']['mean']:.5f} / {k['cosine']['min']:.5f} | {_psnr_cell(v['psnr_db'])} | "
                     f"{v['cosine']['mean']:.5f} / {v['cosine']['min']:.5f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 tiers, 128 tokens, small synthetic signal (smoke run)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/reconstruct.json)")
    parser.add_argument("--model", default=None, help="name_or_path for load_pretrained (default SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="stream dtype of the tensors coded")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    tiers = [t for t in TIERS if not args.quick or t[0] in QUICK_TIERS]
    start = time.perf_counter()
    synthetic = bench_synthetic(tiers, dtype, (1, 4, 256, 64) if args.quick else (1, 8, 1024, 64),
                                (0.9,) if args.quick else RHOS)
    real = bench_real(tiers, dtype, 128 if args.quick else 512, args.model)
    config = {"dtype": args.dtype, "quick": args.quick, "tiers": [{"label": t[0], "mode": t[1], "options": t[2]} for t in tiers],
              "psnr": "10 log10(max|x|^2 / MSE) per (B, H, S, D) tensor; null = exact",
              "cosine": "mean over tokens of cos(x, decoded) over D",
              "bytes_vs_raw": "encoded bytes (data + scales + index) / bytes of the same tensor in dtype"}
    payload = {"config": config, "synthetic": synthetic, "real": real, "runtime_s": round(time.perf_counter() - start, 1)}
    path = write_result("reconstruct", payload, args.out)
    print(markdown(payload))
    print(f"\nwrote {path} in {payload['runtime_s']} s")


if __name__ == "__main__":
    main()
