"""`FlashCodecSlidingLayer`: a sliding-window layer whose K and V live in codec streams, as a ring."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..codecs import Codec
from ..codecs.base import check_count
from .handoff import COMPILED, dataflow
from .layer import FlashCodecLayer
from .options import crop_count


class FlashCodecSlidingLayer(FlashCodecLayer):
    """A sliding-window layer whose K and V live in codec streams, as a ring: archive groups that every later query
    has left behind (wholly before ``position - sliding_window + 1``) are dropped, so storage stays bounded by the
    window plus one group of each stream plus the tail, whatever the length. The dynamic layout only (a static
    FlashCodecCache keeps sliding layers native), codecs without sinks (sink tokens leave the window too). Positions
    are absolute to transformers (``get_seq_length``, ``get_mask_sizes``' offset), relative inside the streams.
    ``activate_past_recording()`` (transformers' assisted decoding calls it, as for its own sliding layers): nothing is
    dropped until the next ``crop``, which drops what leaves the window at the cropped length, so a rollback of any
    depth since the last crop finds every position it needs."""

    is_sliding = True

    def __init__(self, key_codec: Codec, value_codec: Codec | None = None, *, sliding_window: int,
                 layout: str = "dynamic", **layer_kwargs: Any):
        if layout != "dynamic":
            raise ValueError(f"a codec sliding-window layer needs layout='dynamic', got {layout!r}")
        value_codec = key_codec if value_codec is None else value_codec
        if key_codec.sinks or value_codec.sinks:
            raise ValueError(f"a codec sliding-window layer takes codecs without sinks, got sinks={key_codec.sinks} "
                             f"(keys), {value_codec.sinks} (values)")
        check_count("sliding_window", sliding_window, 1)
        super().__init__(key_codec, value_codec, layout=layout, **layer_kwargs)
        self.sliding_window = sliding_window
        self.dropped = 0  # positions forgotten at the front (a multiple of the drop unit)
        self.record_past = False
        self._unit = math.lcm(key_codec.group, value_codec.group)

    def __repr__(self) -> str:
        return f"FlashCodecSlidingLayer(window={self.sliding_window}, keys={self.keys_stream.codec!r}, " \
               f"values={self.values_stream.codec!r})"

    def activate_past_recording(self, **_: Any) -> None:
        """Keep every position until the next :meth:`crop` (see the class docstring). Keywords transformers passes
        for recurrent layers (5.25's ``recurrent_states_to_keep``) are accepted and unused: a ring holds no
        recurrent state, and keeps every position while recording."""
        self.record_past = True

    def _drop_target(self) -> int:
        """Positions forgotten before the next call (none more while recording the past). ``get_mask_sizes`` (before
        ``update``) and ``update`` agree on it."""
        return self.dropped if self.record_past else self._window_target()

    def _window_target(self) -> int:
        """Whole units below the first position a later query can see, and archived in both streams."""
        seen = self.get_seq_length()
        visible = max(0, seen - self.sliding_window + 1)
        archived = self.dropped + min(self.keys_stream.archived_tokens, self.values_stream.archived_tokens)
        return max(self.dropped, min(visible, archived) // self._unit * self._unit)

    def get_seq_length(self) -> int:
        """Tokens seen (transformers' positions), dropped ones included."""
        return self.dropped + self.keys_stream.get_seq_length()

    @property
    def position(self) -> int:
        """The absolute position of the next token: dropped positions included (the streams hold the ring's)."""
        return self.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the positions held after this call's drop, plus the query."""
        target = self._drop_target()
        return self.get_seq_length() - target + query_length, target

    def slide(self) -> None:
        """Drop the archive groups no later query can see (what ``update`` does before it appends)."""
        self._drop_to(self._drop_target())

    def _drop_to(self, target: int) -> None:
        if target > self.dropped:
            for stream in self.streams:
                stream.drop_front(target - self.dropped)
            self.dropped = target

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if dataflow(self.materialization_free) is not COMPILED:
            self.codec_cache.check_new(key_states, value_states)  # a rejected call changes nothing
            self.slide()
        return super().update(key_states, value_states, *args, **kwargs)

    def _stream_crop(self, tokens_to_remove: int) -> int:
        """The streams' crop argument for ``crop(tokens_to_remove)`` (positions relative to the ring); raises where
        the ring has dropped positions that the crop would need back."""
        tokens_to_remove = crop_count(tokens_to_remove)
        if tokens_to_remove == 0:
            return 0
        seen = self.get_seq_length()
        keep = max(0, seen + tokens_to_remove) if tokens_to_remove < 0 else min(tokens_to_remove, seen)
        if keep < self.dropped:
            raise ValueError(f"crop to {keep} tokens: this sliding-window layer has dropped positions 0.."
                             f"{self.dropped - 1} (outside its window of {self.sliding_window}); crop to at least "
                             f"{self.dropped}")
        return keep - seen if keep < seen else 0

    def crop(self, tokens_to_remove: int) -> None:
        """As :meth:`FlashCodecLayer.crop`; positions the ring has dropped cannot come back (ValueError). While
        recording the past, the ring then drops what the cropped length leaves outside the window."""
        super().crop(self._stream_crop(tokens_to_remove))
        if self.record_past:
            self._drop_to(self._window_target())

    def check_crop(self, tokens_to_remove: int) -> None:
        super().check_crop(self._stream_crop(tokens_to_remove))

    def reset(self) -> None:
        super().reset()
        self.dropped = 0
