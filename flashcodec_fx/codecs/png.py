"""`png`: per-block anchor + first-order deltas in fp32, rebuilt by a sequential cumsum."""

from __future__ import annotations

import functools
import math

import torch

from .base import Codec, Encoded, check_count
from .quant import SCALE_DTYPE
from .registry import SpecFields, register_codec

MAX_BLOCK = 256  # kept-delta positions are stored as uint8


@functools.lru_cache(maxsize=256)
def _prefix_sum(block_size: int, device: str) -> torch.Tensor:
    """Lower-triangular ones ``(r, r)``: a block is the prefix sum of its anchor and deltas (one copy per device)."""
    return torch.tril(torch.ones(block_size, block_size, device=device))


@register_codec
class PNGCodec(Codec):
    """Store each block of ``block_size`` tokens as its first token (the anchor) and ``r - 1`` deltas, fp32.

    ``keep_ratio=1.0`` is exact whenever every consecutive difference is representable in fp32: always
    for values within a factor 2**13 (fp16) / 2**16 (bf16) of each other, and whenever one is zero.
    ``keep_ratio < 1`` keeps, per (block, channel), the ``ceil(keep_ratio * (r - 1))`` largest deltas by
    magnitude with their uint8 positions (lossy). Blocks are at most 256 tokens. ``sinks`` / ``window``: raw first /
    newest tokens, as for jpeg.
    """

    name = "png"

    def __init__(self, block_size: int = 8, keep_ratio: float = 1.0, *, sinks: int = 0, window: int = 0):
        block_size = check_count("block_size", block_size, least=2)
        if block_size > MAX_BLOCK:
            raise ValueError(f"block_size must be an int in 2..{MAX_BLOCK} for png, got {block_size!r}")
        if isinstance(keep_ratio, bool) or not isinstance(keep_ratio, (int, float)):
            raise TypeError(f"keep_ratio must be a float in (0, 1], got {type(keep_ratio).__name__} {keep_ratio!r}")
        if not 0 < keep_ratio <= 1:
            raise ValueError(f"keep_ratio must be a float in (0, 1], got {keep_ratio!r}")
        self.block_size = block_size
        self.keep_ratio = float(keep_ratio)
        self.kept_deltas = max(1, math.ceil(self.keep_ratio * (block_size - 1) - 1e-9))
        self.pruned = self.kept_deltas < block_size - 1
        self.rows = 1 + self.kept_deltas
        self._set_residual(sinks, window)

    def __repr__(self) -> str:
        return f"PNGCodec({self.spec})"

    def spec_fields(self) -> dict[str, str | int]:
        return {"r": self.block_size, "kept": self.kept_deltas}

    @classmethod
    def from_spec_fields(cls, fields: SpecFields) -> PNGCodec:
        r, kept = fields.int("r"), fields.int("kept")
        if not 1 <= kept < r:
            raise ValueError(f"spec kept must be in 1..{r - 1} for png block_size={r}, got {kept}")
        return cls(r, kept / (r - 1), sinks=fields.int("sinks"), window=fields.int("window"))

    @property
    def index_rows(self) -> int:
        return self.kept_deltas if self.pruned else 0

    @property
    def dense_rows(self) -> int:
        return self.block_size

    def archive_shapes(self, head_dim, stream_dtype):
        return {"data": ((self.rows, head_dim), torch.float32), "scale": ((0,), SCALE_DTYPE),
                "zero": ((0,), SCALE_DTYPE), "index": ((self.index_rows, head_dim), torch.uint8)}

    def synthesis(self, device=None) -> torch.Tensor:
        return _prefix_sum(self.block_size, str(torch.device("cpu") if device is None else torch.device(device)))

    def encode_rows(self, blocks: torch.Tensor, dtype: torch.dtype) -> Encoded:
        """``(..., NB, r, D)`` -> ``(..., NB, 1 + M, D)`` fp32 anchor + deltas (+ uint8 positions)."""
        deltas = blocks[..., 1:, :] - blocks[..., :-1, :]
        lead = blocks.shape[:-2]
        scale, zero = (torch.zeros(*lead, 0, dtype=SCALE_DTYPE, device=blocks.device) for _ in range(2))
        if not self.pruned:
            index = torch.zeros(*lead, 0, blocks.shape[-1], dtype=torch.uint8, device=blocks.device)
            return Encoded(torch.cat([blocks[..., :1, :], deltas], dim=-2), scale, zero, index)
        top = deltas.abs().topk(self.kept_deltas, dim=-2, sorted=False).indices
        kept = deltas.gather(-2, top)
        return Encoded(torch.cat([blocks[..., :1, :], kept], dim=-2), scale, zero, top.to(torch.uint8))

    def stored_rows(self, enc: Encoded, head_dim: int) -> torch.Tensor:
        if not self.pruned:
            return enc.data.float()
        lead, dim = enc.data.shape[:-2], enc.data.shape[-1]
        deltas = enc.data.new_zeros(*lead, self.block_size - 1, dim)
        deltas.scatter_(-2, enc.index.long(), enc.data[..., 1:, :])
        return torch.cat([enc.data[..., :1, :], deltas], dim=-2)

    def decode(self, enc: Encoded, dtype: torch.dtype, mean: torch.Tensor | None = None) -> torch.Tensor:
        """Sequential fp32 cumsum over each block (exact where the deltas are), cast to ``dtype``."""
        rows = self.stored_rows(enc, enc.data.shape[-1])
        out = [rows[..., 0, :]]
        for i in range(1, self.block_size):
            out.append(out[-1] + rows[..., i, :])
        return torch.stack(out, dim=-2).flatten(-3, -2).to(dtype)
