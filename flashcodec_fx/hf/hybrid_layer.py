"""Hybrid layers (transformers' ``"hybrid"`` / ``"hybrid_sliding"`` layer types: Falcon-H1, Zamba2, ...): one model
layer runs a linear-attention (Mamba) mixer beside an attention block. Their cache layer holds both: the linear
states as transformers' :class:`LinearAttentionLayer` holds them (conv and recurrent states, a few KB, untouched),
the attention K/V in codec streams (:class:`~flashcodec_fx.hf.layer.FlashCodecLayer`, or a
:class:`~flashcodec_fx.hf.sliding_layer.FlashCodecSlidingLayer` ring)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import LinearAttentionLayer

from ..codecs import Codec
from .layer import FlashCodecLayer
from .sliding_layer import FlashCodecSlidingLayer


class HybridCodecLayer(LinearAttentionLayer):
    """What both hybrid kinds share: each cache-layer method runs on both halves, the attention half's length is the
    layer's (as transformers' own hybrid layers). Attention calls reach the codec half through ``update``; the linear
    half through ``update_conv_state`` / ``update_recurrent_state``."""

    is_compileable = False  # the codec half is dynamic (a class attribute: the linear half's is a read-only property)

    def _codec_init(self, codec_cls: type[FlashCodecLayer], key: Codec, value: Codec | None, number_of_states: int,
                    **layer_kwargs: Any) -> None:
        codec_cls.__init__(self, key, value, **layer_kwargs)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        """Two positional tensors: the attention half's (keys, values); keyword states: the linear half's."""
        if len(args) == 2 and not kwargs:
            self._codec_class.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)

    @property
    def is_croppable(self) -> bool:
        return self._codec_class.is_croppable.fget(self)

    def get_seq_length(self) -> int | torch.Tensor:
        return self._codec_class.get_seq_length(self)

    def get_max_length(self) -> int:
        return self._codec_class.get_max_length(self)

    def offload(self) -> None:
        self._codec_class.offload(self)
        LinearAttentionLayer.offload(self)

    def prefetch(self) -> None:
        self._codec_class.prefetch(self)
        LinearAttentionLayer.prefetch(self)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        self._codec_class.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        self._codec_class.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        self._codec_class.crop(self, tokens_to_remove)

    def activate_past_recording(self, **kwargs: Any) -> None:
        LinearAttentionLayer.activate_past_recording(self, **kwargs)
        self.record_past = True

    def storage_breakdown(self) -> dict[str, int]:
        """The codec half's bytes by part, plus the linear half's conv and recurrent states as ``native``."""
        native = sum(t.nbytes for states in (self.conv_states, self.recurrent_states) for t in states.values()
                     if isinstance(t, torch.Tensor))
        row = self._codec_class.storage_breakdown(self)
        return {**row, "native": native, "total": row["total"] + native}


    @property
    def linear_state(self) -> dict[str, Any]:
        """The linear half's attributes (conv and recurrent states, their flags, its token count): what a saved cache
        keeps of it (``hf/cache_file.py``)."""
        return {name: getattr(self, name) for name in LINEAR_ATTRIBUTES if hasattr(self, name)}

    @linear_state.setter
    def linear_state(self, attributes: dict[str, Any]) -> None:
        for name, value in attributes.items():
            setattr(self, name, value)


LINEAR_ATTRIBUTES = (*(name for name in vars(LinearAttentionLayer()) if name not in ("device", "dtype", "record_past")),
                     "recurrent_states_to_keep", "recurrent_states_history")
"""The attributes transformers' linear-attention layer keeps its states in (``recurrent_states_history`` too, while
recording the past for assisted decoding)."""


class FlashCodecHybridLayer(HybridCodecLayer, FlashCodecLayer):
    """A ``"hybrid"`` layer: linear-attention states as transformers holds them, full-attention K/V in codec streams
    (the dynamic layout)."""

    _codec_class = FlashCodecLayer

    def __init__(self, key_codec: Codec, value_codec: Codec | None = None, *, number_of_states: int = 1,
                 **layer_kwargs: Any):
        self._codec_init(FlashCodecLayer, key_codec, value_codec, number_of_states, **layer_kwargs)


class FlashCodecHybridSlidingLayer(HybridCodecLayer, FlashCodecSlidingLayer):
    """A ``"hybrid_sliding"`` layer: linear-attention states as transformers holds them, sliding-window K/V as a codec
    ring."""

    _codec_class = FlashCodecSlidingLayer

    def __init__(self, key_codec: Codec, value_codec: Codec | None = None, *, sliding_window: int,
                 number_of_states: int = 1, **layer_kwargs: Any):
        self._codec_init(FlashCodecSlidingLayer, key_codec, value_codec, number_of_states,
                         sliding_window=sliding_window, **layer_kwargs)

    def activate_past_recording(self, **kwargs: Any) -> None:
        LinearAttentionLayer.activate_past_recording(self, **kwargs)
        FlashCodecSlidingLayer.activate_past_recording(self, **kwargs)
