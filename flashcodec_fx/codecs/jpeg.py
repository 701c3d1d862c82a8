"""`jpeg`: orthonormal DCT-II per block of r tokens, lowest K coefficients kept, optionally int8."""

from __future__ import annotations

import torch

from .base import JPEG, Codec, Encoded
from .dct import dct_basis
from .quant import SUPPORTED_QUANT_BITS, dequantize_rows, quantize_rows


class JPEGCodec(Codec):
    """Keep the lowest ``keep_freqs`` DCT coefficients of each block of ``block_size`` tokens.

    ``keep_freqs == block_size`` is lossless up to fp rounding. ``quant_bits=8`` stores int8 codes with
    a per-(block, frequency) fp32 scale over head_dim. Unquantized coefficients keep the stream dtype.
    """

    mode = JPEG

    def __init__(self, block_size: int = 8, keep_freqs: int | None = None, quant_bits: int | None = None):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"block_size must be an int >= 2, got {block_size!r}")
        keep = block_size if keep_freqs is None else keep_freqs
        if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= block_size:
            raise ValueError(f"keep_freqs must be an int in 1..{block_size} (block_size), got {keep_freqs!r}")
        if quant_bits is not None and (isinstance(quant_bits, bool) or not isinstance(quant_bits, int)
                                       or quant_bits not in SUPPORTED_QUANT_BITS):
            raise ValueError(f"quant_bits must be None or one of {SUPPORTED_QUANT_BITS}, got {quant_bits!r}")
        self.block_size = block_size
        self.keep_freqs = keep
        self.rows = keep
        self.quant_bits = quant_bits or 0

    def __repr__(self) -> str:
        return f"JPEGCodec(block_size={self.block_size}, keep_freqs={self.keep_freqs}, quant_bits={self.quant_bits or None})"

    def storage_dtype(self, stream_dtype: torch.dtype) -> torch.dtype:
        return torch.int8 if self.quant_bits else stream_dtype

    def synthesis(self, device=None) -> torch.Tensor:
        return dct_basis(self.block_size, device)[: self.keep_freqs].T.contiguous()

    def encode(self, x: torch.Tensor) -> Encoded:
        """``x (..., NB * r, D)`` -> coefficients ``(..., NB, K, D)`` (+ scales when quantized)."""
        blocks = self.blockify(x).float()
        analysis = dct_basis(self.block_size, x.device)[: self.keep_freqs]
        coeffs = analysis @ blocks
        lead = coeffs.shape[:-2]
        index = torch.zeros(*lead, 0, x.shape[-1], dtype=torch.uint8, device=x.device)
        if self.quant_bits:
            codes, scale = quantize_rows(coeffs, self.quant_bits)
            return Encoded(codes, scale, index)
        return Encoded(coeffs.to(x.dtype), torch.zeros(*lead, 0, device=x.device), index)

    def stored_rows(self, enc: Encoded) -> torch.Tensor:
        if self.quant_bits:
            return dequantize_rows(enc.data, enc.scale)
        return enc.data.float()

    def decode(self, enc: Encoded, dtype: torch.dtype) -> torch.Tensor:
        """``(..., NB, K, D)`` -> ``(..., NB * r, D)`` in ``dtype``: ``M[:K].T @ C``."""
        blocks = self.synthesis(enc.data.device) @ self.stored_rows(enc)
        return blocks.flatten(-3, -2).to(dtype)
