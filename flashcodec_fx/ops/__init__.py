"""`torch.ops.flashcodec.*` custom ops: reference (plain torch, the spec) and fake kernels.

Importing this package registers every op; CUDA/Triton kernels register on top where available.
"""

from __future__ import annotations

from .append import append, touched_blocks
from .attention import codec_attention
from .blocks import decode, encode
from .read import read

try:
    import triton  # noqa: F401
except ImportError:  # without triton the reference kernels serve every device
    pass
else:
    from . import triton_register  # noqa: F401  (Triton CUDA kernels of every op)

__all__ = ["append", "codec_attention", "decode", "encode", "read", "touched_blocks"]
