"""The Triton launchers as the CUDA kernels of the ``torch.ops.flashcodec`` ops they implement, behind a
capability gate (``ops.triton.register`` installs them; this module imports Triton).

``KERNELS`` lists the ops with a Triton kernel: every op (append, codec_attention, append_attention, encode, decode,
read), trellis codecs (``levels="tcq"``) included. CPU tensors
keep the C++ kernels or the plain-torch reference; CUDA tensors get the reference where the fast kernels do not know
the codec or the head_dim (``state.fast_kernels_serve``; ``HEAD_DIM`` says where each op's head_dim is). The
launchers themselves can be called on CPU tensors under ``TRITON_INTERPRET=1`` (that is how the tests check them
against the reference). Every codec within the Triton limits (``common``) is served by Triton on CUDA devices
of compute capability 8.0 or newer (bf16 dots and tf32x3 need it). An older device gets the reference ops, decided
per call from the tensor's device (cached per device) with one warning per device: never a Triton kernel it cannot
run.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from ...codecs import Encoded, codec_from_spec
from ..reference import op_kernels
from ..state import StreamState, fast_kernels_serve
from .append import triton_append
from .attention import triton_codec_attention
from .blocks import triton_decode, triton_encode
from .fused import triton_append_attention
from .read import triton_read

MIN_CAPABILITY = (8, 0)  # sm_80: bf16 tensor-core dots and tf32x3

KERNELS = {
    "flashcodec::append": triton_append,
    "flashcodec::codec_attention": triton_codec_attention,
    "flashcodec::encode": triton_encode,
    "flashcodec::decode": triton_decode,
    "flashcodec::read": triton_read,
    "flashcodec::append_attention": triton_append_attention,
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


def leading_head_dim(args: tuple) -> int:
    """``D`` of the first tensor argument, ``(B, H, T, D)``: q (codec_attention, append_attention), the new tokens
    (append), x (encode)."""
    first = next(a for a in args if isinstance(a, torch.Tensor))
    return first.shape[3] if first.dim() == 4 else 1  # another rank: the reference validates and raises


def archive_head_dim(args: tuple) -> int:
    """``D`` of decode's stored groups ``(data, scale, zero, index, spec, ...)`` (``data (B, H, NG, *group)``: the
    codec says how its last dimension holds ``D``)."""
    data, scale, zero, index, spec = args[:5]
    if data.dim() < 4 or not fast_kernels_serve(spec, trellis=True):  # a bad spec or rank: the reference raises
        return 1
    return codec_from_spec(spec).head_dim_of(Encoded(data, scale, zero, index))


def state_head_dim(args: tuple) -> int:
    """``D`` of read's stream state (its tail ``(B, H, window + G, D)``)."""
    state = args[0]
    tail = state[StreamState._fields.index("tail")] if len(state) == len(StreamState._fields) else None
    return tail.shape[3] if tail is not None and tail.dim() == 4 else 1


HEAD_DIM = {  # how each op's head_dim is read from its arguments (the fast kernels take multiples of 8)
    "flashcodec::append": leading_head_dim,
    "flashcodec::codec_attention": leading_head_dim,
    "flashcodec::encode": leading_head_dim,
    "flashcodec::decode": archive_head_dim,
    "flashcodec::read": state_head_dim,
    "flashcodec::append_attention": leading_head_dim,
}


def gated(triton_fn: Callable, reference_fn: Callable, head_dim: Callable[[tuple], int] = leading_head_dim
          ) -> Callable:
    """The CUDA kernel of one op: ``triton_fn`` or ``reference_fn`` by :func:`kernel_choice` of the first tensor
    argument's device (tensor lists, the stream states, included); the reference where the fast kernels do not know
    the op's specs (trellis codes included: every Triton op reads and writes them) or its ``head_dim(args)``."""

    @functools.wraps(triton_fn)
    def kernel(*args, **kwargs):
        device = next(a.device if isinstance(a, torch.Tensor) else a[0].device for a in args
                      if isinstance(a, torch.Tensor) or (isinstance(a, (list, tuple)) and a
                                                         and isinstance(a[0], torch.Tensor)))
        known = fast_kernels_serve(*(a for a in args if isinstance(a, str)), head_dim=head_dim(args), trellis=True)
        fn = triton_fn if known and kernel_choice(torch.device(device)) == "triton" else reference_fn
        return fn(*args, **kwargs)

    return kernel


def gated_kernels() -> dict[str, Callable]:
    """Every launcher in ``KERNELS`` gated (:func:`gated`): the CUDA kernels ``ops.triton.register`` installs."""
    return {name: gated(launcher, op_kernels(name)[None], HEAD_DIM[name])
            for name, launcher in KERNELS.items()}
