"""Hypothesis budget and data helpers shared by the codec tests (imported by tests in this folder)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings

# Small on purpose: the whole codec suite has to fit in about a minute on 2 shared CPU cores.
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)

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
