"""The plain-torch reference of every ``torch.ops.flashcodec`` op: the spec every fast kernel is tested against.

Each module defines its op (``torch.library.custom_op``): the argument checks every kernel's launcher calls, the
reference as the op's default kernel (every device) and the fake kernel. ``append`` (new tokens into a stream),
``attention`` (``codec_attention`` on the stored form), ``blocks`` (``encode`` / ``decode`` of archive groups),
``read`` (the decoded view). Importing this package defines them; the CPU and Triton kernels register on top.
"""

from __future__ import annotations

from .append import append, completable_groups
from .attention import codec_attention
from .blocks import decode, encode
from .read import read

__all__ = ["append", "codec_attention", "completable_groups", "decode", "encode", "read"]
