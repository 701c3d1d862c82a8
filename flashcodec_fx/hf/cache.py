"""`FlashCodecLayer` / `FlashCodecCache`: the codec as a transformers 5.x KV cache (layer API shared by 5.17 .. 5.24).

Each compressed layer owns a :class:`flashcodec_fx.cache.CodecKVCache` (K and V streams); every read and write of the
model goes through ``cache.update(k, v, layer_idx)``. What ``update`` returns (all ``(B, H, L, D)`` in the stream dtype):

- first fill of an empty layer (the prompt): the exact new states (static layout: zero-padded to the capacity), so
  the prefill attends on the exact prompt; the stored (compressed) form is what every later step reads;
- later eager steps: the stored view (dynamic: the memo, ``L`` = stored length; static: the memo, ``L`` = capacity
  ``ceil(max_cache_len / r) * r``, positions past the length are zeros and masked), no re-decode of history;
- under ``torch.compile``: ``torch.ops.flashcodec.read(...)`` of each stream, the pattern the compile pass rewrites;
- ``materialization_free=True`` decode steps: the new states only; the ``"kvcodec"`` attention function
  (:mod:`flashcodec_fx.hf.attention`) attends on the stored coefficients instead.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    STATIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    get_layer_types_and_kwargs,
)

from .. import _compat
from ..cache import CodecKVCache, CodecStream
from ..codecs import Codec
from . import attention as _attention
from .attention import MaterializationFreeFallback
from .options import (
    UNSET,
    check_cache_switches,
    check_per_layer,
    layer_options,
    resolve_layer_codecs,
)

CODEC_LAYER_TYPES = ("full_attention",)


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class FlashCodecLayer(CacheLayerMixin):
    """One full-attention layer whose K and V live in codec streams.

    ``key_codec``/``value_codec``: codecs sharing ``block_size``. ``layout``: ``"dynamic"`` (grows) or ``"static"``
    (preallocated for ``max_cache_len`` tokens, compileable). ``memoize``: keep a reconstruction receiving each block's
    decoded rows once (eager reads never re-decode); ``False`` decodes the history on every eager read (meant for
    ``torch.compile`` and materialization-free decoding). ``materialization_free``: decode steps attend on the stored
    coefficients through the ``"kvcodec"`` attention function; ``strict`` turns its fallbacks into errors.
    """

    is_sliding = False
    is_croppable = True
    supports_early_init = False  # streams allocate on the first append

    def __init__(self, key_codec: Codec, value_codec: Codec | None = None, layout: str = "dynamic",
                 max_cache_len: int | None = None, memoize: bool = True, materialization_free: bool = False,
                 strict: bool = False):
        check_cache_switches(layout, max_cache_len, materialization_free, strict, memoize)
        super().__init__()
        self.codec_cache = CodecKVCache(key_codec, value_codec, layout, max_cache_len, memoize)
        self.layout, self.max_cache_len = layout, max_cache_len
        self.is_compileable = layout == "static"
        self.materialization_free, self.strict = materialization_free, strict
        self.attention_bound = False  # set by the "kvcodec" attention function when it serves this layer
        self._length = 0  # eager mirror of the stored length (host int; never touched under torch.compile)
        self._marked_static = False

    def __repr__(self) -> str:
        k, v = self.keys_stream.codec, self.values_stream.codec
        return f"FlashCodecLayer(keys={k!r}, values={v!r}, layout={self.layout!r})"

    @property
    def keys_stream(self) -> CodecStream:
        return self.codec_cache.keys

    @property
    def values_stream(self) -> CodecStream:
        return self.codec_cache.values

    @property
    def block_size(self) -> int:
        return self.keys_stream.codec.block_size

    @property
    def capacity(self) -> int:
        """Static layout: tokens the read view spans, ``ceil(max_cache_len / r) * r``."""
        r = self.block_size
        return -(-self.max_cache_len // r) * r

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def _compiled_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.codec_cache.append(key_states, value_states)
        ks, vs = self.keys_stream, self.values_stream
        return (torch.ops.flashcodec.read(*ks.state, ks.tail, ks.length, ks.spec),
                torch.ops.flashcodec.read(*vs.state, vs.tail, vs.length, vs.spec))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, keep: torch.Tensor | None = None,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(B, H, T, D)`` keys and values; returns what attention reads (see the module docstring).

        ``keep``: optional ``(B, T)`` bool, False at padding positions; those K/V are stored as zeros (the returned
        prefill states are untouched: padding is masked there anyway).
        """
        if torch.compiler.is_compiling():
            return self._compiled_update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first_fill = self._length == 0
        if self.materialization_free and not first_fill and not self.attention_bound:
            reason = ("materialization_free=True but the 'kvcodec' attention function did not serve this layer's "
                      "prefill: install it with apply_codec_attention(model) (or apply_flash_codec(model, "
                      "materialization_free=True))")
            if self.strict:
                raise RuntimeError(reason)
            warnings.warn(f"{reason}; this layer decodes on the materialized view instead.", MaterializationFreeFallback,
                          stacklevel=2)
            self.materialization_free = False
        stored_k, stored_v = key_states, value_states
        if keep is not None:
            mask = keep[:, None, :, None]
            stored_k = torch.where(mask, key_states, torch.zeros((), dtype=key_states.dtype, device=key_states.device))
            stored_v = torch.where(mask, value_states, torch.zeros((), dtype=value_states.dtype, device=value_states.device))
        self.codec_cache.append(stored_k, stored_v)
        self._length += key_states.shape[2]
        if self.layout == "static" and not self._marked_static:
            self._mark_static()
        if first_fill:
            out = (key_states, value_states) if self.layout == "dynamic" else (self._pad(key_states), self._pad(value_states))
            if self.materialization_free:
                _attention.set_pending(self, out[0], decode=False)
            return out
        if self.materialization_free:
            if self.keys_stream.memo is not None:
                self.codec_cache.release_memo()
            _attention.set_pending(self, key_states, decode=True)
            return key_states, value_states
        return self.codec_cache.read()

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        b, h, t, d = x.shape
        return torch.cat([x, x.new_zeros(b, h, self.capacity - t, d)], dim=2)

    def _mark_static(self) -> None:
        for stream in (self.keys_stream, self.values_stream):
            for t in (*stream.state, stream.tail, stream.length, stream.memo):
                if t is not None:
                    _compat.mark_static_address(t)
        self._marked_static = True

    def read_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The materialized ``(B, H, L, D)`` views (memo when kept, else one decode of the history)."""
        return self.codec_cache.read()

    def get_seq_length(self) -> int | torch.Tensor:
        """Stored tokens: a host int (dynamic) or, like transformers' StaticLayer, the 0-dim device length tensor
        (static, so compiled graphs do not specialize on it)."""
        if self.layout == "static":
            length = self.keys_stream.length
            return 0 if length is None else length
        return self._length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: dynamic ``stored + query_length``; static the stream capacity."""
        if self.layout == "static":
            return self.capacity, 0
        return self._length + query_length, 0

    def get_max_length(self) -> int:
        return self.max_cache_len if self.layout == "static" else -1

    def reset(self) -> None:
        """Forget every token (the allocation is kept)."""
        self.codec_cache.reset()
        self._length = 0
        self.attention_bound = False

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers 5.x convention: a negative int; 0 is a no-op).
        The cut block's archived tokens come back as the values attention read before: the view after the crop is
        exactly the prefix of the view before it."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise TypeError(f"tokens_to_remove must be an int, got {type(tokens_to_remove).__name__}")
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove (transformers 5.x), got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.keys_stream.is_initialized:
            return
        length = int(self.get_seq_length())
        if length + tokens_to_remove < 0:
            raise ValueError(f"cannot remove {-tokens_to_remove} tokens from a layer holding {length}")
        self.codec_cache.crop(tokens_to_remove)
        self._length = length + tokens_to_remove

    def _batch_indices(self, indices: Any) -> torch.Tensor:
        return torch.as_tensor(indices, dtype=torch.long, device=self.keys_stream.tail.device).reshape(-1)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: archive, scales, index, raw tail and memo of both streams move together."""
        if self.keys_stream.is_initialized:
            self.codec_cache.index_select(self._batch_indices(beam_idx))
            self._marked_static = False

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.keys_stream.is_initialized:
            self.codec_cache.index_select(self._batch_indices(indices))
            self._marked_static = False

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.keys_stream.is_initialized:
            self.codec_cache.repeat_interleave(repeats)
            self._marked_static = False

    def offload(self):
        raise NotImplementedError("FlashCodecLayer does not support offloading")

    prefetch = offload

    def storage_bytes(self) -> int:
        """Every byte both streams hold (``storage_breakdown()["total"]``)."""
        return self.codec_cache.storage_bytes()

    def storage_breakdown(self) -> dict[str, int]:
        """Bytes held by both streams: ``archive`` (+ ``scales``, ``index``), ``memo`` (the materialized view),
        ``tail`` (raw open block + length), ``total``; ``archive_used``: the filled blocks' data + scales + index
        (not added into ``total``)."""
        return self.codec_cache.storage_breakdown()

    def raw_equivalent_bytes(self) -> int:
        """Bytes the stored tokens would take uncompressed (K and V in the stream dtype, no padding to capacity)."""
        total = 0
        for stream in (self.keys_stream, self.values_stream):
            if stream.tail is not None:
                b, h, _, d = stream.tail.shape
                total += b * h * d * int(stream.get_seq_length()) * stream.tail.element_size()
        return total


class FlashCodecCache(Cache):
    """A transformers ``Cache`` whose full-attention layers store K and V through the flashcodec codecs.

    Codec options (see docs/hf.md): ``mode`` ``"jpeg"`` (default) or ``"png"``; ``block_size`` (8); jpeg
    ``keep_freqs`` (all) and ``quant_bits`` (8, ``None`` = unquantized); png ``keep_ratio`` (1.0 = exact);
    ``key_options`` / ``value_options``: dicts of the same options for one stream only. ``per_layer``:
    ``{layer_idx: options dict | None}`` overrides (``None`` keeps the layer native, uncompressed).
    Cache options: ``layout`` ``"dynamic"`` / ``"static"`` (needs ``max_cache_len``), ``memoize``,
    ``materialization_free``, ``strict``.

    Layers: with ``config`` (or :meth:`from_config`), one per model layer: codec layers on full-attention layers,
    every other layer type (sliding, chunked, linear attention, ...) keeps its native transformers layer. With
    ``num_layers``, that many codec layers. With neither, codec layers are created as the model asks for them
    (``per_layer`` then needs ``num_layers`` or ``config``).
    """

    def __init__(self, mode: str = UNSET, block_size: int = UNSET, keep_freqs: int | None = UNSET,
                 quant_bits: int | None = UNSET, keep_ratio: float = UNSET, *, key_options: dict | None = None,
                 value_options: dict | None = None, layout: str = "dynamic", max_cache_len: int | None = None,
                 per_layer: dict[int, dict | None] | None = None, materialization_free: bool = False,
                 strict: bool = False, memoize: bool = True, config: Any = None, num_layers: int | None = None):
        check_cache_switches(layout, max_cache_len, materialization_free, strict, memoize)
        codec_options = {"mode": mode, "block_size": block_size, "keep_freqs": keep_freqs, "quant_bits": quant_bits,
                         "keep_ratio": keep_ratio, "key_options": key_options, "value_options": value_options}
        codec_options = {k: v for k, v in codec_options.items() if v is not UNSET}
        overrides = check_per_layer(per_layer)
        default_codecs = resolve_layer_codecs(codec_options)
        layer_kwargs = dict(layout=layout, max_cache_len=max_cache_len, memoize=memoize,
                            materialization_free=materialization_free, strict=strict)
        if config is not None and num_layers is not None:
            raise ValueError("pass either config or num_layers, not both")
        if config is not None:
            layer_types, native_kwargs = _layer_types(config)
        elif num_layers is not None:
            if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
                raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
            layer_types, native_kwargs = ["full_attention"] * num_layers, [{}] * num_layers
        else:
            layer_types = native_kwargs = None
            if overrides:
                raise ValueError("per_layer needs the layer count: use FlashCodecCache.from_config(config, per_layer=...) "
                                 "or pass num_layers=")

        self.options = {**codec_options, "per_layer": overrides, **layer_kwargs}
        self._padding_mask: torch.Tensor | None = None
        if layer_types is None:
            def replicate() -> FlashCodecLayer:
                return FlashCodecLayer(default_codecs.key, default_codecs.value, **layer_kwargs)

            super().__init__(layer_class_to_replicate=replicate)
            return
        for idx in overrides:
            if idx >= len(layer_types):
                raise ValueError(f"per_layer: layer index {idx} out of range; the model has {len(layer_types)} layers")
            if layer_types[idx] not in CODEC_LAYER_TYPES:
                raise ValueError(f"per_layer: layer {idx} is a {layer_types[idx]!r} layer; only {CODEC_LAYER_TYPES} "
                                 f"layers carry a codec")
        layers = []
        for idx, (kind, kwargs) in enumerate(zip(layer_types, native_kwargs, strict=True)):
            if kind in CODEC_LAYER_TYPES and not (idx in overrides and overrides[idx] is None):
                codecs = default_codecs
                if idx in overrides:
                    codecs = resolve_layer_codecs(layer_options(codec_options, overrides[idx]), where=f"per_layer[{idx}]")
                layers.append(FlashCodecLayer(codecs.key, codecs.value, **layer_kwargs))
            elif layout == "static":
                layers.append(STATIC_LAYER_TYPE_MAPPING[kind](max_cache_len=max_cache_len, **kwargs))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))
        super().__init__(layers=layers)

    @classmethod
    def from_config(cls, config: Any, **options: Any) -> FlashCodecCache:
        """One layer per model layer of ``config`` (its decoder text config): codec layers on full-attention layers,
        native transformers layers elsewhere. ``options``: as for the constructor."""
        if config is None:
            raise ValueError("config must be a transformers PreTrainedConfig, got None")
        return cls(config=config, **options)

    @property
    def codec_layers(self) -> list[int]:
        """Indices of the layers that carry a codec."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, FlashCodecLayer)]

    def set_padding_mask(self, attention_mask: torch.Tensor | None) -> None:
        """Declare the 2D ``(B, P)`` padding mask (1 = token, 0 = padding) of the tokens at positions ``0..P-1``:
        their K/V are stored as zeros at padding positions, so padding cannot inflate quantization scales or
        blocks' energy. ``None`` clears it. ``apply_flash_codec`` / ``compress_kv`` call this from ``generate``."""
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
                raise ValueError(f"attention_mask must be a (B, P) tensor or None, got "
                                 f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
            attention_mask = attention_mask.bool()
        self._padding_mask = attention_mask

    def _keep_mask(self, layer: FlashCodecLayer, key_states: torch.Tensor) -> torch.Tensor | None:
        mask = self._padding_mask
        start, t = layer._length, key_states.shape[2]
        if mask is None or start >= mask.shape[1]:
            return None
        if mask.shape[0] != key_states.shape[0]:
            raise ValueError(f"padding mask batch {mask.shape[0]} does not match the cache batch {key_states.shape[0]}")
        keep = mask[:, start: start + t].to(key_states.device)
        if keep.shape[1] < t:
            keep = torch.cat([keep, keep.new_ones(keep.shape[0], t - keep.shape[1])], dim=1)
        return keep

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        layer = self.layers[layer_idx]
        if isinstance(layer, FlashCodecLayer) and self._padding_mask is not None and not torch.compiler.is_compiling():
            return layer.update(key_states, value_states, *args, keep=self._keep_mask(layer, key_states), **kwargs)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def storage_bytes(self) -> int:
        """Every byte the cache holds, all layers (``storage_breakdown()["total"]``)."""
        return self.storage_breakdown()["total"]

    def storage_breakdown(self, per_layer: bool = False) -> dict[str, int] | dict[int, dict[str, int]]:
        """Every byte the cache holds, by part, summed over layers:

        ``archive`` / ``scales`` / ``index``: the compressed blocks (allocated capacity; ``archive_used``: filled
        blocks only), ``memo``: the materialized view kept for eager reads (0 when released or not memoized),
        ``tail``: the raw open blocks (+ lengths), ``native``: tensors of the layers without a codec,
        ``total``: all of the above. ``raw_equivalent``: what the codec layers' stored tokens would take
        uncompressed (not part of ``total``). ``per_layer=True``: ``{layer_idx: dict}`` instead.
        """
        rows = {}
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, FlashCodecLayer):
                row = dict(layer.storage_breakdown(), native=0, raw_equivalent=layer.raw_equivalent_bytes())
            else:
                native = _tensor_bytes([v for k, v in vars(layer).items() if k != "device"])
                row = {"archive": 0, "archive_used": 0, "scales": 0, "index": 0, "tail": 0, "memo": 0, "native": native,
                       "total": native, "raw_equivalent": 0}
            rows[idx] = row
        if per_layer:
            return rows
        parts = ("archive", "archive_used", "scales", "index", "tail", "memo", "native", "total", "raw_equivalent")
        return {part: sum(row[part] for row in rows.values()) for part in parts}


def _layer_types(config: Any) -> tuple[list[str], list[dict]]:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types, kwargs = get_layer_types_and_kwargs(text)
    if isinstance(kwargs, dict):  # transformers < 5.2x: one kwargs dict shared by all layers
        kwargs = [kwargs] * len(layer_types)
    return list(layer_types), list(kwargs)
