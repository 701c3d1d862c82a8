"""Codec tiers, exact test data and the hypothesis budget shared by the codec, op and engine tests."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings

from flashcodec_fx.codecs import Codec, make_codec

# Small on purpose: the codec and op suites have to fit in about a minute on 2 shared CPU cores.
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)

# The issue-9 key table (5,3,3,2,2,2,2,2 for r = 8), cut or padded with 2s for other block sizes.
KEY_TABLE = (5, 3, 3)
QUANT_TIERS = ("jpeg-table", "token-lloyd2", "channel-uniform4", "jpeg-midrise4", "token-tcq3")


def bit_table(block_size: int) -> tuple[int, ...]:
    """A per-frequency bit table for ``block_size`` rows: 5, 3, 3, then 2 bits."""
    return (KEY_TABLE + (2,) * block_size)[:block_size]


def tier_table(block_size: int, low_keep: int) -> dict[str, Codec]:
    """One codec per tier, blocks of ``block_size`` tokens where the tier has blocks.

    Seed tiers: ``jpeg`` (K = r, lossless up to fp rounding), ``jpeg-k{low_keep}`` (truncated), ``jpeg-int8`` (int8
    per (block, frequency)), ``png`` (exact), ``png-half`` (keep_ratio 0.5). Quantization-stage tiers (``QUANT_TIERS``,
    head_dim a multiple of 8), small versions of the presets' recipes:

    - ``jpeg-table``: keys as DCT blocks with a per-frequency bit table, per-channel scales over 2-block groups (DC
      uniform, one shared mid-rise AC step), clipping search, rotated, 2 raw sinks;
    - ``token-lloyd2``: values per token (block_size 1), 2-bit Lloyd-Max levels, centered and rotated, searched scale,
      2 sinks and a raw window of 3;
    - ``channel-uniform4``: tokens (block_size 1) 4-bit uniform per channel over ``block_size`` tokens (KIVI-style
      keys), searched, 2 sinks;
    - ``jpeg-midrise4``: DCT blocks, 4-bit mid-rise per (block, frequency), centered, seed-5 rotation, a window of 2;
    - ``token-tcq3``: keys per token, 3-bit trellis codes (``levels="tcq"``), centered and rotated, searched scale,
      2 sinks and a raw window of 3.

    ``png-window``: exact png with 1 sink and a raw window of ``block_size // 2`` (residual policy on the exact tier).
    """
    r = block_size
    return {
        "jpeg": make_codec("jpeg", block_size=r),
        f"jpeg-k{low_keep}": make_codec("jpeg", block_size=r, keep_freqs=low_keep),
        "jpeg-int8": make_codec("jpeg", block_size=r, quant_bits=8),
        "png": make_codec("png", block_size=r),
        "png-half": make_codec("png", block_size=r, keep_ratio=0.5),
        "png-window": make_codec("png", block_size=r, sinks=1, window=r // 2),
        "jpeg-table": make_codec("jpeg", block_size=r, quant_bits=bit_table(r), levels=("uniform", "midrise"),
                                 scale_axis="channel", group=2 * r, scale_search=True, rotate=True, sinks=2),
        "token-lloyd2": make_codec("jpeg", block_size=1, quant_bits=2, levels="lloyd", rotate=True, center=True,
                                   scale_search=True, sinks=2, window=3),
        "channel-uniform4": make_codec("jpeg", block_size=1, quant_bits=4, levels="uniform", scale_axis="channel",
                                       group=r, scale_search=True, sinks=2),
        "jpeg-midrise4": make_codec("jpeg", block_size=r, quant_bits=4, levels="midrise", center=True, rotate=5,
                                    window=2),
        "token-tcq3": make_codec("jpeg", block_size=1, quant_bits=3, levels="tcq", rotate=True, center=True,
                                 scale_search=True, sinks=2, window=3),
    }


def grid_data(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Multiples of 1/16 in [-16, 16]: exact in every dtype, and every difference is exact in fp32 (png exact)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-256, 257, shape, generator=gen).float() / 16).to(dtype)


def kv_like(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Cache-like data: a per-channel offset plus a random walk along seq (correlated neighbours), unit scale."""
    gen = torch.Generator().manual_seed(seed)
    *lead, s, d = shape
    walk = torch.randn(*lead, s, d, generator=gen).cumsum(-2) * 0.3
    return (walk + 2 * torch.randn(*lead, 1, d, generator=gen)).to(dtype)
