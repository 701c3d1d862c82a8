"""Triton kernels of the vLLM plugin for CUDA tensors: the store (``store.py``) and paged attention
(``attention.py``), twins of ``reference.store_reference`` / ``reference.attention_reference``. Importing this package
imports triton; ``flashcodec_fx.vllm.kernels`` imports it only for CUDA tensors. docs/vllm.md: "CUDA kernels"."""

from .attention import triton_paged_attention
from .page_form import check_paged_limits
from .store import triton_paged_store

__all__ = ["check_paged_limits", "triton_paged_attention", "triton_paged_store"]
