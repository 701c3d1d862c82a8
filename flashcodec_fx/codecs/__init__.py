"""Stateless codec math: DCT basis, quantizer, and the `jpeg` / `png` block codecs."""

from __future__ import annotations

import functools

from .base import JPEG, MODE_NAMES, PNG, Codec, Encoded
from .dct import dct_basis
from .jpeg import JPEGCodec
from .png import PNGCodec
from .quant import dequantize_rows, quantize_rows

_OPTIONS = {"jpeg": ("block_size", "keep_freqs", "quant_bits"), "png": ("block_size", "keep_ratio")}


def make_codec(mode: str, **options) -> Codec:
    """Build a codec by name: ``make_codec("jpeg", block_size=8, keep_freqs=8, quant_bits=8)``,
    ``make_codec("png", block_size=8, keep_ratio=1.0)``."""
    if mode not in _OPTIONS:
        raise ValueError(f"mode must be one of {sorted(_OPTIONS)}, got {mode!r}")
    unknown = sorted(set(options) - set(_OPTIONS[mode]))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for mode={mode!r}; allowed: {list(_OPTIONS[mode])}")
    return JPEGCodec(**options) if mode == "jpeg" else PNGCodec(**options)


def codec_from_spec(spec: list[int] | tuple[int, ...]) -> Codec:
    """Inverse of ``Codec.spec``: ``[mode, block_size, rows, quant_bits]`` -> codec (memoized)."""
    if len(spec) != 4:
        raise ValueError(f"spec must be [mode, block_size, rows, quant_bits], got {list(spec)!r}")
    return _codec_from_spec(*(int(v) for v in spec))


@functools.lru_cache(maxsize=256)
def _codec_from_spec(mode: int, block_size: int, rows: int, quant_bits: int) -> Codec:
    if mode == JPEG:
        return JPEGCodec(block_size, rows, quant_bits or None)
    if mode == PNG:
        if quant_bits:
            raise ValueError(f"spec quant_bits must be 0 for png, got {quant_bits}")
        if not 2 <= rows <= block_size:
            raise ValueError(f"spec rows must be in 2..{block_size} for png, got {rows}")
        codec = PNGCodec(block_size, (rows - 1) / (block_size - 1))
        if codec.rows != rows:
            raise ValueError(f"spec rows={rows} does not round-trip for png block_size={block_size}")
        return codec
    raise ValueError(f"spec mode must be {JPEG} (jpeg) or {PNG} (png), got {mode}")


__all__ = [
    "JPEG", "PNG", "MODE_NAMES", "Codec", "Encoded", "JPEGCodec", "PNGCodec", "codec_from_spec",
    "dct_basis", "dequantize_rows", "make_codec", "quantize_rows",
]
