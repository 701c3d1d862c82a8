"""`torch.ops.flashcodec.*` custom ops: reference (plain torch, the spec) and fake kernels.

Importing this package registers every op; fast kernels (Triton for CUDA) register on top where available.
"""

from __future__ import annotations

from .append import append, completable_groups
from .attention import codec_attention
from .blocks import decode, encode
from .read import read
from .state import StreamState, advance, capacity, empty_state

__all__ = ["StreamState", "append", "advance", "capacity", "codec_attention", "completable_groups", "decode",
           "empty_state", "encode", "read"]
