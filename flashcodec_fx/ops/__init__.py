"""`torch.ops.flashcodec.*` custom ops: reference (plain torch, the spec) and fake kernels.

Importing this package registers every op; CUDA/Triton kernels register on top where available.
"""

from __future__ import annotations

import torch

from .append import append, touched_blocks
from .attention import codec_attention
from .blocks import decode, encode
from .read import read

try:
    import triton  # noqa: F401
except ImportError:  # without triton the reference kernels serve every device
    triton_register = None
else:
    from . import triton_register  # (Triton CUDA kernels of every op)


def prepare_device(codec, device: torch.device) -> None:
    """Create now what the device kernels of ``codec`` keep on ``device`` (the Triton kernels' codec matrices, also
    on CPU where the launchers run under ``TRITON_INTERPRET=1``: two tiny tensors), so that no later op call copies
    from the host: inside a CUDA-graph capture that copy would fail. A no-op without Triton."""
    if triton_register is not None:
        triton_register.prepare(codec, device)


__all__ = ["append", "codec_attention", "decode", "encode", "prepare_device", "read", "touched_blocks"]
