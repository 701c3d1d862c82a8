"""Fused C++ (OpenMP) CPU kernels of the vLLM plugin: store into pages and attention on them (``kernels.py`` calls
them; ``reference.py`` is their spec). Built on first use like the cache's kernels (``flashcodec_fx.ops.cpu.build``),
from the shared ``common.h``, ``pool.h``, ``token_simd.h`` (the SIMD loops on packed codes) and ``quantize.h`` (the
quantizer, which the cache's append shares) and this folder's sources."""

from __future__ import annotations

import functools
from pathlib import Path

from ...ops.cpu.build import Extension, compile_extension

_HERE = Path(__file__).resolve().parent
_OPS = _HERE.parent.parent / "ops" / "cpu"
SOURCES = (_OPS / "common.h", _OPS / "trellis.h", _OPS / "pool.h", _OPS / "token_simd.h", _OPS / "quantize.h",
           _HERE / "page.h", _HERE / "paged_store.cpp", _HERE / "paged_attention.cpp", _HERE / "paged_prefill.cpp",
           _HERE / "bindings.cpp")
EXTENSION = Extension(functools.partial(compile_extension, paths=SOURCES), kernels="the vLLM plugin's store and attention")

__all__ = ["EXTENSION", "SOURCES"]
