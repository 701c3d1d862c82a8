"""Per-channel normalization against outlier channels: a stream is stored divided by a power of two per channel.

Some models carry a few key or value channels tens of times larger than the rest (Qwen2's keys). After the rotation
their energy sets every channel's quantization step, so the codes of every other channel lose most of their
precision. A codec with ``normalize=True`` measures each channel's spread on the prompt (the first append's tokens
past the sinks, the ones that set the mean) and stores channel ``c`` divided by

    n_c = 2 ** floor(log2(max(1, spread_c / (OUTLIER_RATIO * median_c' spread_c'))))

so a channel more than ``OUTLIER_RATIO`` times wider than the median channel is brought back to within that ratio,
and a stream without outliers is stored as before (``n = 1``). Attention is unchanged: ``q . k = (q * n_k) . (k /
n_k)`` and ``sum p v = n_v * sum p (v / n_v)``; powers of two scale floats exactly, so raw rows (sinks, tail) keep
their bits and their products round as before. The state keeps the exponents, one uint8 per channel.
"""

from __future__ import annotations

import torch

OUTLIER_RATIO = 2.0  # a channel wider than this many median channels is scaled down (by powers of two)
NORM_DTYPE = torch.uint8  # stored exponents: n_c = 2 ** e_c
MAX_EXPONENT = 15  # n <= 2 ** 15: representable in every stream dtype (fp16 included)


def channel_exponents(x: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """``x (..., T, D)`` tokens, ``counted (T,)`` bool: the tokens measured -> exponents ``e (..., D)`` uint8 with
    ``n = 2 ** e`` as in the module docstring (all zero when fewer than two tokens are counted: no spread)."""
    w = counted.to(torch.float32).view(-1, 1)
    count = w.sum()
    xf = x.float()
    mean = (xf * w).sum(-2, keepdim=True) / count.clamp_min(1)
    spread = (((xf - mean) ** 2) * w).sum(-2) / count.clamp_min(1)  # variance per channel (..., D)
    typical = spread.median(-1, keepdim=True).values * OUTLIER_RATIO ** 2
    ratio = torch.where(typical > 0, spread / torch.where(typical > 0, typical, torch.ones_like(typical)),
                        torch.ones_like(spread))
    exponent = torch.floor(torch.log2(ratio.clamp_min(1.0)) / 2)  # variance ratio 4**e <-> scale 2**e
    return torch.where(count > 1, exponent, torch.zeros_like(exponent)).clamp(0, MAX_EXPONENT).to(NORM_DTYPE)


def channel_factors(exponents: torch.Tensor) -> torch.Tensor:
    """``e (..., D)`` uint8 -> ``2 ** e`` fp32."""
    return torch.exp2(exponents.float())
