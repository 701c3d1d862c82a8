"""Triton kernels of every ``torch.ops.flashcodec`` op, for CUDA (and for CPU tensors under ``TRITON_INTERPRET=1``,
which is how the tests check them against the reference): ``common`` (limits, a stored form as the kernels' constexpr
tuple, device tables, row loaders), one file per op with its launcher next to its kernels (``append``, ``attention``,
``blocks`` for encode / decode, ``read``), and ``gate`` (the capability gate that registers them).
"""

from __future__ import annotations


def register() -> None:
    """Make the Triton launchers the CUDA kernels of their ops (``gate.register``; imports Triton)."""
    from .gate import register as register_gated

    register_gated()
