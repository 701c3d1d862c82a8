"""Offloading a codec layer's stored form (transformers' ``Cache(offloading=True)`` protocol, eager only).

transformers offloads a layer to the CPU after its ``update`` and prefetches it back before the next one
(``Cache.offload`` / ``Cache.prefetch`` call the layer's ``offload`` / ``prefetch``). A codec layer moves what it
stores: the archive's filled groups (codes, scales, zero points, png indices), the raw sinks and tail, the mean and the
two 0-dim lengths; the archive's unused capacity stays behind and is allocated again on arrival. So a compressed layer
moves its compressed bytes, never a decoded view, except the memo of a layer that attends on the decoded view
(``materialization_free=False``), which moves with it (its filled positions).
"""

from __future__ import annotations

import torch

from ..cache import CodecStream
from ..ops.state import StreamState

HOST = torch.device("cpu")  # where transformers offloads to


def filled_groups(stream: CodecStream) -> int:
    """Archive groups holding tokens (host mirror: eager streams only)."""
    codec = stream.codec
    return max(0, stream.archived_tokens - codec.sinks) // codec.group


def allocated_groups(stream: CodecStream) -> int:
    """Archive groups the state holds (0 before the first append)."""
    return 0 if stream.state is None else stream.state.data.shape[2]


def covering_groups(stream: CodecStream) -> int:
    """The fewest archive groups whose positions cover the stored tokens (views span the capacity)."""
    codec = stream.codec
    return -(-max(0, stream.get_seq_length() - codec.sinks) // codec.group)


def _moved(t: torch.Tensor, device: torch.device, keep: int, size: int) -> torch.Tensor:
    """A new ``t`` on ``device`` holding ``size`` positions along dim 2, the first ``keep`` copied from ``t`` (one
    transfer of ``keep`` positions; zeros past them)."""
    out = torch.zeros((*t.shape[:2], size, *t.shape[3:]), dtype=t.dtype, device=device)
    out[:, :, :keep].copy_(t[:, :, :keep], non_blocking=True)
    return out


def move_stream(stream: CodecStream, device: torch.device, groups: int | None = None) -> None:
    """Move ``stream``'s state (and memo) to ``device``. Only the filled archive groups and the memo's stored
    positions travel; on arrival the archive holds ``groups`` groups (None: the fewest covering the stored tokens),
    zeros past the filled ones, and the memo spans the capacity."""
    if stream.state is None:
        return
    st, filled, length = stream.state, filled_groups(stream), stream.get_seq_length()
    groups = max(filled, covering_groups(stream) if groups is None else groups)
    archive = [_moved(t, device, filled, groups) for t in st[:4]]
    stream.state = StreamState(*archive, *(t.to(device, non_blocking=True) for t in st[4:]))
    if stream.memo is not None:
        stream.memo = _moved(stream.memo, device, length, stream.capacity)
