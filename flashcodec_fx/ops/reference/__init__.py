"""The plain-torch reference of every ``torch.ops.flashcodec`` op: the spec every fast kernel is tested against.

Each module defines its op (``torch.library.custom_op``; ``append_attention``: ``torch.library.Library``, for its
dispatch cost): the argument checks every kernel's launcher calls, the reference as the op's default kernel (every
device) and the fake kernel. ``append`` (new tokens into a stream), ``attention`` (``codec_attention`` on the stored
form), ``append_attention`` (a decode step: both appends and attention), ``blocks`` (``encode`` / ``decode`` of
archive groups), ``read`` (the decoded view). Importing this package defines them; the CPU and Triton kernels
register on top (:func:`op_kernels` reads back what serves each device).
"""

from __future__ import annotations

from collections.abc import Callable

from ... import _compat
from .append import append, completable_groups
from .append_attention import append_attention, library_op_kernels
from .attention import codec_attention
from .blocks import decode, encode
from .read import read


def op_kernels(qualname: str) -> dict[str | None, Callable]:
    """The kernels registered for flashcodec op ``qualname`` by device type (None: the default kernel, the
    reference), as their authors wrote them."""
    kernels = library_op_kernels(qualname)
    return kernels if kernels is not None else _compat.custom_op_kernels(qualname)


__all__ = ["append", "append_attention", "codec_attention", "completable_groups", "decode", "encode", "op_kernels",
           "read"]
