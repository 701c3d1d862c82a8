"""Registers the Triton launchers as the CUDA kernels of every ``torch.ops.flashcodec`` op.

The plain-torch references stay the CPU (and every other device's) kernels; the launchers themselves can be
called on CPU tensors under ``TRITON_INTERPRET=1`` (that is how the tests check them against the reference).
Every codec is served by Triton on CUDA (jpeg any K, int8, png, pruned png): nothing falls back to the reference.
"""

from __future__ import annotations

import torch

from .triton_append import triton_append
from .triton_attention import triton_codec_attention
from .triton_blocks import triton_decode, triton_encode, triton_read

KERNELS = {
    "flashcodec::encode": triton_encode,
    "flashcodec::decode": triton_decode,
    "flashcodec::read": triton_read,
    "flashcodec::append": triton_append,
    "flashcodec::codec_attention": triton_codec_attention,
}

for _name, _kernel in KERNELS.items():
    torch.library.register_kernel(_name, "cuda", _kernel)
