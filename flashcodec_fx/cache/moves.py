"""A :class:`~flashcodec_fx.cache.CodecStream`'s moves: to another device (offloading) and along the batch (beam
reorder, selection, repeat)."""

from __future__ import annotations

import torch

from ..ops.state import BATCHED_FIELDS, StreamState


def _moved(t: torch.Tensor, device: torch.device | str, keep: int, size: int) -> torch.Tensor:
    """A new ``t`` on ``device`` holding ``size`` positions along dim 2, the first ``keep`` copied from ``t`` (one
    transfer of ``keep`` positions; zeros past them)."""
    out = torch.zeros((*t.shape[:2], size, *t.shape[3:]), dtype=t.dtype, device=device)
    out[:, :, :keep].copy_(t[:, :, :keep], non_blocking=True)
    return out


class StreamMoves:
    """:class:`~flashcodec_fx.cache.CodecStream`'s device and batch moves (a part of that class: it replaces the
    stream's state, memo and raw prefix)."""

    def move_to(self, device: torch.device | str, groups: int | None = None) -> None:
        """Move the state (and memo) to ``device``, eager. Only the filled archive groups and the memo's stored
        positions travel; on arrival the archive holds ``groups`` groups (None: the fewest covering the stored
        tokens), zeros past the filled ones, and the memo spans the capacity (``FlashCodecLayer.offload``). Tokens
        held raw move as they are."""
        if self._raw is not None:
            self._raw = self._raw.to(device, non_blocking=True)
            return
        if self.state is None:
            return
        st, filled, length = self.state, self.filled_groups, self.get_seq_length()
        groups = max(filled, self.covering_groups if groups is None else groups)
        archive = st.archive()._fields
        self.state = StreamState(**{name: _moved(t, device, filled, groups) if name in archive
                                    else t.to(device, non_blocking=True) for name, t in st._asdict().items()})
        if self.memo is not None:
            self.memo = _moved(self.memo, device, length, self.capacity)

    def index_select(self, indices: torch.Tensor) -> None:
        """Reorder / select along batch (beam search): every state tensor and the memo move together. A static
        layout keeps its buffers (in-place permutation) when the batch size does not change."""
        if self._raw is not None:
            self._raw = self._raw.index_select(0, indices.to(self._raw.device))
            return
        if self.state is None:
            return
        self._repay_memo()
        indices = indices.to(self.state.tail.device)
        tensors = [t for t in (*self._batched(), self.memo) if t is not None]  # every batched tensor
        if self.layout == "static" and indices.shape[0] == self.state.tail.shape[0]:
            for t in tensors:  # same batch size (beam reorder): stable addresses for CUDA graphs
                t.copy_(t.index_select(0, indices))
            return
        self.state = self.state._replace(**{f: t.index_select(0, indices) for f, t in zip(
            BATCHED_FIELDS, self._batched(), strict=True)})
        if self.memo is not None:
            self.memo = self.memo.index_select(0, indices)
        self._mark_static_shapes()

    def _batched(self) -> list[torch.Tensor]:
        """The state's tensors with a batch dim (every field but the lengths), in :data:`BATCHED_FIELDS` order."""
        return [getattr(self.state, f) for f in BATCHED_FIELDS]

    def repeat_interleave(self, repeats: int) -> None:
        if self._raw is not None:
            self._raw = self._raw.repeat_interleave(repeats, dim=0)
            return
        if self.state is None:
            return
        self._repay_memo()
        self.state = self.state._replace(**{f: t.repeat_interleave(repeats, dim=0) for f, t in zip(
            BATCHED_FIELDS, self._batched(), strict=True)})
        if self.memo is not None:
            self.memo = self.memo.repeat_interleave(repeats, dim=0)
        self._mark_static_shapes()
