"""Registers the Triton launchers as the CUDA kernels of the ``torch.ops.flashcodec`` ops they implement, behind a
capability gate, and makes their device tables when a stream allocates (``ops.warm``).

``KERNELS`` lists the ops with a Triton kernel; the others (and every op on CPU) keep the plain-torch reference,
which runs on CUDA tensors as well (docs/triton.md says which and why). The launchers themselves can be called on
CPU tensors under ``TRITON_INTERPRET=1`` (that is how the tests check them against the reference). Every codec
within the Triton limits (``triton_common``) is served by Triton on CUDA devices of compute capability 8.0 or newer
(bf16 dots and tf32x3 need it). An older device gets the reference ops, decided per call from the tensor's device
(cached per device) with one warning per device: never a Triton kernel it cannot run.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from .. import _compat
from .state import fast_kernels_serve
from .triton_append import triton_append
from .triton_attention import triton_codec_attention
from .triton_common import warm_tables
from .warm import WARMERS

MIN_CAPABILITY = (8, 0)  # sm_80: bf16 tensor-core dots and tf32x3

KERNELS = {
    "flashcodec::append": triton_append,
    "flashcodec::codec_attention": triton_codec_attention,
}

_capability = torch.cuda.get_device_capability  # (major, minor) of a CUDA device index; the tests fake it


class OldGPUFallback(UserWarning):
    """A CUDA device below sm_80 runs the plain-torch reference ops instead of the Triton kernels."""


@functools.cache
def kernel_choice(device: torch.device) -> str:
    """``"triton"`` when the Triton kernels can run on CUDA ``device`` (capability >= ``MIN_CAPABILITY``), else
    ``"reference"`` (warned once per device). Cached: one capability query per device for the process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = _capability(index)
    if (major, minor) >= MIN_CAPABILITY:
        return "triton"
    warnings.warn(f"flashcodec: cuda:{index} has compute capability {major}.{minor}; the Triton kernels need "
                  f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (bf16 and tf32x3 dots), so this device runs the "
                  f"plain-torch reference ops (same results, slower)", OldGPUFallback, stacklevel=3)
    return "reference"


def gated(triton_fn: Callable, reference_fn: Callable) -> Callable:
    """The CUDA kernel of one op: ``triton_fn`` or ``reference_fn`` by :func:`kernel_choice` of the first tensor
    argument's device (tensor lists, the stream states, included)."""

    @functools.wraps(triton_fn)
    def kernel(*args, **kwargs):
        device = next(a.device if isinstance(a, torch.Tensor) else a[0].device for a in args
                      if isinstance(a, torch.Tensor) or (isinstance(a, (list, tuple)) and a
                                                         and isinstance(a[0], torch.Tensor)))
        first = next(a for a in args if isinstance(a, torch.Tensor))  # q or the new tokens
        head_dim = first.shape[3] if first.dim() == 4 else 1  # another rank: the reference validates and raises
        known = fast_kernels_serve(*(a for a in args if isinstance(a, str)), head_dim=head_dim)
        fn = triton_fn if known and kernel_choice(torch.device(device)) == "triton" else reference_fn
        return fn(*args, **kwargs)

    return kernel


WARMERS.append(warm_tables)
for _name, _kernel in KERNELS.items():
    torch.library.register_kernel(_name, "cuda", gated(_kernel, _compat.custom_op_kernels(_name)[None]))
