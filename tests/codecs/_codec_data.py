"""Data helpers and hypothesis strategies shared by the codec tests (imported by tests in this folder); the
hypothesis budget ``FAST`` comes from tests/codec_tiers.py."""

from __future__ import annotations

import torch
from codec_tiers import FAST
from hypothesis import strategies as st

from flashcodec_fx.codecs import LEVELS
from flashcodec_fx.codecs.levels import LLOYD_MAX_BITS

__all__ = ["DTYPES", "EPS", "FAST", "MANTISSA_BITS", "bit_table_and_levels", "png_exact_data", "randn"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
MANTISSA_BITS = {torch.float16: 11, torch.bfloat16: 8}


def png_exact_data(shape: tuple[int, ...], dtype: torch.dtype, seed: int, zeros: float = 0.1) -> torch.Tensor:
    """Values whose consecutive differences are exact in fp32 (the png codec's exactness condition).

    fp16/bf16: signed values whose magnitudes lie within a factor ``2**(24 - mantissa bits)`` of each other
    (2**13 for fp16, 2**16 for bf16), some exact zeros. fp32: integers times a power of two, ``|k| < 2**20``.
    """
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        k = torch.randint(-(2**20) + 1, 2**20, shape, generator=gen).float()
        x = k * 2.0 ** -int(torch.randint(0, 30, (), generator=gen))
    else:
        spread = 24 - MANTISSA_BITS[dtype]
        base = -8 if dtype == torch.float16 else -60
        exp = base + torch.randint(0, spread, shape, generator=gen)
        mant = 1 + torch.rand(shape, generator=gen)
        sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
        x = (sign * mant * torch.pow(2.0, exp.float())).to(dtype)
    x = torch.where(torch.rand(shape, generator=gen) < zeros, torch.zeros((), dtype=x.dtype), x)
    return x.to(dtype)


def randn(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def bit_table_and_levels(draw, axis: str, rows: int, levels=LEVELS) -> tuple[list[int], list[str]]:
    """Inside ``st.composite``: a valid per-row bit table (1-8 bits) and one level set per scale class of ``axis``
    (token: one class per row; channel: DC, then the AC rows): ``int`` rows get >= 2 bits, a ``uniform`` class one
    width, ``lloyd`` rows at most 6 bits."""
    bits = draw(st.lists(st.integers(1, 8), min_size=rows, max_size=rows))
    classes = [(j,) for j in range(rows)] if axis == "token" else [(0,)] + ([tuple(range(1, rows))] if rows > 1 else [])
    chosen = []
    for members in classes:
        lv = draw(st.sampled_from(levels))
        for j in members:
            bits[j] = max(2, bits[j]) if lv == "int" else min(LLOYD_MAX_BITS, bits[j]) if lv == "lloyd" else bits[j]
            bits[j] = bits[members[0]] if lv == "uniform" else bits[j]
        chosen.append(lv)
    return bits, chosen
