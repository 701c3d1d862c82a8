"""`torch.ops.flashcodec.*` custom ops, their kernels side by side over one stream layout (``state``). The ops:
``encode`` / ``decode`` (archive groups), ``append`` (new tokens into a stream), ``read`` (the decoded view),
``codec_attention`` (attention on the stored form) and ``append_attention`` (a decode step: both appends and attention
in one call).

- ``reference/``: each op's definition, argument checks, plain-torch reference kernel (the spec, every device) and
  fake kernel;
- ``cpu/``: fused C++ kernels of ``codec_attention``, ``append`` and ``append_attention`` (built on first use;
  ``FLASHCODEC_KERNELS=reference`` keeps the reference ops, ``fast`` requires the C++ kernels);
- ``triton/``: Triton kernels of every op, registered for CUDA behind a capability gate (when Triton is installed;
  imported on the first CUDA call).

Both fast backends read a codec's stored form from one plan, ``plan.stored_form_plan(spec, head_dim)``.

Importing this package (``import flashcodec_fx`` does) defines every op and registers the fast kernels on top,
without importing Triton, Dynamo, Inductor or transformers.
"""

from __future__ import annotations

from . import cpu
from .reference import append, append_attention, codec_attention, completable_groups, decode, encode, read
from .state import StreamState, advance, capacity, empty_state
from .triton import register as _register_triton
from .warm import warm

_register_triton()  # without Triton installed, the reference kernels serve CUDA; Triton loads on the first CUDA call
cpu.register()

__all__ = ["StreamState", "advance", "append", "append_attention", "capacity", "codec_attention", "completable_groups",
           "decode", "empty_state", "encode", "read", "warm"]
