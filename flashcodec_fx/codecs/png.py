"""`png`: per-block anchor + first-order deltas in fp32, rebuilt by a sequential cumsum."""

from __future__ import annotations

import math

import torch

from .base import PNG, Codec, Encoded


class PNGCodec(Codec):
    """Store each block of ``block_size`` tokens as its first token (the anchor) and ``r - 1`` deltas, fp32.

    ``keep_ratio=1.0`` is exact whenever every consecutive difference is representable in fp32: always
    for values within a factor 2**13 (fp16) / 2**16 (bf16) of each other, and whenever one is zero.
    ``keep_ratio < 1`` keeps, per (block, channel), the ``ceil(keep_ratio * (r - 1))`` largest deltas by
    magnitude with their uint8 positions (lossy). Blocks are at most 256 tokens.
    """

    mode = PNG
    quant_bits = 0

    def __init__(self, block_size: int = 8, keep_ratio: float = 1.0):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 2 <= block_size <= 256:
            raise ValueError(f"block_size must be an int in 2..256 for png, got {block_size!r}")
        if isinstance(keep_ratio, bool) or not isinstance(keep_ratio, (int, float)) or not 0 < keep_ratio <= 1:
            raise ValueError(f"keep_ratio must be a float in (0, 1], got {keep_ratio!r}")
        self.block_size = block_size
        self.keep_ratio = float(keep_ratio)
        self.kept_deltas = max(1, math.ceil(self.keep_ratio * (block_size - 1) - 1e-9))
        self.pruned = self.kept_deltas < block_size - 1
        self.rows = 1 + self.kept_deltas

    def __repr__(self) -> str:
        return f"PNGCodec(block_size={self.block_size}, keep_ratio={self.keep_ratio})"

    @property
    def index_rows(self) -> int:
        return self.kept_deltas if self.pruned else 0

    @property
    def dense_rows(self) -> int:
        return self.block_size

    def storage_dtype(self, stream_dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def synthesis(self, device=None) -> torch.Tensor:
        return torch.tril(torch.ones(self.block_size, self.block_size, device=device))

    def encode(self, x: torch.Tensor) -> Encoded:
        """``x (..., NB * r, D)`` -> ``(..., NB, 1 + M, D)`` fp32 anchor + deltas (+ uint8 positions)."""
        blocks = self.blockify(x).float()
        deltas = blocks[..., 1:, :] - blocks[..., :-1, :]
        lead = blocks.shape[:-2]
        scale = torch.zeros(*lead, 0, device=x.device)
        if not self.pruned:
            index = torch.zeros(*lead, 0, x.shape[-1], dtype=torch.uint8, device=x.device)
            return Encoded(torch.cat([blocks[..., :1, :], deltas], dim=-2), scale, index)
        top = deltas.abs().topk(self.kept_deltas, dim=-2, sorted=False).indices
        kept = deltas.gather(-2, top)
        return Encoded(torch.cat([blocks[..., :1, :], kept], dim=-2), scale, top.to(torch.uint8))

    def stored_rows(self, enc: Encoded) -> torch.Tensor:
        if not self.pruned:
            return enc.data.float()
        lead, dim = enc.data.shape[:-2], enc.data.shape[-1]
        deltas = enc.data.new_zeros(*lead, self.block_size - 1, dim)
        deltas.scatter_(-2, enc.index.long(), enc.data[..., 1:, :])
        return torch.cat([enc.data[..., :1, :], deltas], dim=-2)

    def decode(self, enc: Encoded, dtype: torch.dtype) -> torch.Tensor:
        """Sequential fp32 cumsum over each block (exact where the deltas are), cast to ``dtype``."""
        rows = self.stored_rows(enc)
        out = [rows[..., 0, :]]
        for i in range(1, self.block_size):
            out.append(out[-1] + rows[..., i, :])
        return torch.stack(out, dim=-2).flatten(-3, -2).to(dtype)
