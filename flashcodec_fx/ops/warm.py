"""Device constants of a stream's kernels, made when the stream allocates its storage.

A CUDA-graph capture must not copy a tensor from the host, so every constant an op reads (the codec's matrices and
level tables, the Triton kernels' tables) is created on the device before the first op call: ``CodecStream`` calls
:func:`warm` when it allocates. Device kernels register what they need in ``WARMERS`` (``ops.triton.gate`` does).
``WARMERS`` is module-level because it is a registry of the backends present, like torch.library's kernel table:
filled once, by each backend's ``register()`` at import, so that ``ops`` imports (and warms) without Triton.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..codecs import Codec

WARMERS: list[Callable[[Codec, int, torch.device], None]] = []


def warm(codec: Codec, head_dim: int, device: torch.device | str) -> None:
    """Create now, on ``device``, every constant the ops of ``codec`` will read for ``head_dim`` channels."""
    device = torch.device(device)
    codec.warm(head_dim, device)
    for make in WARMERS:
        make(codec, head_dim, device)
