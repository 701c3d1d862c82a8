"""Registers the Triton launchers as the CUDA kernels of every ``torch.ops.flashcodec`` op, behind a capability gate.

The plain-torch references stay the CPU (and every other device's) kernels; the launchers themselves can be
called on CPU tensors under ``TRITON_INTERPRET=1`` (that is how the tests check them against the reference).
Every codec within the Triton limits (``triton_common``) is served by Triton on CUDA devices of compute
capability 8.0 or newer (bf16 dots and tf32x3 need it). An older device gets the reference ops, decided per call
from the tensor's device (cached per device) with one warning per device: never a Triton kernel it cannot run.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from .. import _compat
from ..codecs import Codec
from .triton_append import triton_append
from .triton_attention import triton_codec_attention
from .triton_blocks import triton_decode, triton_encode, triton_read
from .triton_common import codec_matrices

MIN_CAPABILITY = (8, 0)  # sm_80: bf16 tensor-core dots and tf32x3

KERNELS = {
    "flashcodec::encode": triton_encode,
    "flashcodec::decode": triton_decode,
    "flashcodec::read": triton_read,
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
    argument's device."""

    @functools.wraps(triton_fn)
    def kernel(*args, **kwargs):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        fn = triton_fn if kernel_choice(torch.device(device)) == "triton" else reference_fn
        return fn(*args, **kwargs)

    return kernel


def prepare(codec: Codec, device: torch.device) -> None:
    """Create the codec matrices the kernels read on ``device`` now (they are cached for the process), so that
    no kernel call copies them from the host later, e.g. inside a CUDA-graph capture."""
    codec_matrices(codec, device)


for _name, _kernel in KERNELS.items():
    torch.library.register_kernel(_name, "cuda", gated(_kernel, _compat.custom_op_kernels(_name)[None]))
