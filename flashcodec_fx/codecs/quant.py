"""Symmetric integer quantizer with one fp32 scale per stored row of a block (over head_dim)."""

from __future__ import annotations

import torch

SUPPORTED_QUANT_BITS = (8,)


def qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def quantize_rows(rows: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``rows (..., R, D)`` to int8 codes with a per-row scale ``(..., R)`` fp32.

    ``codes * scale[..., None]`` rebuilds the rows; the error of each value is at most ``scale / 2``.
    """
    x = rows.float()
    scale = x.abs().amax(dim=-1) / qmax(bits)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x / safe[..., None]).clamp_(-qmax(bits), qmax(bits)).to(torch.int8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: ``(..., R, D)`` int8 and ``(..., R)`` fp32 -> fp32 rows."""
    return codes.float() * scale[..., None]
