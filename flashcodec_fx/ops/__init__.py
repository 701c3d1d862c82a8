"""`torch.ops.flashcodec.*` custom ops, their kernels side by side over one stream layout (``state``):

- ``reference/``: each op's definition, argument checks, plain-torch reference kernel (the spec, every device) and
  fake kernel;
- ``cpu/``: fused C++ kernels of ``codec_attention`` and ``append`` (built on first use; ``FLASHCODEC_KERNELS=
  reference`` keeps the reference ops, ``fast`` requires the C++ kernels);
- ``triton/``: Triton kernels of every op, registered for CUDA behind a capability gate (when Triton imports).

Both fast backends read a codec's stored form from one plan, ``plan.stored_form_plan(spec, head_dim)``.

Importing this package defines every op and registers the fast kernels on top.
"""

from __future__ import annotations

from . import cpu
from .reference import append, codec_attention, completable_groups, decode, encode, read
from .state import StreamState, advance, capacity, empty_state
from .warm import warm

try:
    import triton as _triton_package  # noqa: F401  (not bound as ``triton``: that name is the ``triton/`` subpackage)
except ImportError:  # without triton the reference kernels serve every device
    pass
else:
    from .triton import register as _register_triton

    _register_triton()

cpu.register()

__all__ = ["StreamState", "append", "advance", "capacity", "codec_attention", "completable_groups", "decode",
           "empty_state", "encode", "read", "warm"]
