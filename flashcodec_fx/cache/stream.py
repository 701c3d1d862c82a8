"""`CodecStream`: one compressed ``(B, H, S, D)`` stream: append, read, the memo and the host mirrors; its growth,
crops, moves and accounting are the parts it is built of (``growth.py``, ``crop.py``, ``moves.py``,
``accounting.py``)."""

from __future__ import annotations

import torch

from ..codecs import Codec, codec_from_spec
from ..ops.reference.read import overlay_new
from ..ops.state import StreamState, advance, capacity, stream_dtype
from ..raw_prefix import RAW_SPEC, raw_state
from .accounting import StreamAccounting
from .crop import CROP_MODES, StreamCrop
from .growth import StreamGrowth
from .moves import StreamMoves

LAYOUTS = ("dynamic", "static")


class CodecOverflowError(IndexError, ValueError):
    """More tokens than a static layout holds (an ``IndexError`` as transformers' StaticCache raises, and a
    ``ValueError`` as every other rejected argument here)."""


class CodecStream(StreamGrowth, StreamCrop, StreamMoves, StreamAccounting):
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
        self._make_room(x)
        self._write(x, compiling)

    def _make_room(self, x: torch.Tensor) -> None:
        """Own the archive (copy-on-append) and grow it (dynamic) so that ``x (B, H, T, D)`` can be appended."""
        t = x.shape[2]
        if self.shared and advance(self.codec, self._host_start, self._host_length + t) > self._host_start:
            self._own_archive()  # copy-on-append
        if self.layout == "dynamic":
            need = self._groups_for(self._host_length + t)
            if need > self.state.data.shape[2]:
                self._grow(self._grown_groups(x, need))

    @property
    def defers(self) -> bool:
        """Whether the stream can take tokens in a later op call that appends and attends at once
        (``flashcodec::append_attention``; :meth:`reserve`): eager, a codec state (not held raw), no memo to keep."""
        return not torch.compiler.is_compiling() and self.state is not None and self._raw is None and self.memo is None

    def reserve(self, x: torch.Tensor) -> None:
        """Prepare a stream that :attr:`defers` to take checked tokens ``x (B, H, T, D)`` in a later op call: room
        made as :meth:`append` makes it, and the host mirrors advanced as that append will advance the device lengths
        (:meth:`get_seq_length` counts ``x`` from now on)."""
        self._make_room(x)
        t = x.shape[2]
        self._host_start = advance(self.codec, self._host_start, self._host_length + t)
        self._host_length += t

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
        """Write this call's tokens ``new (B, H, T, D)`` over the memo rows that do not hold them as given (eager): those
        already archived, or all of them where the raw rows are narrower than the stream (``raw=bfloat16``)."""
        n, t = self.get_seq_length(), new.shape[2]
        if self.raw_dtype == self.dtype:  # raw rows hold the tokens as given: only the archived ones differ
            lo, hi = max(n - t, self.codec.sinks), min(n, self._host_start)
        else:
            lo, hi = n - t, n
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
