"""`torch.ops.flashcodec.*` custom ops: reference (plain torch, the spec) and fake kernels.

Importing this package registers every op; fast kernels register on top where available: Triton for CUDA, and the
fused C++ kernels of ``codec_attention`` and ``append`` for the CPU (``ops/cpu``, built on first use;
``FLASHCODEC_KERNELS=reference`` keeps the reference ops, ``fast`` requires the C++ kernels).
"""

from __future__ import annotations

from .append import append, completable_groups
from .attention import codec_attention
from .blocks import decode, encode
from .cpu import register as _register_cpu_kernels
from .read import read
from .state import StreamState, advance, capacity, empty_state
from .warm import warm

try:
    import triton  # noqa: F401
except ImportError:  # without triton the reference kernels serve every device
    triton_register = None
else:
    from . import triton_register  # noqa: F401  (Triton CUDA kernels, behind a capability gate)

_register_cpu_kernels()

__all__ = ["StreamState", "append", "advance", "capacity", "codec_attention", "completable_groups", "decode",
           "empty_state", "encode", "read", "warm"]
