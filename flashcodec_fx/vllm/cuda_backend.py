"""The vLLM attention backend on the CUDA platform: vLLM's Triton backend with flashcodec pages, registered as
``CUSTOM``.

``register()`` registers :class:`FlashCodecCUDABackend` as ``AttentionBackendEnum.CUSTOM`` and makes it the CUDA
platform's choice for every non-MLA attention layer (``attention_backend="CUSTOM"`` / ``--attention-backend CUSTOM``
chooses it too; another explicit backend is refused). ``customize_spec`` gives the CPU backend's pages;
:class:`FlashCodecCUDAImpl` stores and attends through ``kernels.paged_store`` / ``paged_attention``, which run the
Triton kernels (``triton/``) on CUDA tensors; layers vLLM gives its own pages (sliding window, cross attention,
encoder) run vLLM's Triton attention. The metadata is the Triton backend's (block table, ``seq_lens``,
``query_start_loc``, ``slot_mapping``, ``max_query_len``, ``num_actual_tokens``); attention stays out of CUDA graphs
(vLLM captures the rest piecewise). Not run on a GPU yet: docs/vllm.md, "Install (CUDA)".
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.config import VllmConfig
from vllm.config.cache import CacheDType
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from .backend_base import FlashCodecImpl, check_engine, customize_spec, warn_stock_layers
from .triton.page_form import MAX_BLOCK_SIZE


class FlashCodecCUDABackend(TritonAttentionBackend):
    """``CUSTOM``: vLLM's Triton backend with flashcodec pages (module docstring). Pages head-major (``LBHNC``: one
    (block, KV head)'s ``block_size * C`` bytes contiguous, as the format lays them out), at most ``MAX_BLOCK_SIZE``
    tokens (the Triton kernels' limit), KV cache dtype the model's (``auto``, ``float16``, ``bfloat16``)."""

    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "float16", "bfloat16"]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return customize_spec(spec)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM maps a layer's backend back to its enum member by this name

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return super().supports_block_size(block_size) and (block_size is None or block_size <= MAX_BLOCK_SIZE)

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_rswa(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @staticmethod
    def get_impl_cls() -> type[FlashCodecCUDAImpl]:
        return FlashCodecCUDAImpl

    @staticmethod
    def get_builder_cls() -> type[FlashCodecCUDAMetadataBuilder]:
        return FlashCodecCUDAMetadataBuilder


class FlashCodecCUDAMetadataBuilder(TritonAttentionMetadataBuilder):
    """vLLM's Triton metadata; never captured in a full CUDA graph (``NEVER``: vLLM falls back to piecewise graphs,
    attention and the store running eagerly between them); warns once per KV cache group on vLLM's own pages."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_engine(vllm_config)
        warn_stock_layers(kv_cache_spec, layer_names, "Triton")


class FlashCodecCUDAImpl(FlashCodecImpl, TritonAttentionImpl):
    """One layer: flashcodec pages (the Triton kernels) or, for a layer vLLM gave its own pages, vLLM's Triton
    attention."""
