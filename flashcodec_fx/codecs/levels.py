"""Level sets of the quantizer: the value a ``b``-bit code ``c`` in ``0 .. 2**b - 1`` stands for, before scaling.

A stored value is ``level[c] * scale + zero``:

- ``int``: symmetric mid-tread integers ``c - 2**(b-1)``, codes kept in ``1 .. 2**b - 1`` (``-qmax .. qmax``, the
  classic int8 grid; needs ``b >= 2``); scale from the largest magnitude: ``amax / qmax``.
- ``uniform``: asymmetric ``c`` in ``0 .. 2**b - 1`` with a zero point (the minimum): ``(max - min) / (2**b - 1)``.
- ``midrise``: symmetric ``c - 2**(b-1) + 1/2`` (no zero level): scale ``amax / 2**(b-1)``.
- ``lloyd``: Lloyd-Max levels of a unit Gaussian (minimum mean squared error for normal data), scale = the RMS;
  1..6 bits.
- ``tcq``: trellis-coded quantization (``trellis.py``): a code's value depends on the three codes before it in its
  row, ``alphabet[index] * scale`` (the table below is the ``2**(b+1)`` alphabet); token-axis scales, 1..4 bits.
"""

from __future__ import annotations

import functools
import math

import torch

from . import trellis

LEVELS = ("int", "uniform", "midrise", "lloyd")  # scalar level sets: a code's value is its own
LEVEL_SETS = (*LEVELS, "tcq")  # every ``levels`` name: the scalar ones, then trellis codes
MAX_BITS = 8
LLOYD_MAX_BITS = 6
_LLOYD_ITERATIONS = 100_000  # at most; stops once no level moves by more than _LLOYD_TOLERANCE of the level spacing
_LLOYD_TOLERANCE = 1e-7  # (float64 Gaussian tail masses leave a ~1e-8 floor at 8 bits)
_LLOYD_RELAXATION = 1.9


def qmax(bits: int) -> int:
    """Largest code magnitude of the symmetric ``int`` grid: ``2**(bits-1) - 1``."""
    return (1 << (bits - 1)) - 1


def check_levels(name: str, levels: str, bits: int) -> None:
    if not isinstance(levels, str):
        raise TypeError(f"{name} must be one of {LEVEL_SETS}, got {type(levels).__name__} {levels!r}")
    if levels not in LEVEL_SETS:
        raise ValueError(f"{name} must be one of {LEVEL_SETS}, got {levels!r}")
    if levels == "int" and bits < 2:
        raise ValueError(f"{name}='int' needs at least 2 bits (1 bit has no symmetric integer grid), got {bits}")
    if levels == "lloyd" and bits > LLOYD_MAX_BITS:
        raise ValueError(f"{name}='lloyd' is for 1..{LLOYD_MAX_BITS} bits (above, a uniform grid is as good); got {bits}: "
                         f"use 'int' or 'uniform'")
    if levels == "tcq":
        trellis.check_bits(name, bits)


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


@functools.cache
def _lloyd_max(bits: int) -> tuple[float, ...]:
    """Lloyd-Max quantizer of N(0, 1) with ``2**bits`` levels: alternate midpoint thresholds and interval centroids
    (closed form for a Gaussian: ``(pdf(a) - pdf(b)) / (cdf(b) - cdf(a))``), float64, started from the
    high-resolution optimum (level density ~ pdf**(1/3): the quantiles of N(0, 3)), which converges in few steps."""
    n = 1 << bits
    quantiles = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    levels = math.sqrt(3) * math.sqrt(2) * torch.erfinv(2 * quantiles - 1)
    for _ in range(_LLOYD_ITERATIONS):
        edges = torch.cat([torch.tensor([-math.inf], dtype=torch.float64), (levels[1:] + levels[:-1]) / 2,
                           torch.tensor([math.inf], dtype=torch.float64)])
        lo, hi = edges[:-1], edges[1:]
        mass = (_normal_cdf(hi) - _normal_cdf(lo)).clamp_min(1e-300)
        step = (_normal_pdf(lo) - _normal_pdf(hi)) / mass - levels
        if step.abs().max() < _LLOYD_TOLERANCE * (levels[1:] - levels[:-1]).min():
            break
        levels = levels + _LLOYD_RELAXATION * step  # over-relaxed Lloyd step: same fixed point, far fewer steps
    return tuple(levels.tolist())


@functools.cache
def _table(levels: str, bits: int) -> tuple[float, ...]:
    n = 1 << bits
    if levels == "int":
        return tuple(float(c - (n >> 1)) for c in range(n))
    if levels == "uniform":
        return tuple(float(c) for c in range(n))
    if levels == "midrise":
        return tuple(c - (n >> 1) + 0.5 for c in range(n))
    if levels == "tcq":
        return trellis.ALPHABETS[bits]
    return _lloyd_max(bits)


def level_table(levels: str, bits: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``(2**bits,)`` fp32: the unscaled value of each code (one copy per device, cached); ``tcq``: its
    ``(2**(bits+1),)`` alphabet, indexed by ``trellis.alphabet_index``."""
    check_levels("levels", levels, bits)
    return _on_device(levels, bits, str(torch.device("cpu") if device is None else torch.device(device)))


@functools.lru_cache(maxsize=256)
def _on_device(levels: str, bits: int, device: str) -> torch.Tensor:
    return torch.tensor(_table(levels, bits), dtype=torch.float32, device=device)


def code_range(levels: str, bits: int) -> tuple[int, int]:
    """Inclusive range of codes the encoder may emit (``int`` skips code 0, keeping the grid symmetric)."""
    return (1 if levels == "int" else 0), (1 << bits) - 1


def rms_sqrt(mean_square: torch.Tensor) -> torch.Tensor:
    """``sqrt`` of fp32 ``mean_square``, correctly rounded (IEEE), as C++ ``std::sqrt`` and Triton's ``sqrt_rn`` take
    it. torch 2.13's CPU ``sqrt`` is not (about 20% of fp32 results one ulp off, measured on AVX2): the root is taken
    in fp64 and rounded once to fp32, which is the correctly rounded fp32 root."""
    return mean_square.double().sqrt().float()


def base_scale(levels: str, bits: int, x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial ``(scale, zero)`` of each slice of ``x`` reduced over ``dims`` (keepdim), before any search:
    the no-clipping scale of the level set (``lloyd``: the RMS). ``zero`` is 0 except for ``uniform``."""
    if levels == "uniform":
        low, high = x.amin(dims, keepdim=True), x.amax(dims, keepdim=True)
        return (high - low) / ((1 << bits) - 1), low
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if levels in ("lloyd", "tcq"):  # the RMS, its square root correctly rounded (torch's CPU sqrt is not: rms_sqrt)
        return rms_sqrt(x.square().mean(dims, keepdim=True)), zero
    amax = x.abs().amax(dims, keepdim=True)
    return amax / (qmax(bits) if levels == "int" else (1 << (bits - 1))), zero
