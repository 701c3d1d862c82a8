"""Byte accounting: what a cache keeps for its tokens, what it holds in all, and bits per cached value."""

from __future__ import annotations

from typing import Any

import torch


def _tensor_bytes(obj: Any) -> int:
    """Bytes of a tensor, including the inner tensors of a tensor subclass (e.g. optimum-quanto's packed QTensor)."""
    if not isinstance(obj, torch.Tensor):
        return 0
    if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
        names, _ = obj.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(obj, name)) for name in names)
    return obj.nbytes


def cache_bytes(cache: Any) -> dict[str, int]:
    """``{"kv": bytes kept for the tokens, "held": every byte held}``.

    A cache with ``storage_breakdown()``: FlashCodecCache: ``kv`` = ``stored`` (the tokens as stored: filled archive
    groups with scales and zero points, raw sinks, the tail rows holding tokens, the mean) + ``native`` (layers
    without a codec); the benchmark peers: ``archive_used`` + ``tail`` (+ ``native``); ``held`` = its ``total``
    (allocated capacity, memoized views). Other caches: every tensor attribute of every layer (a raw
    ``DynamicCache`` holds exactly its tokens).
    """
    storage = getattr(cache, "storage_breakdown", None)
    if callable(storage):
        parts = storage()
        kept = parts["stored"] if "stored" in parts else parts["archive_used"] + parts["tail"]
        return {"kv": kept + parts.get("native", 0), "held": parts["total"]}
    total = 0
    for layer in cache.layers:
        total += sum(_tensor_bytes(value) for value in vars(layer).values())
    return {"kv": total, "held": total}


def cached_values(cache: Any) -> int:
    """Number of values (keys + values, every layer) that a raw cache such as ``DynamicCache`` keeps: the
    denominator of bits per value (a sliding layer counts only the tokens its window keeps)."""
    return sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers if layer.is_initialized)


def bits_per_value(kv_bytes: int, values: int) -> float:
    """Stored bits per cached value: ``8 * kv_bytes / values`` (a bf16 cache is 16)."""
    if values <= 0:
        raise ValueError(f"values must be > 0, got {values}")
    return 8 * kv_bytes / values
