"""`FlashCodecMLALayer`: a multi-head latent attention layer (MLA: DeepSeek-V2/V3, Kimi, MiniCPM3, GLM-4-MoE-Lite,
LongCat, ...) whose per-token latent lives in one codec stream (:class:`~flashcodec_fx.cache.latent.LatentKVCache`).

transformers' MLA modules call ``cache.update(c, k_rot, layer_idx)`` with the latent ``c (B, 1, T, kv_lora_rank)``
and the shared rotary key ``k_rot (B, 1, T, qk_rope_head_dim)``, expand what it returns into per-head K/V
(``expand_kv``) and call the attention function. This layer stores the row ``[c ; k_rot]`` once per token and
returns the call's own tokens (eager, the default): so the module expands only those, and the ``"kvcodec"``
attention attends on the stored rows in the absorbed form (``hf/mla_attention.py``): per-head K/V of the history are
never built. ``lossless`` stores the rows as given: attention then expands the stored rows through the module's own
``expand_kv`` and runs the model's attention, the tokens of an uncompressed run. With ``materialization_free=False``
the update returns the decoded ``(c, k_rot)`` views, which the module expands itself. An MLA model's sliding-window
layers (dots.llm3) hold their rows in a ring: :class:`FlashCodecSlidingMLALayer`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache.latent import LatentKVCache
from ..codecs import Codec
from .layer import FlashCodecLayer
from .sliding_layer import FlashCodecSlidingLayer


def mla_widths(config: Any) -> tuple[int, int] | None:
    """``(kv_lora_rank, qk_rope_head_dim)`` of an MLA model's text config, None for other models."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    rank, rope = getattr(text, "kv_lora_rank", None), getattr(text, "qk_rope_head_dim", None)
    return (rank, rope) if isinstance(rank, int) and isinstance(rope, int) and rank > 0 else None


class FlashCodecMLALayer(FlashCodecLayer):
    """A full-attention MLA layer: one stream of rows ``[c ; k_rot]`` (``latent_width + rope_width`` channels), stored
    by ``codec`` (``value_codec``, when given, must be the same codec: one stream serves keys and values)."""

    fused_append = False  # the absorbed attention reads one stream as keys and values: update appends the rows

    def __init__(self, key_codec: Codec, value_codec: Codec | None = None, *, latent_width: int, rope_width: int,
                 **layer_kwargs: Any):
        if value_codec is not None and value_codec.spec != key_codec.spec:
            raise ValueError(f"an MLA layer stores keys and values as one latent row: pass one codec, got "
                             f"{key_codec.spec!r} (keys) and {value_codec.spec!r} (values)")
        self.latent_width, self.rope_width = latent_width, rope_width
        super().__init__(key_codec, key_codec, **layer_kwargs)

    def _storage(self, key_codec: Codec, value_codec: Codec | None, layout: str, max_cache_len: int | None,
                 memoize: bool, crop: str) -> LatentKVCache:
        return LatentKVCache(key_codec, self.latent_width, self.rope_width, layout, max_cache_len, memoize, crop)

    def __repr__(self) -> str:
        return f"FlashCodecMLALayer(latent={self.latent_width}, rope={self.rope_width}, codec={self.keys_stream.codec!r})"

    @property
    def keys(self) -> torch.Tensor | None:
        """The stored latents ``c (B, 1, L, latent_width)`` (one decode on access), None while empty."""
        return self.codec_cache.read()[0] if self.keys_stream.is_initialized else None

    @keys.setter
    def keys(self, value) -> None:
        FlashCodecLayer.keys.fset(self, value)

    @property
    def values(self) -> torch.Tensor | None:
        """The stored rotary keys ``k_rot (B, 1, L, rope_width)`` (what transformers' layer holds as its values)."""
        return self.codec_cache.read()[1] if self.keys_stream.is_initialized else None

    @values.setter
    def values(self, value) -> None:
        FlashCodecLayer.values.fset(self, value)

    @property
    def streams(self) -> tuple:
        return (self.keys_stream,)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys_stream.prepare(self.codec_cache.row(key_states, value_states))
        self.is_initialized = True
        if self.layout == "static":
            self._mark_static()

    def _check_new(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.codec_cache.check_new(key_states, value_states)

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys_stream.append(self.codec_cache.row(key_states, value_states), checked=True)

    def _step_tensors(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.codec_cache.row(key, value)
        return row, row

    def read_view(self, new: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoded ``(c, k_rot)`` views ``(B, 1, L, .)``, ``new`` read exactly."""
        row = self.keys_stream.read(None if new is None else self.codec_cache.row(*new))
        return self.codec_cache.split(row)

    def _compiled_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.codec_cache.row(key_states, value_states)
        self.keys_stream.append(row)
        stream = self.keys_stream
        return self.codec_cache.split(torch.ops.flashcodec.read(list(stream.state), stream.spec, row))

    def cached_values(self) -> int:
        """Values the stored tokens stand for: ``B * L * (latent_width + rope_width)`` (each row stored once)."""
        tail = self.keys_stream.tail
        return 0 if tail is None else tail.shape[0] * tail.shape[1] * tail.shape[3] * self.keys_stream.get_seq_length()


class FlashCodecSlidingMLALayer(FlashCodecSlidingLayer, FlashCodecMLALayer):
    """A sliding-window MLA layer: the latent rows of :class:`FlashCodecMLALayer` in the ring of
    :class:`~flashcodec_fx.hf.sliding_layer.FlashCodecSlidingLayer` (archive groups every later query has left behind
    are dropped)."""

    def __repr__(self) -> str:
        return (f"FlashCodecSlidingMLALayer(window={self.sliding_window}, latent={self.latent_width}, "
                f"rope={self.rope_width}, codec={self.keys_stream.codec!r})")
