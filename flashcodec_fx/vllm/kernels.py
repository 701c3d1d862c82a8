"""Which kernel stores and attends on vLLM pages: the fused C++ CPU kernels, or the reference (the spec).

``FLASHCODEC_KERNELS`` chooses, as for the cache's ops (``flashcodec_fx.ops.cpu``): ``auto`` (default) the C++
kernels on CPU tensors, the reference after one warning when they cannot be built; ``reference`` always the
reference; ``fast`` the C++ kernels or an error. Other devices run the reference.
"""

from __future__ import annotations

import torch

from .page import PageFormat
from .reference import attention_reference, store_reference


def paged_store(fmt: PageFormat, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Store ``key``, ``value (N, H, D)`` into ``cache`` at ``slot_mapping (N,)`` (``reference.store_reference``)."""
    store_reference(fmt, key, value, cache, slot_mapping)


def paged_attention(fmt: PageFormat, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    s_aux: torch.Tensor | None, out: torch.Tensor) -> None:
    """Attention on the pages into ``out (N, H_q, D)`` (``reference.attention_reference``)."""
    out.copy_(attention_reference(fmt, query, key, value, cache, block_table, seq_lens, query_start_loc, scale, s_aux))
