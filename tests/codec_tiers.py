"""Codec tiers and exact test data shared by the op and engine tests."""

from __future__ import annotations

import torch

from flashcodec_fx.codecs import Codec, make_codec


def tier_table(block_size: int, low_keep: int) -> dict[str, Codec]:
    """One codec per tier: jpeg K=r, jpeg K=``low_keep``, jpeg int8, png exact, png keep_ratio=0.5."""
    return {
        "jpeg": make_codec("jpeg", block_size=block_size),
        f"jpeg-k{low_keep}": make_codec("jpeg", block_size=block_size, keep_freqs=low_keep),
        "jpeg-int8": make_codec("jpeg", block_size=block_size, quant_bits=8),
        "png": make_codec("png", block_size=block_size),
        "png-half": make_codec("png", block_size=block_size, keep_ratio=0.5),
    }


def grid_data(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Multiples of 1/16 in [-16, 16]: exact in every dtype, and every difference is exact in fp32 (png exact)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-256, 257, shape, generator=gen).float() / 16).to(dtype)
