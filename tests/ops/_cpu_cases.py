"""Shared cases of the CPU kernel tests: codecs covering every stored form, states filled by the reference ops."""

from __future__ import annotations

import random

import torch

from flashcodec_fx.codecs import make_codec
from flashcodec_fx.ops.reference.append import append_reference
from flashcodec_fx.ops.state import empty_state

# Every stored form: raw / truncated DCT, png exact and pruned, each level set on each scale axis, bit tables,
# sub-byte widths 1..8, sinks, windows, centers and rotations, trellis codes (levels="tcq") per token and per DCT row
# the "fit" scale search (small blocks keep the reference fast).
CODECS = {
    "jpeg": ("jpeg", {"block_size": 4}),
    "jpeg-k2-residual": ("jpeg", {"block_size": 4, "keep_freqs": 2, "sinks": 1, "window": 3}),
    "jpeg-rot-center": ("jpeg", {"block_size": 4, "rotate": 1, "center": True, "sinks": 2}),
    "jpeg-int8": ("jpeg", {"block_size": 4, "quant_bits": 8}),
    "token-table": ("jpeg", {"block_size": 4, "quant_bits": (6, 4, 3, 2), "levels": ("int", "uniform", "midrise", "lloyd"),
                             "scale_search": True, "window": 2}),
    "channel-key": ("jpeg", {"block_size": 4, "quant_bits": (5, 3, 3, 2), "levels": ("uniform", "midrise"),
                             "scale_axis": "channel", "group": 8, "scale_search": True, "rotate": 1, "center": True,
                             "sinks": 2}),
    "channel-int": ("jpeg", {"block_size": 4, "quant_bits": (8, 4, 4, 2), "levels": ("int", "int"),
                             "scale_axis": "channel", "group": 12}),
    "channel-lloyd": ("jpeg", {"block_size": 2, "quant_bits": 3, "levels": "lloyd", "scale_axis": "channel", "group": 4,
                               "scale_search": True}),
    "channel-dc-1bit": ("jpeg", {"block_size": 4, "keep_freqs": 1, "quant_bits": 1, "levels": "midrise",
                                 "scale_axis": "channel", "group": 4}),
    "token-lloyd-value": ("jpeg", {"block_size": 1, "quant_bits": 2, "levels": "lloyd", "rotate": 2, "center": True,
                                   "scale_search": True, "sinks": 3, "window": 5}),
    "token-uniform-4bit": ("jpeg", {"block_size": 1, "quant_bits": 4, "levels": "uniform", "center": True}),
    "token-tcq3": ("jpeg", {"block_size": 1, "quant_bits": 3, "levels": "tcq", "rotate": 2, "center": True,
                            "scale_search": True, "sinks": 3, "window": 5}),
    "token-tcq2": ("jpeg", {"block_size": 1, "quant_bits": 2, "levels": "tcq", "scale_search": True}),
    "token-tcq1": ("jpeg", {"block_size": 1, "quant_bits": 1, "levels": "tcq", "rotate": 1}),
    "token-tcq4": ("jpeg", {"block_size": 1, "quant_bits": 4, "levels": "tcq", "scale_search": True, "window": 2}),
    "jpeg-tcq-table": ("jpeg", {"block_size": 4, "quant_bits": (4, 3, 2, 1), "levels": "tcq", "scale_search": True}),
    # scale_search="fit": every level set on both axes, Lloyd-Max rows of 1 and 4 bits
    "token-table-fit": ("jpeg", {"block_size": 4, "quant_bits": (6, 4, 3, 2), "levels": ("int", "uniform", "midrise",
                                 "lloyd"), "scale_search": "fit", "window": 2}),
    "channel-key-fit": ("jpeg", {"block_size": 4, "quant_bits": (5, 3, 3, 2), "levels": ("uniform", "midrise"),
                                 "scale_axis": "channel", "group": 8, "scale_search": "fit", "rotate": 1, "center": True,
                                 "sinks": 2}),
    "channel-lloyd-fit": ("jpeg", {"block_size": 2, "quant_bits": 3, "levels": "lloyd", "scale_axis": "channel",
                                   "group": 4, "scale_search": "fit"}),
    "token-lloyd4-fit": ("jpeg", {"block_size": 1, "quant_bits": 4, "levels": "lloyd", "rotate": 2, "center": True,
                                  "scale_search": "fit", "sinks": 3, "window": 5}),
    "token-lloyd1-fit": ("jpeg", {"block_size": 1, "quant_bits": 1, "levels": "lloyd", "rotate": 1,
                                  "scale_search": "fit"}),
    "png": ("png", {"block_size": 4}),
    "png-pruned": ("png", {"block_size": 4, "keep_ratio": 0.5, "sinks": 1, "window": 2}),
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (16, 32, 64, 128)


def codec(name: str):
    mode, options = CODECS[name]
    return make_codec(mode, **options)


def chunks(total: int, seed: int, pieces: int = 6) -> list[int]:
    """A prefill, single tokens and random chunks summing to ``total``, in at most ``pieces`` appends."""
    rng = random.Random(seed)
    sizes: list[int] = []
    while sum(sizes) < total:
        left = total - sum(sizes)
        sizes.append(left if len(sizes) == pieces - 1 else min(left, rng.choice([1, 1, rng.randint(1, left)])))
    return sizes


def filled(c, x: torch.Tensor, sizes: list[int], groups: int | None = None, appender=append_reference):
    """A state of ``groups`` archive groups (default: room for ``x``) after appending ``x`` in chunks of ``sizes``."""
    b, h, s, d = x.shape
    state = list(empty_state(c, b, h, s // c.group + 1 if groups is None else groups, d, x.dtype, "cpu"))
    at = 0
    for n in sizes:
        appender(state, x[:, :, at: at + n], c.spec)
        at += n
    return state


# fp32: both accumulate in fp32 in different orders (and the kernel's exp is a polynomial within 2 ulp); unit-scale
# data, head dims up to TOLERANCE_HEAD_DIM (past it the absolute tolerance grows with the head dim: a rotated row's
# inverse rotation sums D terms, which the kernel adds in sequence and the reference's BLAS in blocks; at D = 256 a
# rotated 1-bit value row measured 1.7x the unscaled tolerance, tests/ops/test_cpu_token_attention.py's hypothesis
# run). fp16 / bf16: both round the same fp32 result once, so they differ by at most one ulp of the output.
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 1e-5}, torch.float16: {"atol": 1e-5, "rtol": 2.0**-10},
             torch.bfloat16: {"atol": 1e-5, "rtol": 2.0**-7}}
TOLERANCE_HEAD_DIM = 64


def tolerance(out: torch.Tensor) -> dict[str, float]:
    """``TOLERANCE`` for ``out (..., D)``: fp32's absolute part times ``D / TOLERANCE_HEAD_DIM`` past that head dim."""
    tol = dict(TOLERANCE[out.dtype])
    if out.dtype == torch.float32:
        tol["atol"] *= max(1.0, out.shape[-1] / TOLERANCE_HEAD_DIM)
    return tol


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(out))


def make_mask(kind: str, b: int, hq: int, t: int, width: int, seed: int) -> torch.Tensor | None:
    """None, bool (True = attend) or additive float, with broadcast batch / head / query dims."""
    if kind == "none":
        return None
    gen = torch.Generator().manual_seed(seed)
    shape = (b if seed % 2 else 1, hq if seed % 3 else 1, t if seed % 5 else 1, width)
    keep = torch.rand(shape, generator=gen) > 0.25
    if kind == "bool":
        return keep
    return (torch.randn(shape, generator=gen) * 0.5).masked_fill(~keep, float("-inf"))


def allocations(fn) -> list[int]:
    """Bytes of every allocation ``fn`` makes through torch's CPU allocator (profiler memory events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sorted(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def variant_kwargs(softcap: float | None, sinks: bool, alibi: bool, hq: int, seed: int,
                   sink_dtype: torch.dtype = torch.float32) -> dict:
    """codec_attention's variant keywords: the softcap as given, sink logits near the rows' log-sum-exp (unit-scale
    logits: about 1 + log(length)), ALiBi's geometric slopes ``2 ** (-8 i / Hq)``."""
    out: dict = {} if softcap is None else {"softcap": softcap}
    gen = torch.Generator().manual_seed(seed + 99)
    if sinks:
        out["sinks"] = (2 + 1.5 * torch.randn(hq, generator=gen)).to(sink_dtype)
    if alibi:
        out["alibi"] = 2.0 ** (-8.0 * torch.arange(1, hq + 1) / hq)
    return out
