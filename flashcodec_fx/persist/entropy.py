"""Byte coders for the planes (:mod:`.planes`): entropy coders from well-kept libraries, chosen per plane.

- ``"raw"``: the bytes as they are;
- ``"zstd"``: Zstandard (``zstandard``; LZ matches + Huffman-coded literals, fast both ways), with its frame checksum;
- ``"ppmd"``: PPMd variant I of order 2 (``pyppmd``, 7-Zip's context-modelling coder): each byte is coded in the
  context of the two before it, in a channel-major plane the same channel's two previous tokens. Slower than zstd,
  and what reaches the smallest size on K/V exponents (benchmarks/bench_lossless.py).

Both libraries are imported on first use; a missing one raises ``ImportError`` naming the package.
"""

from __future__ import annotations

import importlib

CODERS = ("raw", "zstd", "ppmd")
ZSTD_LEVEL = 3
PPMD_ORDER = 2
PPMD_MEMORY = 16 << 20
_PACKAGES = {"zstd": ("zstandard", "zstandard"), "ppmd": ("pyppmd", "pyppmd")}


def check_coder(coder: str) -> None:
    if coder not in CODERS:
        raise ValueError(f"coder must be one of {CODERS}, got {coder!r}")


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
    return _module("ppmd").compress(data, max_order=PPMD_ORDER, mem_size=PPMD_MEMORY, variant="I")


def decompress(blob: bytes, coder: str, size: int) -> bytes:
    """Inverse of :func:`compress`; ``size``: the decoded length, checked (``ValueError`` on a damaged blob)."""
    check_coder(coder)
    try:
        if coder == "raw":
            out = bytes(blob)
        elif coder == "zstd":
            out = _module("zstd").ZstdDecompressor().decompress(blob, max_output_size=size)
        else:
            out = _module("ppmd").decompress(blob, max_order=PPMD_ORDER, mem_size=PPMD_MEMORY, variant="I")
    except ImportError:
        raise
    except Exception as err:  # each library raises its own error type for damaged input
        raise ValueError(f"damaged {coder} data: {err}") from None
    if len(out) != size:
        raise ValueError(f"damaged {coder} data: decoded {len(out)} bytes, expected {size}")
    return out
