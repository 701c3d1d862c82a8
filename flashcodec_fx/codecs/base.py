"""What every codec shares: the stored state of a block stream and the linear-map contract."""

from __future__ import annotations

from typing import NamedTuple

import torch

JPEG, PNG = 0, 1
MODE_NAMES = {JPEG: "jpeg", PNG: "png"}


class Encoded(NamedTuple):
    """Stored form of ``NB`` blocks of a ``(..., NB * r, D)`` stream.

    data:  ``(..., NB, R, D)`` stored rows (stream dtype, int8 codes, or fp32 deltas).
    scale: ``(..., NB, R)`` fp32 per-row scales when quantized, else ``(..., NB, 0)``.
    index: ``(..., NB, M, D)`` uint8 positions of kept png deltas when pruned, else ``(..., NB, 0, D)``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    index: torch.Tensor


class Codec:
    """A linear map along seq: a block ``X (r, D)`` is ``A @ S`` with ``S`` the dense stored rows.

    Subclasses define ``encode``/``decode`` and ``synthesis``; ``spec`` packs the codec into the
    ``int[]`` that the ``torch.ops.flashcodec`` ops take: ``[mode, block_size, rows, quant_bits]``.
    """

    mode: int
    block_size: int
    rows: int
    quant_bits: int

    @property
    def spec(self) -> list[int]:
        return [self.mode, self.block_size, self.rows, self.quant_bits]

    @property
    def index_rows(self) -> int:
        return 0

    @property
    def dense_rows(self) -> int:
        """Rows ``R`` of the dense ``S`` in ``X = A @ S`` (after dequantization / index scatter)."""
        return self.rows

    def storage_dtype(self, stream_dtype: torch.dtype) -> torch.dtype:
        raise NotImplementedError

    def empty_state(self, lead: tuple[int, ...], blocks: int, head_dim: int, stream_dtype: torch.dtype,
                    device: torch.device | str | None) -> Encoded:
        """Zeroed storage for ``blocks`` blocks: shapes as in :class:`Encoded`."""
        scale_rows = self.rows if self.quant_bits else 0
        return Encoded(
            torch.zeros(*lead, blocks, self.rows, head_dim, dtype=self.storage_dtype(stream_dtype), device=device),
            torch.zeros(*lead, blocks, scale_rows, dtype=torch.float32, device=device),
            torch.zeros(*lead, blocks, self.index_rows, head_dim, dtype=torch.uint8, device=device),
        )

    def bytes_per_block(self, head_dim: int, stream_dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=self.storage_dtype(stream_dtype)).element_size()
        scale = 4 * self.rows if self.quant_bits else 0
        return self.rows * head_dim * item + scale + self.index_rows * head_dim

    def blockify(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., NB * r, D)`` -> ``(..., NB, r, D)``; the seq length must be a multiple of r."""
        *lead, seq, dim = x.shape
        if seq % self.block_size:
            raise ValueError(f"x: seq length {seq} is not a multiple of block_size={self.block_size}")
        return x.reshape(*lead, seq // self.block_size, self.block_size, dim)

    def encode(self, x: torch.Tensor) -> Encoded:
        raise NotImplementedError

    def decode(self, enc: Encoded, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def stored_rows(self, enc: Encoded) -> torch.Tensor:
        """Dense fp32 ``S (..., NB, R, D)`` with each block equal to ``synthesis() @ S``."""
        raise NotImplementedError

    def synthesis(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``A (r, R)`` fp32 such that a block is ``A @ stored_rows``."""
        raise NotImplementedError
