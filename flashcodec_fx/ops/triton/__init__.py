"""Triton kernels of every ``torch.ops.flashcodec`` op, for CUDA (and for CPU tensors under ``TRITON_INTERPRET=1``,
which is how the tests check them against the reference): ``common`` (limits, a stored form as the kernels' constexpr
tuple, device tables, row loaders), one file per op with its launcher next to its kernels (``append``, ``attention``,
``blocks`` for encode / decode, ``read``; ``fused``: ``append_attention`` as the append and attention launchers),
and ``gate`` (the capability gate in front of them).

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

from ..reference.append_attention import library_op_kernels
from ..reference.append_attention import register_kernel as register_library_kernel
from ..warm import WARMERS

LAUNCHERS = {  # the ops with a Triton kernel (gate.KERNELS) -> their launcher, "module.function", named not imported
    "flashcodec::append": "flashcodec_fx.ops.triton.append.triton_append",
    "flashcodec::codec_attention": "flashcodec_fx.ops.triton.attention.triton_codec_attention",
    "flashcodec::encode": "flashcodec_fx.ops.triton.blocks.triton_encode",
    "flashcodec::decode": "flashcodec_fx.ops.triton.blocks.triton_decode",
    "flashcodec::read": "flashcodec_fx.ops.triton.read.triton_read",
    "flashcodec::append_attention": "flashcodec_fx.ops.triton.fused.triton_append_attention",
}
OPS = tuple(LAUNCHERS)


def available() -> bool:
    """Whether Triton is installed (looked up, not imported)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _gated_kernels() -> dict[str, Callable]:
    from .gate import gated_kernels  # imports Triton

    return gated_kernels()


def _cuda_kernel(name: str) -> Callable:
    """The CUDA kernel of op ``name``: the gated Triton launcher, loaded on the first call (named as the launcher, so
    the kernel report says which kernel serves the op)."""

    def kernel(*args, **kwargs):
        return _gated_kernels()[name](*args, **kwargs)

    kernel.__module__, kernel.__qualname__ = LAUNCHERS[name].rsplit(".", 1)
    kernel.__name__ = kernel.__qualname__
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
        if library_op_kernels(name) is not None:  # defined with torch.library.Library: its own registration
            register_library_kernel("cuda", _cuda_kernel(name))
        else:
            torch.library.register_kernel(name, "cuda", _cuda_kernel(name))
