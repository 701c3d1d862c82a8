"""How a :class:`~flashcodec_fx.cache.CodecStream`'s storage comes to be and grows: the raw prefix (the first tokens
held as one raw tensor until the codec's state fits in their bytes, :mod:`flashcodec_fx.raw_prefix`), the state's
allocation, and the dynamic archive's growth on overflow."""

from __future__ import annotations

import torch

from .. import _compat, ops, raw_prefix
from ..ops.state import StreamState, capacity
from ..raw_prefix import RAW_CODEC, compresses, first_call_after, prefix_length, replay_calls

INITIAL_POSITIONS = 256
GROWTH_DIVISOR = 16  # a full dynamic archive grows by 1/16 of its capacity (held <= 1.07x stored, amortized O(1) copies)
GROWTH_MIN_POSITIONS = 64


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class StreamGrowth:
    """:class:`~flashcodec_fx.cache.CodecStream`'s allocation, raw prefix and growth (a part of that class: it reads
    and sets the stream's ``codec``, ``layout``, ``state``, ``memo``, raw prefix and host mirrors)."""

    def _groups_for(self, positions: int) -> int:
        return raw_prefix.groups_for(self.codec, positions)

    def _allocate(self, like: torch.Tensor, groups: int) -> None:
        b, h, _, d = like.shape
        codec = self.codec.resolved(like.dtype)
        self.spec = codec.spec
        self.state = ops.empty_state(codec, b, h, groups, d, like.dtype, like.device)
        ops.warm(self.codec, d, like.device)  # device constants now, never inside a CUDA-graph capture
        self.memo = like.new_zeros(b, h, capacity(self.codec, self.state), d) if self.memoize else None
        self._mark_static_shapes()

    def _mark_static_shapes(self) -> None:
        """Static layout: every state size is a constant to Dynamo. A recompile for another codec (other state shapes)
        then compiles another static graph instead of turning the sizes symbolic (automatic dynamic shapes)."""
        if self.layout == "static":
            for t in (*self.state, self.memo):
                if t is not None:
                    _compat.mark_static(t)

    def _grow(self, groups: int) -> None:
        old, n = self.state, self.state.data.shape[2]
        b, h, _, d = old.tail.shape
        archive = self.codec.empty_archive((b, h), groups, d, self.dtype, old.tail.device)
        for new, prev in zip(archive, old[:4], strict=True):
            new[:, :, :n].copy_(prev)
        self.state = StreamState(*archive, *old[4:])
        if self.memo is not None:
            memo = self.memo.new_zeros(b, h, capacity(self.codec, self.state), d)
            memo[:, :, : self.memo.shape[2]].copy_(self.memo)
            self.memo = memo

    def _grown_groups(self, like: torch.Tensor, need: int) -> int:
        """Capacity after an overflow: doubled up to 64 positions, then 64 more, then 1/16 more; for a codec that
        compresses, never past the raw budget at the new length (which its raw prefix reaches before it allocates).
        A codec that stores raw (``lossless``: its budget never leaves room) takes 1/16 more (past its raw prefix of
        64 tokens, at least 4 positions: amortized), another codec that does not compress the step."""
        have, codec = self.state.data.shape[2], self.codec
        if codec.stores_raw:
            return max(need, have + max(1, have // GROWTH_DIVISOR))
        step = max(1, min(ceil_div(GROWTH_MIN_POSITIONS, codec.group), have), have // GROWTH_DIVISOR)
        target = max(need, have + step)
        if not compresses(codec, like.shape[3], like.dtype):
            return target
        return max(need, min(target, self.raw_budget_groups(like, self._host_length + like.shape[2])))

    def _initial_groups(self, like: torch.Tensor, length: int) -> int:
        """Dynamic: the groups a first allocation for ``length`` tokens takes (up to 256 positions, within the raw
        budget while the codec compresses)."""
        budget = self.raw_budget_groups(like, length)
        return max(1, self._groups_for(length), min(self._groups_for(INITIAL_POSITIONS), budget))

    def prepare(self, like: torch.Tensor) -> None:
        """Allocate the storage for tokens shaped like ``like (B, H, T, D)`` if it is not there yet (static: the whole
        capacity; dynamic: the initial one, or an empty raw prefix when ``T`` is short of
        :func:`~flashcodec_fx.raw_prefix.prefix_length`, eager)."""
        if self.is_initialized:
            return
        if self.layout == "static":
            self._allocate(like, self._groups_for(self.positions))
            return
        until = self._prefix_length(like)
        if like.shape[2] >= until:
            self._allocate(like, self._initial_groups(like, like.shape[2]))
        else:
            self._start_prefix(like, until)

    def _prefix_length(self, like: torch.Tensor) -> int:
        """The raw prefix of tokens like ``like (B, H, T, D)``: :func:`~flashcodec_fx.raw_prefix.prefix_length`;
        0 (none) for the static layout and in compiled code."""
        if self.layout == "static" or not self._raw_prefix or torch.compiler.is_compiling():
            return 0
        return prefix_length(self.codec, like.shape[3], self._dtype_like(like))

    def _dtype_like(self, like: torch.Tensor) -> torch.dtype:
        """The stream dtype of tokens like ``like``: the stream's own once it has a state (``like`` may then be its
        raw rows, narrower under ``raw=bfloat16``), else ``like``'s."""
        return like.dtype if self.state is None else self.dtype

    def _start_prefix(self, like: torch.Tensor, until: int) -> None:
        """Hold tokens like ``like (B, H, T, D)`` raw (none yet) until ``until`` tokens."""
        b, h, _, d = like.shape
        ops.warm(RAW_CODEC, d, like.device)  # the ops read the held tokens as a RAW_CODEC state
        self._raw = like.new_empty(b, h, 0, d, dtype=self._dtype_like(like))
        self._first_call, self._prefix_until = None, until

    def raw_budget_groups(self, like: torch.Tensor, length: int) -> int:
        """Archive groups whose bytes, with the raw sink and tail rows, the mean and the two 0-dim lengths, fit in what
        an uncompressed stream of ``length`` tokens like ``like (B, H, T, D)`` takes per ``(batch, head)`` row
        (:func:`flashcodec_fx.raw_prefix.raw_budget_groups`)."""
        return raw_prefix.raw_budget_groups(self.codec, like.shape[3], like.dtype, length)

    def _hold(self, x: torch.Tensor) -> None:
        """Raw prefix: ``x (B, H, T, D)`` joins the held tokens (a new tensor of exactly the held length, as a
        DynamicCache's; the prefix is short of ``prefix_length`` tokens, so this copy is bounded)."""
        n, t = self._host_length, x.shape[2]
        self._raw = torch.cat([self._raw, x], dim=2)
        self._first_call = first_call_after(self._first_call, n, t, self.codec.sinks)
        self._host_length = n + t

    @_compat.disable_dynamo
    def _convert(self, x: torch.Tensor) -> torch.Tensor:
        """Leave the raw prefix before appending ``x (B, H, T, D)``: allocate the codec state for the held tokens and
        ``x``, and append the held ones as the calls of :func:`~flashcodec_fx.raw_prefix.replay_calls`. Returns the
        part of ``x`` still to append (all of it, unless a crop cut into the first call past the sinks). Eager, also
        when a compiled step converts (a graph break, once per stream)."""
        raw, n, first = self._raw, self._host_length, self._first_call
        self._raw, self._first_call, self._prefix_until, self._host_length = None, None, 0, 0
        self._allocate(x, self._initial_groups(x, n + x.shape[2]))
        for lo, hi in replay_calls(first, n, x.shape[2]):
            if lo >= n:
                return x[:, :, lo - n:]
            self._write(raw[:, :, lo:hi] if hi <= n else torch.cat([raw[:, :, lo:], x[:, :, : hi - n]], dim=2), False)
        return x[:, :, x.shape[2]:]

    def held_raw(self) -> tuple[torch.Tensor, tuple[int, int] | None] | None:
        """While the tokens are held raw: ``(tokens (B, H, n, D), first_call)``, ``first_call`` the positions of the
        first call past the sinks (None before it): what a file keeps of the stream (persist/stream_io.py); else None."""
        return None if self._raw is None else (self._raw, self._first_call)

    def hold_raw(self, tokens: torch.Tensor, first_call: tuple[int, int] | None) -> None:
        """Forget every token and hold ``tokens (B, H, n, D)`` raw, as a stream whose first call past the sinks had
        positions ``first_call`` (a :meth:`held_raw` result, checked by the caller: n short of the prefix length)."""
        self.reset()
        self._start_prefix(tokens, prefix_length(self.codec, tokens.shape[3], tokens.dtype))
        self._raw, self._first_call, self._host_length = tokens, first_call, tokens.shape[2]
