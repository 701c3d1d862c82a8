"""Sub-byte code packing along head_dim: a ``b``-bit code is split into power-of-two slices (8, 4, 2, 1 bits, widest
first), each slice packed densely into bytes, so a ``b``-bit row of ``D`` codes takes exactly ``b * D / 8`` bytes.

Slice ``k`` of width ``w`` holds bits ``shift_k .. shift_k + w - 1`` of every code; channel ``d`` sits in byte
``d * w // 8`` of that slice, at bit ``d * w % 8``. Every slice unpacks with one shift and mask, in torch and in
kernels alike (``b = 3`` is a 2-bit slice then a 1-bit slice).
"""

from __future__ import annotations

import functools

import torch

SLICE_WIDTHS = (8, 4, 2, 1)


@functools.cache
def slices(bits: int) -> tuple[tuple[int, int], ...]:
    """``((width, shift), ...)`` of a ``bits``-bit code, widest slice first (it holds the low bits)."""
    out, shift = [], 0
    for width in SLICE_WIDTHS:
        if bits - shift >= width:
            out.append((width, shift))
            shift += width
    return tuple(out)


def check_head_dim(head_dim: int, bits: int) -> None:
    """Each slice of width ``w`` fills whole bytes: ``head_dim`` a multiple of ``8 // w`` (8-bit codes: any)."""
    for width, _ in slices(bits):
        if head_dim % (8 // width):
            raise ValueError(f"{bits}-bit packed codes need a head_dim that is a multiple of {8 // width} (their "
                             f"{width}-bit slice fills whole bytes), got {head_dim}; 8-bit codes and float rows take "
                             "any head_dim")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes (..., D)`` integers in ``0 .. 2**bits - 1`` -> ``(..., bits * D // 8)`` uint8."""
    *lead, dim = codes.shape
    check_head_dim(dim, bits)
    codes = codes.to(torch.int32)
    parts = []
    for width, shift in slices(bits):
        per_byte = 8 // width
        part = ((codes >> shift) & ((1 << width) - 1)).reshape(*lead, dim // per_byte, per_byte)
        weights = torch.tensor([1 << (width * i) for i in range(per_byte)], dtype=torch.int32, device=codes.device)
        parts.append((part * weights).sum(-1))
    return torch.cat(parts, dim=-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``(..., bits * D // 8)`` uint8 -> ``(..., D)`` int32 codes."""
    *lead, nbytes = packed.shape
    if nbytes != bits * head_dim // 8:
        raise ValueError(f"packed rows of {bits}-bit codes over head_dim={head_dim} have {bits * head_dim // 8} bytes, "
                         f"got {nbytes}")
    packed = packed.to(torch.int32)
    codes = torch.zeros(*lead, head_dim, dtype=torch.int32, device=packed.device)
    start = 0
    for width, shift in slices(bits):
        per_byte = 8 // width
        count = head_dim // per_byte
        shifts = torch.arange(per_byte, dtype=torch.int32, device=packed.device) * width
        part = (packed[..., start: start + count, None] >> shifts) & ((1 << width) - 1)
        codes |= part.reshape(*lead, head_dim) << shift
        start += count
    return codes
