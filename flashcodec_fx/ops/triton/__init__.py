"""Triton kernels of every ``torch.ops.flashcodec`` op, for CUDA (and for CPU tensors under ``TRITON_INTERPRET=1``,
which is how the tests check them against the reference): ``common`` (limits, a stored form as the kernels' constexpr
tuple, device tables, row loaders), one file per op with its launcher next to its kernels (``append``, ``attention``,
``blocks`` for encode / decode, ``read``), and ``gate`` (the capability gate in front of them).

:func:`register` runs when ``flashcodec_fx.ops`` is imported (so ``import flashcodec_fx`` defines every op) and does
not import Triton: each op's CUDA kernel imports the launchers on its first call, as the warmer does on the first
stream allocated on a CUDA device.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import torch

from ..warm import WARMERS

OPS = ("flashcodec::append", "flashcodec::codec_attention", "flashcodec::encode", "flashcodec::decode",
       "flashcodec::read")  # the ops with a Triton kernel (gate.KERNELS)


def available() -> bool:
    """Whether Triton is installed (looked up, not imported)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _gated_kernels() -> dict[str, Callable]:
    from .gate import gated_kernels  # imports Triton

    return gated_kernels()


def _cuda_kernel(name: str) -> Callable:
    """The CUDA kernel of op ``name``: the gated Triton launcher, loaded on the first call."""

    def kernel(*args, **kwargs):
        return _gated_kernels()[name](*args, **kwargs)

    kernel.__name__ = f"triton_{name.split('::')[1]}"
    return kernel


def _warm(codec, head_dim: int, device: torch.device) -> None:
    """``ops.warm`` hook: the Triton tables of a stream allocated where the launchers run (a CUDA device; CPU tensors
    under ``TRITON_INTERPRET=1``). Elsewhere nothing: no Triton import for a CPU stream."""
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        from .common import warm_tables

        warm_tables(codec, head_dim, device)


def register() -> None:
    """Make the gated Triton launchers the CUDA kernels of :data:`OPS` and warm their tables, where Triton is
    installed; Triton itself is imported by the first CUDA call."""
    if not available():
        return
    WARMERS.append(_warm)
    for name in OPS:
        torch.library.register_kernel(name, "cuda", _cuda_kernel(name))
