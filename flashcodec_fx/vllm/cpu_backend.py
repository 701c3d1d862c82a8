"""The vLLM attention backend on the CPU platform: vLLM's CPU backend with flashcodec pages for the layers it serves.

:class:`FlashCodecCPUBackend` replaces ``CPU_ATTN`` (``register_backend``: vLLM's CPU platform serves every layer with
that backend). ``customize_spec`` turns a full-attention decoder layer's spec into uint8 pages of
``PluginConfig.state_content_bytes`` per (token, KV head); every other spec (sliding window, cross attention, ...)
stays vLLM's, and those layers run vLLM's own CPU attention (one warning per KV cache group names them).
:class:`FlashCodecCPUImpl` stores through ``slot_mapping`` in ``do_kv_cache_update`` (before forward, as the CPU
backend declares) and attends on the codes through the block table in ``forward`` (``backend_base.FlashCodecImpl``).
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from .backend_base import FlashCodecImpl, check_engine, customize_spec, warn_stock_layers


class FlashCodecCPUBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with flashcodec pages (module docstring); the name stays ``CPU_ATTN`` (vLLM looks it up)."""

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return customize_spec(spec)

    @staticmethod
    def get_impl_cls() -> type[FlashCodecCPUImpl]:
        return FlashCodecCPUImpl

    @staticmethod
    def get_builder_cls() -> type[FlashCodecCPUMetadataBuilder]:
        return FlashCodecCPUMetadataBuilder


class FlashCodecCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata (block table, slot mapping, query starts, sequence lengths serve both paths); warns once
    per KV cache group whose layers run vLLM's own attention."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_engine(vllm_config)
        warn_stock_layers(kv_cache_spec, layer_names, "CPU")


class FlashCodecCPUImpl(FlashCodecImpl, CPUAttentionBackendImpl):
    """One layer: flashcodec pages or, for a layer vLLM gave its own pages, vLLM's CPU attention."""
