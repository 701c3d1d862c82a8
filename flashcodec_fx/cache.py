"""`CodecKVCache`: the storage engine for one attention layer's K and V streams (no transformers import).

A stream keeps the state of ``ops/state.py`` (archive groups, fp16 scales, raw sinks and tail, the per-channel mean
and channel exponents, a 0-dim device length) and, optionally, a memo: the decoded view attention reads, updated
once per archived group.

Layouts:
- ``dynamic``: the first tokens are held raw, one ``(B, H, n, D)`` tensor as a DynamicCache holds them, until the
  codec's state fits in the same bytes (:mod:`flashcodec_fx.raw_prefix`: a few dozen tokens for the lossy presets,
  64 for ``lossless``); then the state is allocated for that length and the tokens are appended into it (bitwise the
  state the same calls build without the prefix). The archive grows by 1/16 (at least 64 positions; a codec storing
  raw: 1/16) on overflow, never past what an uncompressed cache of the same length would hold while the codec
  compresses (:meth:`CodecStream.raw_budget_groups`); a host-side length mirror drives growth.
- ``static``: preallocated for ``max_length`` tokens; ``append`` never branches on tensor values on the host,
  so a decode step compiles to one graph and can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch

from . import _compat, ops, raw_prefix
from .codecs import Codec, Encoded, PNGCodec, codec_from_spec, make_codec
from .ops.reference.normalize import from_stored, to_stored
from .ops.reference.read import overlay_new
from .ops.state import BATCHED_FIELDS, StreamState, advance, capacity, stream_dtype
from .raw_prefix import RAW_CODEC, RAW_SPEC, compresses, first_call_after, prefix_length, raw_state, replay_calls

LAYOUTS = ("dynamic", "static")
CROP_MODES = ("decode", "exact")  # the first is the default
INITIAL_POSITIONS = 256
GROWTH_DIVISOR = 16  # a full dynamic archive grows by 1/16 of its capacity (held <= 1.07x stored, amortized O(1) copies)
GROWTH_MIN_POSITIONS = 64
STORAGE_PARTS = ("archive", "scales", "sinks", "tail", "mean", "norm", "memo")
GROUP_PARTS = ("archive_held", "archive_used")  # archive groups with their scales: allocated, filled (not in total)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _moved(t: torch.Tensor, device: torch.device | str, keep: int, size: int) -> torch.Tensor:
    """A new ``t`` on ``device`` holding ``size`` positions along dim 2, the first ``keep`` copied from ``t`` (one
    transfer of ``keep`` positions; zeros past them)."""
    out = torch.zeros((*t.shape[:2], size, *t.shape[3:]), dtype=t.dtype, device=device)
    out[:, :, :keep].copy_(t[:, :, :keep], non_blocking=True)
    return out


class CodecOverflowError(IndexError, ValueError):
    """More tokens than a static layout holds (an ``IndexError`` as transformers' StaticCache raises, and a
    ``ValueError`` as every other rejected argument here)."""


class CodecStream:
    """One compressed ``(B, H, S, D)`` stream. Storage is allocated on the first append; a dynamic stream (eager)
    holds its first tokens raw (:attr:`raw_prefix`) and allocates the codec's state when it fits in their bytes.

    ``memoize``: keep the decoded view (costs a full-precision copy; only for attention on the view). ``crop``:
    ``"decode"`` (the default: a crop into an archived group reopens it, its kept tokens back in the raw tail as the
    values attention read, so the view after a crop is the prefix of the view before it and every crop succeeds) or
    ``"exact"`` (every crop is a bitwise rollback or raises: a crop that would reopen a group whose decode is not the
    tokens given raises and changes nothing). See :meth:`crop`."""

    def __init__(self, codec: Codec, layout: str = "dynamic", max_length: int | None = None, memoize: bool = False,
                 crop: str = "decode", positions: int | None = None):
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a flashcodec_fx Codec (see make_codec), got {type(codec).__name__}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if layout == "static":
            if isinstance(max_length, bool) or not isinstance(max_length, int):
                raise TypeError(f"max_length must be an int for the static layout, got {type(max_length).__name__}")
            if max_length < 1:
                raise ValueError(f"max_length must be a positive int for the static layout, got {max_length!r}")
        if not isinstance(memoize, bool):
            raise TypeError(f"memoize must be a bool, got {type(memoize).__name__}")
        if crop not in CROP_MODES:
            raise ValueError(f"crop must be one of {CROP_MODES}, got {crop!r}")
        memoize = memoize and not codec.stores_raw  # a raw stored form is its own view
        self.codec, self.layout, self.max_length, self.memoize, self.crop_mode = codec, layout, max_length, memoize, crop
        # the spec of what the ops store: the codec's, resolved for the stream dtype when the state is allocated
        # (``Codec.resolved``: raw_dtype="auto" keeps an fp32 stream's raw rows in bf16 where the codec is lossy). A
        # str built once: compiled steps pass it to the ops as a constant, never format it
        self.spec = codec.spec
        # static: positions to allocate (>= max_length; K and V of a layer get the same, see CodecKVCache)
        self.positions = max_length if positions is None else positions
        self.state: StreamState | None = None
        self.memo: torch.Tensor | None = None
        self._host_length = 0  # host mirrors of the device length and archive end: growth, bounds, crop, accounting
        self._host_start = codec.sinks
        self._stale = False  # a compiled append ran: the mirror is refreshed (one sync) the next time it is read
        self._memo_owed: tuple[int, torch.Tensor] | None = None  # (position, rows): stored rows a read(new) overlaid
        self.shared = False  # the archive is another stream's too (persist/fork.py): copied before it is written
        # the raw prefix (raw_prefix.py): the tokens (B, H, n, D) while held raw (never written in place: forks share
        # it), the positions of the first call past the sinks, and the length that converts
        self._raw: torch.Tensor | None = None
        self._first_call: tuple[int, int] | None = None
        self._prefix_until = 0

    _raw_prefix = True  # False: allocate the codec state on the first append (tests compare with it)

    @property
    def is_initialized(self) -> bool:
        return self.state is not None or self._raw is not None

    @property
    def raw_prefix(self) -> bool:
        """Whether the stream holds its tokens raw for now (no codec state yet; see :mod:`flashcodec_fx.raw_prefix`)."""
        return self._raw is not None

    @property
    def tail(self) -> torch.Tensor | None:
        """The raw rows of the newest tokens ``(B, H, rows, D)``: the state's tail, every token while they are held raw
        (:attr:`raw_prefix`), None before the first append."""
        return self._raw if self.state is None else self.state.tail

    @property
    def dtype(self) -> torch.dtype | None:
        """The stream dtype (of the tokens it takes, its view and attention over it; None before the first append).
        Its raw rows (:attr:`tail`, the sinks) may be narrower: see :attr:`raw_dtype`."""
        if self._raw is not None:
            return self._raw.dtype
        return None if self.state is None else stream_dtype(codec_from_spec(self.spec), self.state.tail)

    @property
    def raw_dtype(self) -> torch.dtype | None:
        """The dtype of the raw rows stored (sinks, tail; the tokens held raw): the stream dtype, or bf16 for an fp32
        stream of a lossy codec (``raw_dtype="auto"``, :meth:`~flashcodec_fx.codecs.Codec.resolved`)."""
        return None if self.tail is None else self.tail.dtype

    @property
    def length(self) -> torch.Tensor | None:
        """The state's 0-dim device length (None without a codec state: before the first append, or held raw)."""
        return None if self.state is None else self.state.length

    @property
    def capacity(self) -> int:
        """Positions the allocated state holds (the tokens held raw; 0 before the first append)."""
        if self._raw is not None:
            return self._raw.shape[2]
        return 0 if self.state is None else capacity(self.codec, self.state)

    @property
    def archived_tokens(self) -> int:
        """Tokens held by the sinks and the archive (host mirror; none while held raw)."""
        n = self.get_seq_length()
        return 0 if self._raw is not None else min(n, self._host_start)

    @property
    def filled_groups(self) -> int:
        """Archive groups holding tokens (host mirror)."""
        return max(0, self.archived_tokens - self.codec.sinks) // self.codec.group

    @property
    def allocated_groups(self) -> int:
        """Archive groups the state holds (0 before the first append)."""
        return 0 if self.state is None else self.state.data.shape[2]

    @property
    def covering_groups(self) -> int:
        """The fewest archive groups whose positions cover the stored tokens (views span the capacity)."""
        return self._groups_for(self.get_seq_length())

    @property
    def exact_crop(self) -> bool:
        """Whether reopening an archived group gives back the exact tokens (png lossless on 16-bit streams, or a codec
        that stores every token raw)."""
        if self.codec.stores_raw:
            return True
        return isinstance(self.codec, PNGCodec) and not self.codec.pruned and self.is_initialized \
            and self.tail.dtype in (torch.float16, torch.bfloat16)

    @property
    def exact_rollback(self) -> bool:
        """Whether every crop is an exact rollback (crop, then the dropped tokens appended again in the same calls,
        leaves every stored tensor as if the crop never happened, bitwise): per-token groups (``G = 1``: every crop
        is at a group boundary; every preset) or exact reopening (:attr:`exact_crop`). Other block codecs (``G > 1``)
        roll back exactly inside their raw tail and at group boundaries only."""
        return self.exact_crop or self.codec.group == 1

    @property
    def croppable(self) -> bool:
        """Whether every crop succeeds, at any depth (what transformers' assisted decoding needs): always with
        ``crop="decode"`` (the default: a crop into an archived group reopens it with its decoded values), and with
        ``crop="exact"`` where every crop is an exact rollback (:attr:`exact_rollback`)."""
        return self.crop_mode == "decode" or self.exact_rollback

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
        step = max(1, min(_ceil_div(GROWTH_MIN_POSITIONS, codec.group), have), have // GROWTH_DIVISOR)
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

    def check_new(self, x: torch.Tensor) -> None:
        """Reject tokens this stream cannot take, before any state changes."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"new tokens must be a (B, H, T, D) tensor, got {type(x).__name__}")
        if x.dim() != 4 or x.shape[2] < 1:
            raise ValueError(f"new tokens must be a (B, H, T, D) tensor with T >= 1, got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"new tokens must be a floating tensor, got {x.dtype}")
        self.codec.check_head_dim(x.shape[3])
        if self.is_initialized:
            b, h, _, d = self.tail.shape
            if (x.shape[0], x.shape[1], x.shape[3]) != (b, h, d) or x.dtype != self.dtype:
                raise ValueError(f"new tokens must be ({b}, {h}, T, {d}) {self.dtype}, got {x.dtype} "
                                 f"{tuple(x.shape)}")
        if self.layout == "static" and self.get_seq_length() + x.shape[2] > self.max_length:
            raise CodecOverflowError(f"static cache holds max_length={self.max_length} tokens; "
                                     f"{self._host_length} stored + {x.shape[2]} new exceeds it")

    def append(self, x: torch.Tensor, checked: bool = False) -> None:
        """Append ``x (B, H, T, D)``; complete groups are archived on the device. ``checked``: the caller already
        ran :meth:`check_new` (validate once per call path)."""
        compiling = torch.compiler.is_compiling()
        if not compiling and not checked:
            self.check_new(x)
        self._repay_memo()
        self.prepare(x)
        if self._raw is not None:
            if not compiling and self._host_length + x.shape[2] < self._prefix_until:
                self._hold(x)
                return
            x = self._convert(x)  # a compiled step works on the codec state: converts first
            if x.shape[2] == 0:
                return
        t = x.shape[2]
        if self.shared and advance(self.codec, self._host_start, self._host_length + t) > self._host_start:
            self._own_archive()  # copy-on-append
        if self.layout == "dynamic":
            need = self._groups_for(self._host_length + t)
            if need > self.state.data.shape[2]:
                self._grow(self._grown_groups(x, need))
        self._write(x, compiling)

    def _own_archive(self) -> None:
        """Copy the archive if it is another stream's too (:mod:`flashcodec_fx.persist.fork`), before writing it."""
        if self.shared:
            self.state = StreamState(*(a.clone() for a in self.state[:4]), *self.state[4:])
            self.shared = False

    def _write(self, x: torch.Tensor, compiling: bool) -> None:
        """One ``flashcodec::append`` of ``x (B, H, T, D)`` into the allocated state, and the host mirrors after it."""
        t = x.shape[2]
        torch.ops.flashcodec.append(list(self.state), x.contiguous(), self.spec, self.memo)
        if compiling:
            self._stale = True  # a side effect Dynamo replays after the graph; never read in compiled code
        else:
            self._host_start = advance(self.codec, self._host_start, self._host_length + t)
            self._host_length += t

    def _hold(self, x: torch.Tensor) -> None:
        """Raw prefix: ``x (B, H, T, D)`` joins the held tokens (a new tensor of exactly the held length, as a
        DynamicCache's; the prefix is short of ``prefix_length`` tokens, so this copy is bounded)."""
        n, t = self._host_length, x.shape[2]
        self._raw = torch.cat([self._raw, x], dim=2)
        self._first_call = first_call_after(self._first_call, n, t, self.codec.sinks)
        self._host_length = n + t

    @torch.compiler.disable
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

    def read(self, new: torch.Tensor | None = None) -> torch.Tensor:
        """The view attention reads ``(B, H, L, D)`` (one decode of the archive unless memoized).

        ``new``: the current call's tokens (already appended), read exactly at the last positions whatever the
        archive stored for them. Dynamic: ``L`` is the stored length. Static: ``L`` is the capacity; positions past
        the length are zeros, to be masked. With a memo the view is the memo itself: this call's archived tokens are
        overlaid in place (their stored rows kept aside, ``O(T)``, and written back by the next call on the stream).
        """
        if self._raw is not None:
            return self._raw  # held raw: the tokens themselves, ``new`` among them
        if self.state is None:
            raise RuntimeError("read() before any token was appended")
        if self.codec.stores_raw and not torch.compiler.is_compiling():
            view = self.state.data.flatten(2, 3)  # the archive holds the tokens themselves: no decode, no copy
        elif self.memo is None:
            view = torch.ops.flashcodec.read(list(self.state), self.spec, new)
        elif torch.compiler.is_compiling():
            view = self.memo if new is None else overlay_new(self.memo, new, self.state.length)
        else:
            self._repay_memo()
            if new is not None:
                self._overlay_memo(new)
            view = self.memo
        return view if self.layout == "static" else view[:, :, : self.get_seq_length()]

    def _overlay_memo(self, new: torch.Tensor) -> None:
        """Write this call's tokens ``new (B, H, T, D)`` over the memo rows of those already archived (eager)."""
        n, t = self.get_seq_length(), new.shape[2]
        lo, hi = max(n - t, self.codec.sinks), min(n, self._host_start)
        if hi > lo:
            self._memo_owed = (lo, self.memo[:, :, lo:hi].clone())
            self.memo[:, :, lo:hi].copy_(new[:, :, lo - (n - t): hi - (n - t)])

    def _repay_memo(self) -> None:
        """Put back the stored rows a ``read(new)`` overlaid (before anything else reads or changes the memo)."""
        if self._memo_owed is not None:
            lo, rows = self._memo_owed
            self._memo_owed = None
            if self.memo is not None:
                self.memo[:, :, lo: lo + rows.shape[2]].copy_(rows)

    def get_seq_length(self) -> int:
        """Stored tokens, a host int: the mirror kept by eager appends, refreshed from the device length (one sync,
        outside any decode step) after compiled appends."""
        if not torch.compiler.is_compiling() and self._stale:  # never read while tracing: Dynamo would guard on it
            self._host_length, self._host_start, self._stale = int(self.state.length), int(self.state.start), False
            if self.layout == "static" and self._host_length > self.max_length:
                raise RuntimeError(f"static stream overflow: {self._host_length} tokens were appended but max_length="
                                   f"{self.max_length}; tokens past the capacity were dropped. Guard the length in "
                                   f"the caller of a compiled step, or reset() the stream")
        return self._host_length

    def crop(self, n: int) -> None:
        """Keep the first ``n`` tokens (``n < 0`` drops ``-n``; past the start empties the stream, as transformers'
        DynamicLayer does). A crop inside the raw tail (at least the window deep, once the window is filled), or to a
        group boundary (any depth for per-token codecs), is an exact rollback: crop + re-append of the same tokens
        equals never cropping, bitwise. A crop inside an archived group reopens it: the group leaves the archive and
        its kept tokens come back into the raw tail as the values attention read (one decode of that group alone,
        ``O(G)``; the memo's rows where kept). That is the tokens given for png ``keep_ratio=1.0`` on 16-bit streams
        (an exact rollback), within fp rounding of them on fp32 streams, and a lossy codec's decoded values otherwise;
        the reopened rows read as before until their group is archived again, encoded from those values.
        ``crop="exact"`` refuses (ValueError, nothing changed) a reopening that is not the tokens given. Tokens held
        raw crop exactly at any depth; a dynamic stream cropped to nothing holds its tokens raw again (its state
        released: as a new stream)."""
        keep = self.check_crop(n)
        self._repay_memo()
        length = self.get_seq_length()
        if not self.is_initialized or keep == length:
            return
        if self._raw is not None:  # held raw: exact at any depth (the kept rows copied: no storage left behind)
            self._raw = self._raw[:, :, :keep].clone()
            if keep <= self.codec.sinks:
                self._first_call = None  # as the mean is reset: the next call past the sinks sets it
            self._host_length = keep
            return
        until = 0 if keep else self._prefix_length(self.state.tail)
        if until:  # emptied: held raw again, the state released
            self._start_prefix(self.state.tail, until)
            self.state, self.memo, self.shared = None, None, False
            self._host_length, self._host_start = 0, self.codec.sinks
            return
        codec, st, start = self.codec, self.state, self._host_start
        if keep >= start:  # inside the tail: drop raw rows
            st.tail[:, :, keep - start:].zero_()
        else:
            reopened, filled = self._reopened(keep), self.filled_groups
            rows = torch.zeros_like(st.tail)
            if keep > reopened:
                rows[:, :, : keep - reopened] = self._reopened_rows(reopened, keep)
            self._own_archive()  # a fork's shared archive is copied before the crop zeroes groups of it
            st = self.state
            st.tail.copy_(rows)
            st.start.fill_(reopened)
            first_open = (reopened - codec.sinks) // codec.group
            for t in st[:4]:  # the reopened and later groups hold nothing any more (past the filled ones: zeros)
                if t.numel():
                    t[:, :, first_open:filled].zero_()
            self._host_start = reopened
        if keep < codec.sinks:
            st.sink[:, :, keep:].zero_()
        if codec.center and keep <= codec.sinks:
            st.mean.zero_()
        if codec.normalize and keep <= codec.sinks:  # as the mean: the next call past the sinks measures again
            st.sink.copy_(from_stored(codec, st, st.sink))
            st.norm.zero_()
        if self.memo is not None:  # zeros past the length
            self.memo[:, :, keep:length].zero_()
        st.length.fill_(keep)
        self._host_length = keep

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
        archive = [_moved(t, device, filled, groups) for t in st[:4]]
        self.state = StreamState(*archive, *(t.to(device, non_blocking=True) for t in st[4:]))
        if self.memo is not None:
            self.memo = _moved(self.memo, device, length, self.capacity)

    def drop_front(self, tokens: int) -> None:
        """Forget the oldest ``tokens`` positions: whole archive groups (dynamic layout, a codec without sinks; a
        sliding-window layer's ring). Positions renumber from 0; the buffers keep their capacity (one roll per group
        that leaves, never per step)."""
        codec = self.codec
        if self.layout != "dynamic" or codec.sinks:
            raise ValueError(f"drop_front needs the dynamic layout and a codec without sinks, got layout="
                             f"{self.layout!r}, sinks={codec.sinks}")
        if tokens % codec.group or not 0 <= tokens <= self._host_start:
            raise ValueError(f"drop_front: tokens must be a multiple of the group {codec.group} in 0.."
                             f"{self._host_start} (the archived tokens), got {tokens}")
        if tokens == 0 or self.state is None:
            return
        self._repay_memo()
        groups, st = tokens // codec.group, self.state
        rolled = [t.roll(-groups, dims=2) if t.numel() else t for t in st[:4]]
        for t in rolled:
            if t.numel():
                t[:, :, t.shape[2] - groups:].zero_()
        self.state = StreamState(*rolled, *st[4:])
        st.length.sub_(tokens)
        st.start.sub_(tokens)
        if self.memo is not None:
            self.memo = self.memo.roll(-tokens, dims=2)
            self.memo[:, :, self.memo.shape[2] - tokens:].zero_()
        self._host_length -= tokens
        self._host_start -= tokens

    def _reopened(self, keep: int) -> int:
        """Start of the archive group holding position ``keep`` (the archive's end after a crop to ``keep``)."""
        codec = self.codec
        return codec.sinks + max(0, keep - codec.sinks) // codec.group * codec.group

    def _reopened_rows(self, reopened: int, keep: int) -> torch.Tensor:
        """Positions ``reopened .. keep - 1`` of the archive group starting at ``reopened``, as tail rows ``(B, H,
        keep - reopened, D)`` in the stored domain: what :meth:`read` gives there (the memo's rows where kept; else
        ``flashcodec::read`` of a state holding that group alone, so a crop decodes ``G`` positions, never the
        history)."""
        codec, st = self.codec, self.state
        if self.memo is not None:
            view = self.memo[:, :, reopened:keep]
        else:
            group = (reopened - codec.sinks) // codec.group
            end = torch.full_like(st.start, codec.sinks + codec.group)  # the group archived, no tail row
            alone = StreamState(*(t[:, :, group: group + 1].contiguous() for t in st[:4]), *st[4:7], end, end, st.norm)
            view = torch.ops.flashcodec.read(list(alone), self.spec)[:, :, codec.sinks: codec.sinks + keep - reopened]
        return to_stored(codec, st, view)

    def check_crop(self, n: int) -> int:
        """The length :meth:`crop` ``(n)`` leaves; raises (TypeError, ValueError) where crop would, changing nothing."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        length = self.get_seq_length()
        keep = max(0, length + n) if n < 0 else min(n, length)
        start = self._host_start
        if self.state is not None and keep < min(start, length) and self.crop_mode == "exact" and not self.exact_crop:
            reopened = self._reopened(keep)
            if keep > reopened:
                raise ValueError(f"a crop of {length - keep} tokens (to {keep}) would reopen archived tokens "
                                 f"{reopened}..{keep - 1} of a codec that cannot give them back exactly, and "
                                 f"crop='exact' asks for exact rollbacks; crop at most "
                                 f"{length - max(start, min(length, self.codec.sinks))} tokens here, or build the "
                                 f"cache with crop='decode' (the default: reopened tokens come back as the values "
                                 f"attention read)")
        return keep

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

    def reset(self) -> None:
        """Forget every token. Dynamic: the storage is released (the next append may bring another batch size);
        static: zeroed in place (stable buffer addresses)."""
        self._memo_owed = None
        self._raw, self._first_call, self._prefix_until = None, None, 0
        if self.layout == "dynamic":
            self.state, self.memo = None, None
        elif self.state is not None:
            for t in (*self.state, self.memo):
                if t is not None:
                    t.zero_()
            self.state.start.fill_(self.codec.sinks)
        self._host_length, self._host_start, self._stale = 0, self.codec.sinks, False

    def release_memo(self) -> None:
        """Drop the memoized view (attention on the stored form never reads it)."""
        self.memo, self.memoize, self._memo_owed = None, False, None

    def start_memo(self) -> None:
        """Keep the decoded view from now on (one decode of what is stored; later appends update it). A raw stored form
        is its own view: nothing to keep (tokens held raw: the memo is made when the codec state is)."""
        if self.codec.stores_raw:
            return
        if self.state is not None and self.memo is None:
            self.memo = torch.ops.flashcodec.read(list(self.state), self.spec)
        self.memoize = True

    def storage_breakdown(self) -> dict[str, int]:
        """Every byte held, by part: ``archive`` (codes / coefficients, allocated capacity), ``scales`` (scales, zero
        points, png indices), ``sinks``, ``tail`` (raw rows + length), ``mean``, ``norm`` (channel exponents), ``memo``,
        and ``total``.
        Not added into ``total``: ``archive_held``, every allocated group's archive + scales; ``archive_used``, the
        filled groups' archive + scales (at most ``archive_held``); ``stored``, what the stored tokens take as stored
        (:meth:`stored_bits` / 8: filled groups, sinks, the tail rows holding tokens, the mean and norm). Tokens held raw
        (:attr:`raw_prefix`) are all ``tail``: exactly a DynamicCache's bytes."""
        if self.state is None:
            held = 0 if self._raw is None else self._raw.nbytes
            return {**dict.fromkeys(STORAGE_PARTS, 0), "tail": held, "total": held, **dict.fromkeys(GROUP_PARTS, 0),
                    "stored": held}
        st = self.state
        nbytes = {"archive": st.data.nbytes, "scales": st.scale.nbytes + st.zero.nbytes + st.index.nbytes,
                  "sinks": st.sink.nbytes, "tail": st.tail.nbytes + st.length.nbytes + st.start.nbytes, "mean": st.mean.nbytes,
                  "norm": st.norm.nbytes, "memo": 0 if self.memo is None else self.memo.nbytes}
        nbytes["total"] = sum(nbytes.values())
        nbytes["archive_held"] = st.data.nbytes + nbytes["scales"]
        nbytes["archive_used"] = self.filled_groups * nbytes["archive_held"] // max(1, st.data.shape[2])
        nbytes["stored"] = self.stored_bits() // 8
        return nbytes

    def storage_bytes(self) -> int:
        """Every byte this stream holds (see :meth:`storage_breakdown`)."""
        return self.storage_breakdown()["total"]

    def stored_bits(self) -> int:
        """Bits that the stored tokens take as stored: filled archive groups (codes, scales, zero points), the sinks
        and tail rows holding tokens (in their stored dtype: :attr:`raw_dtype`), the mean and norm; no unused capacity,
        no memo. Tokens held raw: their bytes."""
        if self.state is None:
            return 0 if self._raw is None else 8 * self._raw.nbytes
        st, codec, n = self.state, self.codec, self.get_seq_length()
        d, item = st.tail.shape[3], st.tail.element_size()
        lead = st.tail.shape[0] * st.tail.shape[1]
        archived = self.archived_tokens
        raw = min(n, codec.sinks) + (n - archived if n > archived else 0)
        return 8 * (lead * self.filled_groups * codec.group_bytes(d, self.dtype) + lead * raw * d * item
                    + st.mean.nbytes + st.norm.nbytes)

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

    def op_state(self) -> tuple[list[torch.Tensor], str]:
        """``(state, spec)`` as the ops take them: the codec's, or while the tokens are held raw a
        :data:`~flashcodec_fx.raw_prefix.RAW_CODEC` state over them (their archive, no copy)."""
        if self._raw is not None:
            return raw_state(self._raw), RAW_SPEC
        return list(self.state), self.spec

    def decoded(self) -> torch.Tensor:
        """``(B, H, L, D)``: the stored tokens as attention reads them (one decode; for inspection, never used by a
        decode step)."""
        return self.read()[:, :, : self.get_seq_length()]


def static_positions(key_codec: Codec, value_codec: Codec, max_length: int) -> int:
    """Positions both streams of a static layer allocate: the smallest count >= ``max_length`` that both archives
    tile exactly (so the K and V views have one length). Needs the same ``sinks`` on both."""
    if key_codec.sinks != value_codec.sinks:
        raise ValueError(f"the static layout needs the same sinks for keys and values, got {key_codec.sinks} and "
                         f"{value_codec.sinks}")
    step = math.lcm(key_codec.group, value_codec.group)
    return key_codec.sinks + _ceil_div(max(0, max_length - key_codec.sinks), step) * step


def _codec(codec, options: dict) -> Codec | None:
    """``codec``, or one built from codec options (as :func:`make_codec`; options left at None take the defaults)."""
    options = {name: value for name, value in options.items() if value is not None}
    if codec is not None and options:
        raise ValueError(f"pass either codecs (key_codec / value_codec) or codec options, not both (got "
                         f"{sorted(options)})")
    if codec is None and not options:
        return None
    return make_codec(options.pop("mode", "jpeg"), **options) if codec is None else codec


class CodecKVCache:
    """K and V streams of one attention layer. ``key_codec`` / ``value_codec`` may differ; or pass codec options as
    keywords (``CodecKVCache(mode="jpeg", block_size=8, keep_freqs=2)``), shared by both streams."""

    def __init__(self, key_codec: Codec | None = None, value_codec: Codec | None = None, layout: str = "dynamic",
                 max_length: int | None = None, memoize: bool = False, crop: str = "decode", **codec_options):
        if value_codec is not None and codec_options:
            raise ValueError("pass either codecs (key_codec / value_codec) or codec options, not both")
        key_codec = _codec(key_codec, dict(codec_options))
        if key_codec is None:
            raise TypeError("CodecKVCache needs a codec (key_codec, see make_codec) or codec options, e.g. "
                            "CodecKVCache(mode='jpeg', block_size=8, keep_freqs=8, quant_bits=8)")
        value_codec = key_codec if value_codec is None else value_codec
        positions = None
        if layout == "static" and isinstance(max_length, int) and isinstance(value_codec, Codec):
            positions = static_positions(key_codec, value_codec, max_length)
        self.keys = CodecStream(key_codec, layout, max_length, memoize, crop, positions)
        self.values = CodecStream(value_codec, layout, max_length, memoize, crop, positions)

    @property
    def layout(self) -> str:
        return self.keys.layout

    def forward(self, k_seq: torch.Tensor, v_seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill from a full sequence ``(B, H, S, D)`` (forgetting what was stored); returns the stored views."""
        self.reset()
        return self.decode_step(k_seq, v_seq)

    __call__ = forward

    def decode_step(self, new_k: torch.Tensor, new_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(B, H, T, D)`` keys and values; returns the stored views ``(B, H, L, D)`` (what
        :meth:`attention` without ``new`` reads; ``attention(q, new=(new_k, new_v))`` reads this call's tokens
        exactly instead)."""
        self.append(new_k, new_v)
        return self.read()

    def check_new(self, new_k: torch.Tensor, new_v: torch.Tensor, same_head_dim: bool = True) -> None:
        """Reject keys and values these streams cannot take together, before any state changes. ``same_head_dim``:
        both need one head dim, as :meth:`attention` reads them with the same queries (False: :meth:`read` only)."""
        self.keys.check_new(new_k)
        self.values.check_new(new_v)
        if new_k.shape[:3] != new_v.shape[:3]:
            raise ValueError(f"new_k and new_v must share (B, H, T), got {tuple(new_k.shape)} and {tuple(new_v.shape)}")
        if same_head_dim and new_k.shape[3] != new_v.shape[3]:
            raise ValueError(f"new_k and new_v must share the head dim: keys have {new_k.shape[3]}, values "
                             f"{new_v.shape[3]} (CodecKVCache.attention reads both with the queries' head dim)")

    def append(self, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        if not torch.compiler.is_compiling():
            self.check_new(new_k, new_v)
        self.keys.append(new_k, checked=True)
        self.values.append(new_v, checked=True)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.read(), self.values.read()

    def get_seq_length(self) -> int:
        return self.keys.get_seq_length()

    def crop(self, n: int) -> None:
        """Both streams keep the same tokens (see :meth:`CodecStream.crop`); a refused crop changes neither."""
        self.keys.check_crop(n)
        self.values.check_crop(n)
        self.keys.crop(n)
        self.values.crop(n)

    def index_select(self, indices: torch.Tensor) -> None:
        """Beam reorder / batch selection of every tensor of both streams."""
        self.keys.index_select(indices)
        self.values.index_select(indices)

    reorder = index_select

    def repeat_interleave(self, repeats: int) -> None:
        self.keys.repeat_interleave(repeats)
        self.values.repeat_interleave(repeats)

    def reset(self) -> None:
        self.keys.reset()
        self.values.reset()

    def release_memo(self) -> None:
        self.keys.release_memo()
        self.values.release_memo()

    def storage_breakdown(self) -> dict[str, int]:
        k, v = self.keys.storage_breakdown(), self.values.storage_breakdown()
        return {part: k[part] + v[part] for part in k}

    def storage_bytes(self) -> int:
        """Every byte both streams hold (see :meth:`storage_breakdown`)."""
        return self.keys.storage_bytes() + self.values.storage_bytes()

    def bits_per_value(self) -> float:
        """Stored bits per cached value (K and V), as stored (:meth:`CodecStream.stored_bits`)."""
        tail = self.keys.tail
        n = 0 if tail is None else tail.shape[0] * tail.shape[1] * tail.shape[3] * self.get_seq_length()
        return (self.keys.stored_bits() + self.values.stored_bits()) / max(1, 2 * n)

    def attention(self, q: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None,
                  new: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Decode attention on the stored form: see :func:`codec_decode_attention`."""
        return codec_decode_attention(q, self.keys, self.values, mask, scale, new)


def codec_decode_attention(q: torch.Tensor, key_stream: CodecStream, value_stream: CodecStream,
                           mask: torch.Tensor | None = None, scale: float | None = None,
                           new: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``q (B, Hq, T, D)`` attends over both streams' stored state without building the ``(S, D)`` view; returns
    ``(B, Hq, T, D)`` in q's dtype. GQA by grouping query heads. ``new``: the current call's ``(keys, values)``,
    already appended, read exactly (as the prompt is)."""
    if not (key_stream.is_initialized and value_stream.is_initialized):
        raise RuntimeError("codec_decode_attention needs streams that hold at least one token")
    if not torch.compiler.is_compiling() and key_stream.get_seq_length() != value_stream.get_seq_length():
        raise ValueError(f"key and value streams must have the same length, got {key_stream.get_seq_length()} and "
                         f"{value_stream.get_seq_length()}")
    k_new, v_new = (None, None) if new is None else new
    (k_state, k_spec), (v_state, v_spec) = key_stream.op_state(), value_stream.op_state()
    return torch.ops.flashcodec.codec_attention(q, k_state, v_state, k_spec, v_spec, k_new, v_new, mask, scale)


__all__ = ["CROP_MODES", "LAYOUTS", "CodecKVCache", "CodecOverflowError", "CodecStream", "Encoded",
           "codec_decode_attention"]
