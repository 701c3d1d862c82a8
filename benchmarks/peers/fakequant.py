"""Fake-quantization cache layers for the benchmark peers: a peer's format decides which tokens are quantized and
what it stores; the layer keeps the dequantized values (quality is exact to the format) and reports the bytes the
real format keeps (:meth:`FakeQuantPolicy.stored_bytes`), not the bytes of its own bf16 buffers.

Attention of one call: the history as stored (dequantized where the format quantized it) plus that call's own
new states exactly, as transformers' ``QuantizedCache`` does; quantization happens after the call. Sliding-window
layers attend to the last ``sliding_window - 1`` tokens like transformers' ``DynamicSlidingWindowLayer`` and drop
older ones, except raw tokens whose quantization group is not complete yet (they are quantized with it, then
dropped; only a window shorter than the format's raw residual keeps any).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from flashcodec_fx import _compat

RAW_BYTES = 2  # a raw token is kept in 16 bits (bf16 / fp16), whatever dtype the model runs in


@dataclass(frozen=True)
class Span:
    """What one layer holds, in absolute token positions: tokens ``[first, length)`` are kept; keys before
    ``key_done`` and values before ``value_done`` are quantized, the rest raw. ``batch, heads, head_dim``: shape."""

    batch: int
    heads: int
    head_dim: int
    first: int
    length: int
    key_done: int
    value_done: int

    def raw_tokens(self, done: int) -> int:
        return self.length - max(self.first, done)

    def quantized_tokens(self, done: int) -> int:
        return max(done - self.first, 0)


class FakeQuantPolicy(ABC):
    """A peer format: which positions it has quantized at a given length, how it quantizes a span, its bytes."""

    name: str

    @abstractmethod
    def key_boundary(self, length: int) -> int:
        """Keys at absolute positions below this are quantized once the layer holds ``length`` tokens (monotone)."""

    @abstractmethod
    def value_boundary(self, length: int) -> int:
        """As :meth:`key_boundary`, for values."""

    @abstractmethod
    def quantize_keys(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Dequantized ``(B, H, T, D)`` keys of a span that starts on a boundary the policy produced."""

    @abstractmethod
    def quantize_values(self, values: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """As :meth:`quantize_keys`, for values."""

    @abstractmethod
    def stored_bytes(self, span: Span) -> dict[str, int]:
        """``{"archive_used": codes + scales, "tail": raw tokens}`` that the real format keeps for ``span``."""

    @abstractmethod
    def check_head_dim(self, head_dim: int) -> None:
        """Raise ``ValueError`` when the format cannot store vectors of ``head_dim``."""


class _FakeQuantMixin:
    """The update / bytes logic shared by the full-attention and the sliding-window layer."""

    def _setup(self, policy: FakeQuantPolicy, layer_idx: int) -> None:
        self.policy, self.layer_idx = policy, layer_idx
        self.first = self.key_done = self.value_done = 0
        self.cumulative_length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.policy.check_head_dim(key_states.shape[-1])
        keys = torch.cat([self.keys, key_states], dim=-2)  # positions [first, length)
        values = torch.cat([self.values, value_states], dim=-2)
        self.cumulative_length += key_states.shape[-2]
        length = self.cumulative_length
        window = getattr(self, "sliding_window", None)
        visible = keys.shape[-2] if window is None else min(keys.shape[-2], window - 1 + key_states.shape[-2])
        returned = keys[:, :, -visible:], values[:, :, -visible:]  # history as stored + this call's exact states
        stored_k, self.key_done = self._advance(keys, self.key_done, self.policy.key_boundary(length),
                                                self.policy.quantize_keys)
        stored_v, self.value_done = self._advance(values, self.value_done, self.policy.value_boundary(length),
                                                  self.policy.quantize_values)
        if window is not None:  # drop what left the window, once quantized (raw tokens wait for their group)
            first = max(self.first, min(length - (window - 1), self.key_done, self.value_done))
            stored_k, stored_v = stored_k[:, :, first - self.first:], stored_v[:, :, first - self.first:]
            self.first = first
        self.keys, self.values = stored_k, stored_v
        return returned

    def _advance(self, x: torch.Tensor, done: int, target: int, quantize) -> tuple[torch.Tensor, int]:
        """``x`` with positions ``[done, target)`` replaced by their dequantized values (a new tensor: the exact
        ``x`` is what this call attends to)."""
        if target <= done:
            return x, done
        a, b = done - self.first, target - self.first
        quantized = quantize(x[:, :, a:b].float(), self.layer_idx).to(x.dtype)
        return torch.cat([x[:, :, :a], quantized, x[:, :, b:]], dim=-2), target

    def span(self) -> Span:
        b, h, _, d = self.keys.shape
        return Span(b, h, d, self.first, self.cumulative_length, self.key_done, self.value_done)

    def storage_breakdown(self) -> dict[str, int]:
        parts = self.policy.stored_bytes(self.span())
        return {**parts, "total": parts["archive_used"] + parts["tail"]}


class FakeQuantLayer(_FakeQuantMixin, DynamicLayer):
    """A full-attention layer storing what ``policy`` stores (dequantized)."""

    def __init__(self, policy: FakeQuantPolicy, layer_idx: int):
        super().__init__()
        self._setup(policy, layer_idx)


class FakeQuantSlidingLayer(_FakeQuantMixin, DynamicSlidingWindowLayer):
    """A sliding-window layer storing what ``policy`` stores (dequantized), at most ``sliding_window - 1`` tokens."""

    def __init__(self, policy: FakeQuantPolicy, layer_idx: int, sliding_window: int):
        super().__init__(sliding_window=sliding_window)
        self._setup(policy, layer_idx)


class FakeQuantCache(Cache):
    """One fake-quant layer per model layer of ``config``: full-attention and sliding-window layers (any other
    layer type raises ``ValueError``)."""

    def __init__(self, config: Any, policy: FakeQuantPolicy):
        layer_types, layer_kwargs = _compat.layer_types_and_kwargs(config)
        layers = []
        for idx, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
            if kind == "full_attention":
                layers.append(FakeQuantLayer(policy, idx))
            elif kind == "sliding_attention":
                layers.append(FakeQuantSlidingLayer(policy, idx, kwargs["sliding_window"]))
            else:
                raise ValueError(f"{policy.name}: layer {idx} is a {kind!r} layer; only full_attention and "
                                 "sliding_attention layers are supported")
        super().__init__(layers=layers)

    def storage_breakdown(self) -> dict[str, int]:
        parts = [layer.storage_breakdown() for layer in self.layers if layer.is_initialized]
        return {key: sum(p[key] for p in parts) for key in ("archive_used", "tail", "total")}
