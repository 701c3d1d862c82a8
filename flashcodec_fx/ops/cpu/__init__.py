"""Fused C++ (OpenMP) CPU kernels of ``flashcodec::codec_attention``, ``flashcodec::append`` and
``flashcodec::append_attention``.

``register()`` (called by ``flashcodec_fx.ops``) makes them the ops' CPU kernels; the C++ is built on first use
(``build.py``). ``FLASHCODEC_KERNELS`` selects what the CPU runs:

- ``auto`` (default): these kernels; the reference ops, after one warning, when they cannot be built;
- ``reference``: the plain-torch reference ops (the spec), for debugging and side-by-side benchmarks;
- ``fast``: these kernels, and an error when they cannot be built (no silent fallback).
"""

from __future__ import annotations

import os

import torch

from ..reference.append_attention import register_kernel as register_fused_kernel
from .build import EXTENSION
from .launch import cpu_append, cpu_append_attention, cpu_codec_attention

MODES = ("auto", "reference", "fast")
ENV = "FLASHCODEC_KERNELS"


def kernel_mode() -> str:
    mode = os.environ.get(ENV, "auto")
    if mode not in MODES:
        raise ValueError(f"{ENV} must be one of {MODES}, got {mode!r}")
    return mode


def register() -> None:
    """Register the CPU kernels (unless ``FLASHCODEC_KERNELS=reference``); ``fast`` builds them now or raises."""
    mode = kernel_mode()
    if mode == "reference":
        return
    if mode == "fast" and EXTENSION.module() is None:
        raise RuntimeError(f"{ENV}=fast but the CPU kernels could not be built: {EXTENSION.error}")
    torch.library.register_kernel("flashcodec::codec_attention", "cpu", cpu_codec_attention)
    torch.library.register_kernel("flashcodec::append", "cpu", cpu_append)
    register_fused_kernel("cpu", cpu_append_attention)


__all__ = ["ENV", "EXTENSION", "MODES", "cpu_append", "cpu_append_attention", "cpu_codec_attention", "kernel_mode",
           "register"]
