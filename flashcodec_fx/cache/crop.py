"""A :class:`~flashcodec_fx.cache.CodecStream`'s crops: rollbacks inside the raw tail and at group boundaries,
reopened archive groups (``crop="decode"``) or refusals (``crop="exact"``), and a sliding ring's dropped front."""

from __future__ import annotations

import torch

from ..codecs import PNGCodec
from ..ops.reference.normalize import from_stored, to_stored

CROP_MODES = ("decode", "exact")  # the first is the default


class StreamCrop:
    """:class:`~flashcodec_fx.cache.CodecStream`'s crops (a part of that class: it reads and sets the stream's state,
    memo, raw prefix and host mirrors)."""

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
        rolled = {name: t.roll(-groups, dims=2) if t.numel() else t for name, t in st.archive()._asdict().items()}
        for t in rolled.values():
            if t.numel():
                t[:, :, t.shape[2] - groups:].zero_()
        self.state = st._replace(**rolled)
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
            archive = {name: t[:, :, group: group + 1].contiguous() for name, t in st.archive()._asdict().items()}
            alone = st._replace(**archive, length=end, start=end)
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
