"""What a refused call must leave unchanged: every tensor and host-side field of a FlashCodecCache's codec layers."""

from __future__ import annotations

import torch


def snapshot(cache) -> list:
    """The state of ``cache`` (a FlashCodecCache or one FlashCodecLayer): tensors cloned (tokens held raw too), host
    mirrors and flags."""
    layers = cache.layers if hasattr(cache, "layers") else [cache]
    out = []
    for layer in layers:
        out += [layer.is_initialized, layer.handed_out, layer.attention_bound, getattr(layer, "_offloaded", None)]
        for stream in (layer.keys_stream, layer.values_stream):
            out += [stream._host_length, stream._host_start, stream.memo is None]
            out += [] if stream.state is None else [t.clone() for t in stream.state]
            held = stream.held_raw()  # tokens held raw (the raw prefix) and its first call past the sinks
            out += [] if held is None else [held[0].clone(), held[1]]
            out += [] if stream.memo is None else [_settled_memo(stream)]
    return out


def _settled_memo(stream) -> torch.Tensor:
    """The memo as stored: the rows a ``read(new)`` overlaid with the call's exact states put back (a copy)."""
    memo = stream.memo.clone()
    if stream._memo_owed is not None:
        lo, rows = stream._memo_owed
        memo[:, :, lo: lo + rows.shape[2]] = rows
    return memo


def same(a: list, b: list) -> bool:
    """Two snapshots are equal, tensors bitwise."""
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                    for x, y in zip(a, b, strict=True))
