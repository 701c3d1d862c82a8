"""What the CPU and CUDA backends share (``cpu_backend.py``, ``cuda_backend.py``): the process's configuration, which
KV cache specs become flashcodec pages (``customize_spec``), the builders' warning for layers left on vLLM's pages,
and the attention impl (:class:`FlashCodecImpl`, mixed in before vLLM's own impl of each platform).

The impl stores each new token in ``do_kv_cache_update`` (``kernels.paged_store``, phase ``store``: the sinks, the
code slots, a completed page's last rows), attends on the pages through the block table in ``forward``
(``kernels.paged_attention``: the C++ kernels on CPU tensors, the Triton kernels on CUDA tensors), then writes the
call's newest tokens into their pages' raw rings (phase ``ring``: attention read the history's newest there). Where
each token goes (``page.store_plan``) is computed once per step and phase from vLLM's metadata (positions, block
table) and shared by the layers. A layer vLLM gave its own pages (see :func:`servable_spec`) runs the platform's stock
attention.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

from .config import ENV_PRESET, PluginConfig, config_from_env
from .kernels import paged_attention, paged_store
from .page import PageFormat, StorePlan, store_plan

logger = init_logger(__name__)


@functools.cache
def plugin_config() -> PluginConfig:
    """This process's configuration (the plugin is registered only when it is set)."""
    config = config_from_env()
    if config is None:
        raise ValueError(f"{ENV_PRESET} is not set: the flashcodec backend is registered only when it is")
    return config


def servable_spec(spec: AttentionSpec) -> bool:
    """A spec flashcodec pages replace: a plain full-attention decoder layer (no window, chunking or packing)."""
    return (type(spec) is FullAttentionSpec and spec.sliding_window is None and spec.attention_chunk_size is None
            and spec.state_content_bytes is None and spec.num_head_slots is None and spec.head_size == spec.head_size_v)


MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # a spec's dtype where vLLM's kv_cache_dtype is "auto"


def customize_spec(spec: AttentionSpec) -> AttentionSpec:
    """A servable spec as uint8 pages of the configuration's ``state_content_bytes`` per (token, KV head); any
    other spec unchanged (those layers keep vLLM's pages and attention). ValueError for a quantized KV cache dtype
    (``kv_cache_dtype="fp8"`` and kin: the spec's dtype is then vLLM's storage type, not the model's)."""
    if not servable_spec(spec):
        return spec
    if spec.dtype not in MODEL_DTYPES:
        raise ValueError(f"{ENV_PRESET} is set with a quantized KV cache dtype (vLLM's pages of {spec.dtype}): "
                         f"flashcodec pages code the model's K and V themselves; leave kv_cache_dtype='auto' "
                         f"(--kv-cache-dtype auto), or unset {ENV_PRESET} to run vLLM's own quantized cache")
    content = plugin_config().state_content_bytes(spec.head_size, spec.dtype, spec.block_size)
    return replace(spec, dtype=torch.uint8, state_content_bytes=content)


def check_engine(vllm_config: Any) -> None:
    """ValueError for an engine the pages cannot serve: speculative decoding where pages keep raw rings (a ring
    written for draft tokens the verifier rejects would hold them; ``FLASHCODEC_VLLM_ANCHORS=0`` has no ring)."""
    if getattr(vllm_config, "speculative_config", None) is None:
        return
    model = vllm_config.model_config
    head_dim, dtype = model.get_head_size(), model.dtype
    if any(fmt.raw_rows(vllm_config.cache_config.block_size or 16) and not fmt.raw
           for fmt in plugin_config().formats(head_dim, dtype)):
        raise ValueError(f"{ENV_PRESET} is set with speculative decoding: flashcodec pages keep each sequence's newest "
                         f"tokens in a raw ring that rejected draft tokens would overwrite; serve without a "
                         f"speculative config, or set FLASHCODEC_VLLM_ANCHORS=0 (no raw rows), or unset {ENV_PRESET}")


def _layer_metadata(layer: torch.nn.Module) -> Any:
    """This step's attention metadata of ``layer`` from vLLM's forward context (None in the profiling run)."""
    from vllm.model_executor.layers.attention.attention import get_attention_context

    return get_attention_context(layer.layer_name)[0]


def _layer_slots(layer: torch.nn.Module) -> torch.Tensor | None:
    """The slot mapping vLLM stored ``layer``'s tokens through this step (``do_kv_cache_update``'s), or None."""
    from vllm.model_executor.layers.attention.attention import get_attention_context

    return get_attention_context(layer.layer_name)[3]


def _plan(fmt: PageFormat, kv_cache: torch.Tensor, attn_metadata: Any, slot_mapping: torch.Tensor,
          phase: str) -> StorePlan:
    """``page.store_plan`` of this step's tokens, computed once per (step, phase, page geometry) and kept on the
    step's metadata, which every layer of the KV cache group shares."""
    plans = attn_metadata.__dict__.setdefault("_flashcodec_plans", {})
    key = (phase, fmt.raw, fmt.raw_rows(kv_cache.shape[2]), fmt.center, kv_cache.shape[2], slot_mapping.shape[0])
    if key not in plans:
        plans[key] = store_plan(fmt, kv_cache.shape[2], slot_mapping, attn_metadata.block_table,
                                attn_metadata.seq_lens, attn_metadata.query_start_loc, phase)
    return plans[key]


def warn_stock_layers(kv_cache_spec: AttentionSpec, layer_names: list[str], stock: str) -> None:
    """One warning per KV cache group whose layers run ``stock`` attention on vLLM's own pages."""
    if kv_cache_spec.state_content_bytes is None:
        logger.warning("flashcodec: layers %s run vLLM's stock %s attention on bf16/fp16 pages: their KV cache spec "
                       "is %s (flashcodec pages hold full-attention decoder layers only)", ", ".join(layer_names),
                       stock, type(kv_cache_spec).__name__)


class FlashCodecImpl:
    """One layer on flashcodec pages (store, attention on the codes) or, for a layer on vLLM's own pages, the stock
    impl it is mixed into (``class X(FlashCodecImpl, StockImpl)``: ``super()`` is the stock impl). Refuses what the
    format's attention does not implement: ALiBi, soft-capped logits, fused output quantization."""

    head_size: int
    num_heads: int
    scale: float
    sinks: torch.Tensor | None
    kv_sharing_target_layer_name: str | None
    supports_quant_query_input: bool

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,  # type: ignore[call-arg]
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self._format: PageFormat | None = None
        self.supports_quant_query_input = False  # q stays in the model's dtype (the stock CUDA impl would quantize it)
        coded = attn_type == AttentionType.DECODER and sliding_window is None
        if coded and alibi_slopes is not None:
            raise ValueError(f"{ENV_PRESET} is set, but this model uses ALiBi, which flashcodec's attention does not "
                             f"implement: unset {ENV_PRESET}")
        if coded and logits_soft_cap:
            raise ValueError(f"{ENV_PRESET} is set, but this model soft-caps attention logits, which flashcodec's "
                             f"attention does not implement: unset {ENV_PRESET}")

    def fused_output_quant_supported(self, quant_key: object) -> bool:
        """Never: the output stays in the model's dtype (vLLM then quantizes it outside attention)."""
        return False

    def fused_rope_kvcache_supported(self) -> bool:
        """Never: the store is ``do_kv_cache_update``'s (a fused RoPE + store would write stock rows)."""
        return False

    def _layer_format(self, layer: torch.nn.Module, kv_cache: torch.Tensor, dtype: torch.dtype) -> PageFormat | None:
        """This layer's format on its first call (None: a stock page, vLLM's attention serves it)."""
        if self._format is None and kv_cache.dtype == torch.uint8 and kv_cache.dim() == 4:
            owner = self.kv_sharing_target_layer_name or layer.layer_name  # a sharing layer reads its target's codes
            fmt = plugin_config().layer_format(extract_layer_index(owner), self.head_size, dtype)
            fmt.check_page(kv_cache.shape[2], kv_cache.shape[3])
            self._format = fmt
        return self._format

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Phase ``store`` of this step's tokens; the step's metadata (positions, block table) is read from vLLM's
        forward context (none in the profiling run: nothing stored)."""
        fmt = self._layer_format(layer, kv_cache, key.dtype)
        if fmt is None:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)  # type: ignore[misc]
            return
        attn_metadata = _layer_metadata(layer)
        if attn_metadata is None:
            return
        paged_store(fmt, key, value, kv_cache, slot_mapping, attn_metadata.block_table, attn_metadata.seq_lens,
                    attn_metadata.query_start_loc, "store", _plan(fmt, kv_cache, attn_metadata, slot_mapping, "store"))

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``attn_metadata``: the platform's (CPU or Triton metadata: ``num_actual_tokens``, ``block_table``,
        ``seq_lens``, ``query_start_loc``, ``max_query_len``); None in vLLM's profiling run, which the stock impl
        serves."""
        fmt = None if attn_metadata is None else self._layer_format(layer, kv_cache, query.dtype)
        if fmt is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,  # type: ignore[misc]
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the flashcodec backend")
        n = attn_metadata.num_actual_tokens
        out = output[:n].view(n, self.num_heads, self.head_size)
        paged_attention(fmt, query[:n], key[:n], value[:n], kv_cache, attn_metadata.block_table,
                        attn_metadata.seq_lens, attn_metadata.query_start_loc, self.scale, self.sinks, out,
                        attn_metadata.max_query_len)
        slot_mapping = _layer_slots(layer)
        if self.kv_sharing_target_layer_name is None and slot_mapping is not None:  # the storing layer's rings
            paged_store(fmt, key, value, kv_cache, slot_mapping, attn_metadata.block_table, attn_metadata.seq_lens,
                        attn_metadata.query_start_loc, "ring", _plan(fmt, kv_cache, attn_metadata, slot_mapping,
                                                                     "ring"))
        return output
