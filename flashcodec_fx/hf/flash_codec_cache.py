"""`FlashCodecCache`: a transformers 5.x ``Cache`` whose attention layers store K and V through the codecs: one
layer per model layer (:class:`~flashcodec_fx.hf.layer.FlashCodecLayer`, a
:class:`~flashcodec_fx.hf.sliding_layer.FlashCodecSlidingLayer` ring, or the native transformers layer), the
padding mask, offloading, crops and storage accounting over them. Its options: :mod:`flashcodec_fx.hf.options`."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    STATIC_LAYER_TYPE_MAPPING,
    Cache,
)

from .. import _compat
from ..codecs.base import check_count
from ..config import CacheConfig
from .handoff import COMPILED, StepTable, dataflow
from .hybrid_layer import FlashCodecHybridLayer, FlashCodecHybridSlidingLayer
from .layer import FlashCodecLayer, fall_back_to_view
from .mla_layer import FlashCodecMLALayer, FlashCodecSlidingMLALayer, mla_widths
from .options import check_cache_switches, crop_count, is_model_config, resolve_codecs
from .sliding_layer import FlashCodecSlidingLayer

# The layer types that carry a codec on the dynamic layout: full attention, windows (sliding, chunked) as codec rings,
# and the attention half of hybrid (linear + attention) layers. The static layout: full attention only.
CODEC_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding")
STATIC_CODEC_LAYER_TYPES = ("full_attention",)
WINDOWED = ("sliding_attention", "chunked_attention", "hybrid_sliding")  # codec rings: codecs without sinks


class StaticSlidingNative(UserWarning):
    """A static FlashCodecCache keeps a model's sliding-window and hybrid layers native (uncompressed)."""


class NoCodecLayers(UserWarning):
    """flashcodec compresses nothing in this model: none of its layers carries a codec (no attention layer of a kind
    the cache compresses, or the model builds a cache of its own). ``strict=True`` raises instead."""


def no_codec_message(what: str, layer_types: list[str] | None = None) -> str:
    """The message of :class:`NoCodecLayers` for ``what`` (the model or cache), with its layer kinds when known."""
    kinds = "" if not layer_types else " (its layers: " + ", ".join(
        f"{layer_types.count(kind)} {kind}" for kind in dict.fromkeys(layer_types)) + ")"
    return (f"flashcodec compresses nothing in {what}{kinds}: no layer carries a codec (codec layers go on "
            f"{CODEC_LAYER_TYPES} layers; the static layout on {STATIC_CODEC_LAYER_TYPES}), so the KV cache is held "
            f"uncompressed")


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class FlashCodecCache(Cache):
    """A transformers ``Cache`` whose attention layers store K and V through the flashcodec codecs.

    ``codecs``: a :class:`~flashcodec_fx.config.CacheConfig` (``flashcodec_fx.PRESETS`` holds some), a preset name, or
    a ``CacheConfig.spec`` string. Or keyword options (:func:`~flashcodec_fx.config.cache_config`): ``preset`` and
    codec options over it, ``key_options`` / ``value_options`` (one stream), ``per_layer`` (``{layer_idx: options
    dict | preset name | None}``; ``None`` keeps the layer native); without any, ``DEFAULT_PRESET`` (``"int8"``).
    Codec options (docs/hf.md): ``mode`` ``"jpeg"`` (default) or ``"png"``; ``block_size`` (8); jpeg ``keep_freqs``
    (all), ``quant_bits`` (8; an int, a per-frequency table, or ``None``: unquantized), ``levels``, ``scale_axis``,
    ``group``, ``scale_search``, ``rotate``, ``center``; png ``keep_ratio`` (1.0 = exact); ``sinks`` / ``window``
    (raw first / newest tokens). Cache options: ``layout`` ``"dynamic"`` / ``"static"`` (needs ``max_cache_len``),
    ``materialization_free``, ``memoize``, ``strict``, ``crop``, ``offloading``, ``offload_only_non_sliding``.

    Layers: with ``config`` (or :meth:`from_config`), one per model layer: codec layers on full-attention layers and,
    on the dynamic layout, codec rings on sliding-window and chunked-attention layers and codec attention halves in
    hybrid (linear + attention) layers (the static layout keeps those native, and warns); every other layer type
    (linear attention, indexed, ...) keeps its native transformers layer; a cache with no codec layer at all warns
    (:class:`NoCodecLayers`; ``strict=True`` raises). With ``num_layers``, that many codec layers. With neither,
    codec layers are created as the model asks for them (``per_layer`` then needs ``num_layers`` or ``config``).
    """

    def __init__(self, codecs: CacheConfig | str | None = None, *, layout: str = "dynamic",
                 max_cache_len: int | None = None, materialization_free: bool = True, strict: bool = False,
                 memoize: bool | None = None, crop: str = "decode", offloading: bool = False,
                 offload_only_non_sliding: bool = True, config: Any = None, num_layers: int | None = None,
                 **options: Any):
        _compat.warn_untested_transformers()
        check_cache_switches(layout, max_cache_len, materialization_free, strict, memoize, crop)
        for name, value in (("offloading", offloading), ("offload_only_non_sliding", offload_only_non_sliding)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        codec_config = resolve_codecs(codecs, options)
        # Cache.__init__ by name below, not super(): a model's own cache class may follow in the MRO
        # (hf/own_caches.py) with an __init__ of other arguments
        layer_kwargs = dict(layout=layout, max_cache_len=max_cache_len, memoize=memoize,
                            materialization_free=materialization_free, strict=strict, crop=crop)
        if config is not None and not is_model_config(config):
            raise TypeError(f"config must be None or a transformers PreTrainedConfig (model.config), got "
                            f"{type(config).__name__}")
        if config is not None and num_layers is not None:
            raise ValueError("pass either config or num_layers, not both")
        if config is not None:
            layer_types, native_kwargs = _compat.layer_types_and_kwargs(config)
        elif num_layers is not None:
            check_count("num_layers", num_layers, 1)
            layer_types, native_kwargs = ["full_attention"] * num_layers, [{}] * num_layers
        else:
            layer_types = native_kwargs = None
            if codec_config.per_layer:
                raise ValueError("per_layer needs the layer count: use FlashCodecCache.from_config(config, per_layer=...) "
                                 "or pass num_layers=")

        self.codec_config = codec_config
        self.options = {"codecs": codec_config.spec, **layer_kwargs, "offloading": offloading}
        self._padding_mask: torch.Tensor | None = None
        self.step_table = StepTable()  # the steps its codec layers hand attention, by layer index (hf/handoff.py)
        self.source_config = config  # what save() fingerprints (hf/cache_file.py)
        offload = dict(offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)
        if layer_types is None:
            Cache.__init__(self, layer_class_to_replicate=_LayerFactory(codec_config, layer_kwargs, not offloading),
                           **offload)
            return
        layers = _layers(codec_config, layer_types, native_kwargs, layer_kwargs, _head_dims(config, len(layer_types)),
                         mla_widths(config))
        for layer in layers:
            if isinstance(layer, FlashCodecLayer) and offloading:
                layer.fused_append = False  # offloaded right after update: update appends, attention reads the step
        if not any(isinstance(layer, FlashCodecLayer) for layer in layers):
            message = no_codec_message(f"this {type(config).__name__} model", layer_types)
            if strict:
                raise ValueError(f"{message} (strict=True)")
            warnings.warn(message, NoCodecLayers, stacklevel=3)
        Cache.__init__(self, layers=layers, **offload)

    def __deepcopy__(self, memo: dict) -> FlashCodecCache:
        """A deep copy of every layer; the offloading prefetch stream (a device queue, not data) is shared."""
        stream = vars(self).get("prefetch_stream")
        if stream is not None:
            memo[id(stream)] = stream
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for name, value in vars(self).items():
            setattr(clone, name, copy.deepcopy(value, memo))
        return clone

    @classmethod
    def from_config(cls, config: Any, **options: Any) -> FlashCodecCache:
        """One layer per model layer of ``config`` (its decoder text config): codec layers on full-attention layers,
        native transformers layers elsewhere. ``options``: as for the constructor (``preset=`` included)."""
        if not is_model_config(config):
            raise TypeError(f"config must be a transformers PreTrainedConfig (model.config), got "
                            f"{type(config).__name__}")
        return cls(config=config, **options)

    def check_model(self, config: Any) -> None:
        """Raise ``ValueError`` (naming both layer counts) when this cache holds another number of layers than the model
        of ``config`` runs; a cache built without a layer count grows to any model."""
        if self.layer_class_to_replicate is not None:
            return
        want = len(_compat.layer_types_and_kwargs(config)[0])
        if want != len(self.layers):
            raise ValueError(f"this FlashCodecCache holds {len(self.layers)} layers, the model runs {want}: build the "
                             f"cache from this model's config (FlashCodecCache.from_config(model.config, ...))")

    def save(self, path: Any, compression: str = "ppmd", model_or_config: Any = None) -> Any:
        """Write this cache to ``path`` (safetensors, exact bitwise; ``compression`` ``"raw"``, ``"zstd"`` or
        ``"ppmd"``): see :mod:`flashcodec_fx.hf.cache_file`. Returns the path."""
        from .cache_file import save

        return save(self, path, compression, model_or_config)

    @classmethod
    def load(cls, path: Any, model_or_config: Any, device: Any = None) -> FlashCodecCache:
        """The cache saved at ``path`` for ``model_or_config`` (checked; ``ValueError`` naming what differs)."""
        from .cache_file import load

        return load(path, model_or_config, device)

    def fork(self) -> FlashCodecCache:
        """A cache continuing from this one's tokens that shares its archives until either writes them
        (copy-on-append, :mod:`flashcodec_fx.persist.fork`): the prompt-cache recipe without copying the prompt."""
        from .cache_fork import fork_cache

        return fork_cache(self)

    @property
    def codec_layers(self) -> list[int]:
        """Indices of the layers that carry a codec."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, FlashCodecLayer)]

    def set_padding_mask(self, attention_mask: torch.Tensor | None) -> None:
        """Declare the 2D ``(B, P)`` padding mask (1 = token, 0 = padding) of the tokens at positions ``0..P-1``:
        their K/V are stored as zeros at padding positions, so padding cannot inflate quantization scales or
        blocks' energy. ``None`` clears it. ``apply_flash_codec`` / ``compress_kv`` call this from ``generate``."""
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(f"attention_mask must be a (B, P) tensor or None, got {type(attention_mask).__name__}")
            if attention_mask.dim() != 2:
                raise ValueError(f"attention_mask must be a (B, P) tensor or None, got shape {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.bool()
        self._padding_mask = attention_mask

    def _keep_mask(self, layer: FlashCodecLayer, key_states: torch.Tensor) -> torch.Tensor | None:
        mask = self._padding_mask
        start, t = layer.position, key_states.shape[2]  # absolute: a ring's streams hold only its window
        if mask is None or start >= mask.shape[1]:
            return None
        if start == 0 and t > mask.shape[1]:  # a model that stores tokens of its own beside the prompt's (CPM-Ant's
            return None  # learned prefix): which of them the mask's positions are is unknown, so none is zeroed
        if mask.shape[0] != key_states.shape[0]:
            raise ValueError(f"padding mask batch {mask.shape[0]} does not match the cache batch {key_states.shape[0]}")
        keep = mask[:, start: start + t].to(key_states.device)
        if keep.shape[1] < t:
            keep = torch.cat([keep, keep.new_ones(keep.shape[0], t - keep.shape[1])], dim=1)
        return keep

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``Cache.update``: the layer's update, with the padding mask (codec layers) and, when offloading, the next
        offloaded layer prefetched before and this one offloaded after (stream-ordered on CUDA, in order elsewhere)."""
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        if layer_idx >= len(self.layers):
            raise ValueError(f"update(layer_idx={layer_idx}): this FlashCodecCache holds {len(self.layers)} layers (built "
                             f"for a model with {len(self.layers)}); the model calling it has more: build the cache from "
                             f"this model's config (FlashCodecCache.from_config(model.config, ...))")
        layer = self.layers[layer_idx]
        compiling = dataflow() is COMPILED
        if isinstance(layer, FlashCodecLayer) and not compiling:  # host state: never traced
            layer.seat(self.step_table, layer_idx)
            if layer.unserved:
                fall_back_to_view([other for other in self.layers
                                   if isinstance(other, FlashCodecLayer) and other.unserved])
            if self._padding_mask is not None:
                kwargs = {**kwargs, "keep": self._keep_mask(layer, key_states)}
        if not self.offloading:
            return layer.update(key_states, value_states, *args, **kwargs)
        if compiling:
            raise RuntimeError("FlashCodecCache offloading runs eagerly only: compile the model without offloading, "
                               "or offload without torch.compile")
        if isinstance(layer, FlashCodecLayer):
            layer._check_new(key_states, value_states)  # refused before the prefetch moves anything
        if key_states.device.type == "cuda":  # as transformers' Cache.update
            torch.cuda.default_stream(key_states.device).wait_stream(self.prefetch_stream)
            self.prefetch_stream.wait_stream(torch.cuda.default_stream(key_states.device))
        self.prefetch(layer_idx + 1, self.only_non_sliding)
        out = layer.update(key_states, value_states, *args, **kwargs)
        self.offload(layer_idx, self.only_non_sliding)
        return out

    def crop(self, tokens_to_remove: int) -> None:
        """``Cache.crop`` on every layer: a negative int drops that many tokens (past the start: empty, as
        DynamicLayer); a positive int keeps that many (transformers < 5.18's convention, on native layers too). A crop
        that a codec layer refuses (see :meth:`flashcodec_fx.CodecStream.crop`) raises before any layer changes."""
        tokens_to_remove = crop_count(tokens_to_remove)
        if tokens_to_remove > 0:
            tokens_to_remove = min(0, tokens_to_remove - int(self.get_seq_length()))
        for layer in self.layers:
            if isinstance(layer, FlashCodecLayer) and layer.keys_stream.is_initialized:
                layer.check_crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    def storage_breakdown(self, per_layer: bool = False) -> dict[str, int] | dict[int, dict[str, int]]:
        """Every byte the cache holds, by part, summed over layers: the codec parts of
        :meth:`flashcodec_fx.CodecStream.storage_breakdown` (``archive``, ``scales``, ``sinks``, ``tail``, ``mean``,
        ``norm``, ``memo``; not in ``total``: ``archive_held`` / ``archive_used``, allocated / filled groups with their scales,
        and ``stored``, the tokens as stored),
        ``native``: tensors of the layers without a codec (and the linear-attention states of hybrid layers),
        ``total``. ``raw_equivalent``: what the codec layers' stored tokens would take uncompressed (not in
        ``total``). ``per_layer=True``: ``{layer_idx: dict}`` instead. ``ValueError`` when no layer carries a codec
        (:class:`NoCodecLayers`: there is no compressed storage to report)."""
        self._require_codec_layers("storage_breakdown")
        rows = {}
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, FlashCodecLayer):
                row = {"native": 0, **layer.storage_breakdown(), "raw_equivalent": layer.raw_equivalent_bytes()}
            else:
                native = _tensor_bytes([v for k, v in vars(layer).items() if k != "device"])
                row = {**dict.fromkeys(("archive", "archive_held", "archive_used", "stored", "scales", "sinks", "tail",
                                        "mean", "norm", "memo", "raw_equivalent"), 0), "native": native,
                       "total": native}
            rows[idx] = row
        if per_layer:
            return rows
        parts = next(iter(rows.values())).keys() if rows else ("total",)
        return {part: sum(row.get(part, 0) for row in rows.values()) for part in parts}

    def _require_codec_layers(self, method: str) -> None:
        """Raise ``ValueError`` from ``method`` when this cache holds layers and none carries a codec (a cache that
        grows its layers as the model asks holds codec layers only)."""
        if self.layers and not self.codec_layers:
            raise ValueError(f"{method}(): " + no_codec_message(
                "this cache", [getattr(layer, "_layer_type", None) or type(layer).__name__ for layer in self.layers]))

    def storage_bytes(self) -> int:
        """Every byte the cache holds (codec layers and native layers; see :meth:`storage_breakdown`): the ``stored``
        part that :meth:`bits_per_value` counts, plus spare capacity (archive groups allocated and not filled, sink and
        tail rows not holding a token, the length counters) and the memo. Capacity grows in steps that depend on the
        calls (a multi-token verification call, a crop, which keeps it): two caches of one length can hold other
        bytes."""
        return self.storage_breakdown()["total"]

    def bits_per_value(self) -> float:
        """Stored bits per cached K/V value of the codec layers, as stored: filled archive groups with their scales
        and zero points, raw sinks and tail rows, the mean and channel exponents; no unused capacity, no memo:
        ``8 * storage_breakdown()["stored"]`` over the values (K and V) the stored tokens stand for. A bf16 raw cache is
        16. After a crop (speculative decoding) the raw window can hold fewer tokens than ``window`` until new ones
        refill it (the tokens a rejected draft pushed into the archive stay archived), so fewer bits at one length."""
        self._require_codec_layers("bits_per_value")
        layers = [layer for layer in self.layers if isinstance(layer, FlashCodecLayer)]
        bits = sum(layer.stored_bits() for layer in layers)
        return bits / max(1, sum(layer.cached_values() for layer in layers))


class _LayerFactory:
    """``layer_class_to_replicate`` of a cache built without a layer count: the next codec layer, seeded by its index
    (``rotate=True``). A plain object rather than a closure over the cache, so a deep copy of the cache stays
    independent of the original."""

    def __init__(self, codec_config: CacheConfig, layer_kwargs: dict, fused_append: bool = True):
        self.codec_config, self.layer_kwargs, self.made, self.fused_append = codec_config, layer_kwargs, 0, fused_append

    def __call__(self) -> FlashCodecLayer:
        key, value = self.codec_config.layers.build(self.made)
        self.made += 1
        layer = FlashCodecLayer(key, value, **self.layer_kwargs)
        layer.fused_append = self.fused_append
        return layer


def _codec_layer(kind: str, key: Any, value: Any, kwargs: dict, layer_kwargs: dict,
                 mla: tuple[int, int] | None) -> FlashCodecLayer:
    """The codec layer of a model layer of type ``kind`` (one of :data:`CODEC_LAYER_TYPES`), built with transformers'
    per-layer ``kwargs`` (``sliding_window``, ``number_of_states``); ``mla``: an MLA model's ``(kv_lora_rank,
    qk_rope_head_dim)``, whose full-attention and sliding-window layers store one latent row with the key codec."""
    states = {"number_of_states": kwargs.get("number_of_states", 1)}
    if kind == "full_attention" and mla is not None:
        return FlashCodecMLALayer(key, latent_width=mla[0], rope_width=mla[1], **layer_kwargs)
    if kind == "full_attention":
        return FlashCodecLayer(key, value, **layer_kwargs)
    if kind == "hybrid":
        return FlashCodecHybridLayer(key, value, **states, **layer_kwargs)
    window = {"sliding_window": kwargs["sliding_window"]}
    if kind == "sliding_attention" and mla is not None:
        return FlashCodecSlidingMLALayer(key, latent_width=mla[0], rope_width=mla[1], **window, **layer_kwargs)
    if kind == "hybrid_sliding":
        return FlashCodecHybridSlidingLayer(key, value, **window, **states, **layer_kwargs)
    return FlashCodecSlidingLayer(key, value, **window, **layer_kwargs)  # sliding, chunked: a ring of the window


def _layers(codec_config: CacheConfig, layer_types: list[str], native_kwargs: list[dict], layer_kwargs: dict,
            head_dims: list[int | None], mla: tuple[int, int] | None = None) -> list:
    """One cache layer per model layer (see :class:`FlashCodecCache`); checks the overrides and each layer's head dim
    first (``head_dims``, per layer; an MLA model's: its latent row, ``kv_lora_rank + qk_rope_head_dim``)."""
    if mla is not None:
        head_dims = [sum(mla)] * len(layer_types)
    layout, n = layer_kwargs["layout"], len(layer_types)
    allowed = CODEC_LAYER_TYPES if layout == "dynamic" else STATIC_CODEC_LAYER_TYPES
    carries = [kind in allowed for kind in layer_types]
    for idx in codec_config.overrides:
        if idx >= n:
            raise ValueError(f"per_layer: layer index {idx} out of range; the model has {n} layers")
        if not carries[idx]:
            raise ValueError(f"per_layer: layer {idx} is a {layer_types[idx]!r} layer; with layout={layout!r} only "
                             f"{allowed} layers carry a codec")
    layers, native_windowed = [], []
    for idx, (kind, kwargs) in enumerate(zip(layer_types, native_kwargs, strict=True)):
        layer_config = codec_config.layer(idx) if carries[idx] else None
        if layer_config is None:
            if kind in WINDOWED:
                native_windowed.append(idx)
            mapping = STATIC_LAYER_TYPE_MAPPING if layout == "static" else DYNAMIC_LAYER_TYPE_MAPPING
            layers.append(mapping[kind](**({"max_cache_len": layer_kwargs["max_cache_len"]} if layout == "static"
                                           else {}), **kwargs))
            continue
        if kind in WINDOWED:
            layer_config = layer_config.without_sinks()
        key, value = layer_config.build(idx)
        head_dim = head_dims[idx]
        if head_dim is not None:
            for stream, codec in (("keys", key), ("values", value)):
                try:
                    codec.check_head_dim(head_dim)
                except ValueError as err:
                    raise ValueError(f"layer {idx} ({stream}): {err}") from None
        layers.append(_codec_layer(kind, key, value, kwargs, layer_kwargs, mla))
    if layout == "static" and native_windowed and any(carries):
        warnings.warn(f"layout='static' keeps the {len(native_windowed)} sliding-window / hybrid layer(s) "
                      f"{native_windowed} native (uncompressed): codec rings and hybrid codec layers need the dynamic "
                      f"layout", StaticSlidingNative, stacklevel=4)
    return layers


def _head_dims(config: Any, layers: int) -> list[int | None]:
    """The attention head dim of each of the ``layers`` layers of ``config`` (its decoder text config): a
    heterogeneous config's (``per_layer_config``: Gemma 4's sliding and full layers differ) read from each layer's
    config; None where the config does not say."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if "head_dim" in (getattr(text, "per_layer_attributes", None) or ()):
        return [_head_dim(layer) for layer in text.per_layer_config]
    return [_head_dim(text)] * layers


def _head_dim(text: Any) -> int | None:
    """The attention head dim of one (text or per-layer) config, None where it does not say."""
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None and getattr(text, "hidden_size", None) and getattr(text, "num_attention_heads", None):
        head_dim = text.hidden_size // text.num_attention_heads
    return head_dim if isinstance(head_dim, int) else None


__all__ = ["CODEC_LAYER_TYPES", "FlashCodecCache", "NoCodecLayers", "STATIC_CODEC_LAYER_TYPES", "StaticSlidingNative"]
