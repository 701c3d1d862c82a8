"""Byte coders for the planes (:mod:`.planes`): entropy coders from well-kept libraries, chosen per plane.

- ``"raw"``: the bytes as they are;
- ``"zstd"``: Zstandard (``zstandard``; LZ matches + Huffman-coded literals, fast both ways), with its frame checksum;
- ``"ppmd"``: PPMd variant I of order 2 (``pyppmd``, 7-Zip's context-modelling coder): each byte is coded in the
  context of the two before it, in a channel-major plane the same channel's two previous tokens. Slower than zstd,
  and what reaches the smallest size on K/V exponents (benchmarks/bench_lossless.py). pyppmd 1.x does not round-trip
  every input (deterministically, mostly near-random bytes): :func:`compress` decodes what it coded and raises
  :class:`RoundTripError` where that fails, so a caller codes that plane otherwise; nothing inexact is ever returned.

Both libraries are imported on first use; a missing one raises ``ImportError`` naming the package.
"""

from __future__ import annotations

import importlib

from ..codecs.base import check_choice

CODERS = ("raw", "zstd", "ppmd")
ZSTD_LEVEL = 3
PPMD_ORDER = 2
PPMD_MEMORY = 16 << 20
_PACKAGES = {"zstd": ("zstandard", "zstandard"), "ppmd": ("pyppmd", "pyppmd")}


class RoundTripError(ValueError):
    """A coder could not give the bytes back: :func:`compress` checks ``ppmd`` and raises this instead of returning."""


def check_coder(coder: str) -> None:
    check_choice("coder", coder, CODERS)


def _module(coder: str):
    module, package = _PACKAGES[coder]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"the {coder!r} byte coder needs the {package} package: pip install {package} "
                          f"(or pip install 'flashcodec-fx[hf]')") from err


def compress(data: bytes, coder: str) -> bytes:
    """``data`` coded by ``coder`` (one of :data:`CODERS`)."""
    check_coder(coder)
    if coder == "raw":
        return bytes(data)
    if coder == "zstd":
        return _module("zstd").ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True,
                                              write_content_size=True).compress(data)
    ppmd = _module("ppmd")
    coded = ppmd.compress(data, max_order=PPMD_ORDER, mem_size=PPMD_MEMORY, variant="I")
    if _ppmd_decompress(coded) != data:  # pyppmd 1.x fails to round-trip some inputs (deterministically)
        raise RoundTripError(f"ppmd does not give these {len(data)} bytes back (a pyppmd defect); code them otherwise")
    return coded


def _ppmd_decompress(blob: bytes) -> bytes | None:
    try:
        return _module("ppmd").decompress(blob, max_order=PPMD_ORDER, mem_size=PPMD_MEMORY, variant="I")
    except ImportError:
        raise
    except Exception:  # pyppmd raises its own error type for data it cannot decode
        return None


def decompress(blob: bytes, coder: str, size: int) -> bytes:
    """Inverse of :func:`compress`; ``size``: the decoded length, checked (``ValueError`` on a damaged blob)."""
    check_coder(coder)
    if coder == "raw":
        out = bytes(blob)
    elif coder == "ppmd":
        out = _ppmd_decompress(blob)
    else:
        zstd = _module("zstd")
        try:
            out = zstd.ZstdDecompressor().decompress(blob, max_output_size=size)
        except zstd.ZstdError as err:
            raise ValueError(f"damaged zstd data: {err}") from None
    if out is None or len(out) != size:
        raise ValueError(f"damaged {coder} data: decoded {None if out is None else len(out)} bytes, expected {size}")
    return out
