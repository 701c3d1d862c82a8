"""Codec configuration: what each layer of a cache stores, as frozen, validated values (no transformers import).

- :class:`StreamConfig`: one stream's codec, a registered codec name and its options (``rotate=True`` stands for
  the seed ``layer index``, so one configuration serves every layer);
- :class:`LayerConfig`: the key and the value stream of one layer;
- :class:`CacheConfig`: the layer configuration of every layer, with per-layer overrides (``None``: a native layer).

Presets are :class:`CacheConfig` values (``flashcodec_fx.PRESETS``). ``CacheConfig.spec`` is a JSON string that
:meth:`CacheConfig.from_spec` reads back (saved caches carry it). :func:`cache_config` builds a configuration from the
keyword options ``FlashCodecCache`` takes. Override rule, for cache-wide and per-layer options alike: shared codec
options apply to both streams, over the preset's or the default's own stream options (each stream takes the ones
its codec has; an option neither codec has raises); ``key_options`` / ``value_options`` apply to one stream after
them; a ``mode`` starts that stream afresh from the cache defaults of that codec. Bad options raise ``ValueError`` /
``TypeError`` naming the option, before anything is built.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from .codecs import Codec, codec_class, codec_options, make_codec

DEFAULT_MODE = "jpeg"
CACHE_DEFAULTS: dict[str, dict[str, Any]] = {"jpeg": {"quant_bits": 8}, "png": {}}
"""Options a cache gives a codec built from options that do not set them (a cache's jpeg is 8-bit unless
``quant_bits`` says otherwise; the codec itself, built with ``make_codec``, keeps floats)."""
STREAM_OPTIONS = ("key_options", "value_options")


def _frozen(value: Any) -> Hashable:
    """Lists and tuples as tuples (hashable, as a frozen configuration holds them)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


@dataclass(frozen=True)
class StreamConfig:
    """One stream's codec: ``codec`` (a registered name, see ``flashcodec_fx.codecs.CODECS``) and the options set
    (the others take the codec's defaults). Built and validated on construction."""

    codec: str = DEFAULT_MODE
    options: tuple[tuple[str, Hashable], ...] = ()

    def __post_init__(self) -> None:
        allowed = codec_options(self.codec)  # ValueError naming the registered codecs
        options = dict(self.options)
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for mode={self.codec!r}; allowed: {list(allowed)}")
        object.__setattr__(self, "options", tuple(sorted((k, _frozen(v)) for k, v in options.items())))
        self.build(0)

    @classmethod
    def of(cls, codec: str = DEFAULT_MODE, **options: Any) -> StreamConfig:
        """``StreamConfig.of("jpeg", block_size=1, quant_bits=4)``."""
        return cls(codec, tuple(options.items()))

    @classmethod
    def default(cls, codec: str = DEFAULT_MODE, **options: Any) -> StreamConfig:
        """A cache's stream of ``codec``: :data:`CACHE_DEFAULTS` under ``options``."""
        codec_class(codec)
        return cls.of(codec, **{**CACHE_DEFAULTS.get(codec, {}), **options})

    @property
    def as_dict(self) -> dict[str, Any]:
        return dict(self.options)

    def takes(self, option: str) -> bool:
        return option in codec_options(self.codec)

    def build(self, layer_idx: int) -> Codec:
        """The codec of layer ``layer_idx`` (``rotate=True`` seeds the rotation with the layer index)."""
        options = self.as_dict
        if options.get("rotate") is True:
            options["rotate"] = layer_idx
        return make_codec(self.codec, **options)

    def merged(self, options: Mapping[str, Any]) -> StreamConfig:
        """``options`` over this stream's; ``mode`` starts afresh from that codec's cache defaults."""
        options = dict(options)
        if "mode" in options:
            return StreamConfig.default(options.pop("mode"), **options)
        return StreamConfig.of(self.codec, **{**self.as_dict, **options})

    def to_json(self) -> dict[str, Any]:
        return {"codec": self.codec, "options": self.as_dict}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> StreamConfig:
        return cls.of(value["codec"], **value["options"])


@dataclass(frozen=True)
class LayerConfig:
    """The key and the value stream of one layer."""

    key: StreamConfig
    value: StreamConfig

    @classmethod
    def default(cls, codec: str = DEFAULT_MODE) -> LayerConfig:
        stream = StreamConfig.default(codec)
        return cls(stream, stream)

    def build(self, layer_idx: int) -> tuple[Codec, Codec]:
        """``(key codec, value codec)`` of layer ``layer_idx``."""
        return self.key.build(layer_idx), self.value.build(layer_idx)

    def merged(self, options: Mapping[str, Any], where: str = "") -> LayerConfig:
        """Options (codec options for both streams, ``key_options`` / ``value_options`` for one; see the module
        docstring) over this layer's. ``where`` prefixes errors (``"per_layer[3]"``)."""
        prefix = f"{where}: " if where else ""
        shared = {k: v for k, v in options.items() if k not in STREAM_OPTIONS}
        own = {}
        for name in STREAM_OPTIONS:
            value = options.get(name)
            if value is not None and not isinstance(value, Mapping):
                raise TypeError(f"{prefix}{name} must be a dict of codec options or None, got {type(value).__name__}")
            own[name] = dict(value or {})
        try:
            key, value = self._apply_shared(shared)
        except (ValueError, TypeError) as err:
            raise type(err)(f"{prefix}{err}") from None
        streams = []
        for name, stream in (("key_options", key), ("value_options", value)):
            try:
                streams.append(stream.merged(own[name]) if own[name] else stream)
            except (ValueError, TypeError) as err:
                raise type(err)(f"{prefix}{name}: {err}") from None
        return LayerConfig(*streams)

    def _apply_shared(self, shared: dict[str, Any]) -> tuple[StreamConfig, StreamConfig]:
        if "mode" in shared:
            stream = StreamConfig.default(shared["mode"])
            key = value = stream
        else:
            key, value = self.key, self.value
        rest = {k: v for k, v in shared.items() if k != "mode"}
        unknown = sorted(name for name in rest if not (key.takes(name) or value.takes(name)))
        if unknown:
            allowed = sorted(set(codec_options(key.codec)) | set(codec_options(value.codec)) | {"mode", *STREAM_OPTIONS})
            raise ValueError(f"unknown option(s) {unknown} for this layer's codecs ({key.codec}, {value.codec}); "
                             f"allowed: {allowed}")
        return (key.merged({k: v for k, v in rest.items() if key.takes(k)}),
                value.merged({k: v for k, v in rest.items() if value.takes(k)}))

    def without_sinks(self) -> LayerConfig:
        """Both streams with ``sinks=0`` (a sliding window leaves its first tokens behind)."""
        return LayerConfig(self.key.merged({"sinks": 0}), self.value.merged({"sinks": 0}))

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key.to_json(), "value": self.value.to_json()}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> LayerConfig:
        return cls(StreamConfig.from_json(value["key"]), StreamConfig.from_json(value["value"]))


@dataclass(frozen=True)
class CacheConfig:
    """Every layer's codecs: ``layers`` (the default), ``per_layer`` overrides by layer index (``None``: native)."""

    layers: LayerConfig
    per_layer: tuple[tuple[int, LayerConfig | None], ...] = ()

    def __post_init__(self) -> None:
        for idx, layer in self.per_layer:
            check_layer_index(idx)
            if layer is not None and not isinstance(layer, LayerConfig):
                raise TypeError(f"per_layer[{idx}] must be a LayerConfig or None, got {type(layer).__name__}")
        object.__setattr__(self, "per_layer", tuple(sorted(self.per_layer, key=lambda item: item[0])))

    @property
    def overrides(self) -> dict[int, LayerConfig | None]:
        return dict(self.per_layer)

    def layer(self, layer_idx: int) -> LayerConfig | None:
        """The configuration of layer ``layer_idx`` (None: kept native)."""
        return self.overrides.get(layer_idx, self.layers)

    @property
    def spec(self) -> str:
        """This configuration as a JSON string (:meth:`from_spec` reads it back)."""
        return json.dumps({"layers": self.layers.to_json(),
                           "per_layer": [[i, None if c is None else c.to_json()] for i, c in self.per_layer]},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_spec(cls, spec: str) -> CacheConfig:
        """Inverse of :attr:`spec` (ValueError for a string that is not one)."""
        if not isinstance(spec, str):
            raise TypeError(f"spec must be a CacheConfig.spec string, got {type(spec).__name__}")
        try:
            value = json.loads(spec)
            return cls(LayerConfig.from_json(value["layers"]),
                       tuple((i, None if c is None else LayerConfig.from_json(c)) for i, c in value["per_layer"]))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"spec is not a CacheConfig.spec string ({type(err).__name__}: {err}): {spec[:120]!r}") \
                from None


def cache_config(preset: str | None = None, per_layer: Mapping[int, Any] | None = None, **options: Any) -> CacheConfig:
    """The configuration ``FlashCodecCache`` keyword options describe: ``preset`` (a ``PRESETS`` name; none and no
    codec options: ``DEFAULT_PRESET``), codec options and ``key_options`` / ``value_options`` over it (the module
    docstring's rule; a ``mode`` next to a preset raises: it would replace the preset's codec), and ``per_layer``
    ``{layer_idx: options dict | preset name | None}`` (a dict merges over the cache-wide layer by the same rule, a
    preset name replaces it, None keeps the layer native)."""
    if preset is not None or not options:
        from .presets import DEFAULT_PRESET, preset_config  # presets are built with this function: imported here
    if preset is not None:
        modes = ["mode"] if "mode" in options else []
        modes += [f"{s}['mode']" for s in STREAM_OPTIONS if isinstance(options.get(s), Mapping) and "mode" in options[s]]
        if modes:
            raise ValueError(f"{', '.join(modes)} would replace preset {preset!r}'s codec (none of its options would "
                             f"apply): pass the codec options without a preset")
        base = preset_config(preset)
    elif not options:
        base = preset_config(DEFAULT_PRESET)
    else:
        base = CacheConfig(LayerConfig.default(options.get("mode", DEFAULT_MODE)))
    layers = base.layers.merged({k: v for k, v in options.items() if not (k == "mode" and preset is None)})
    return CacheConfig(layers, tuple(_per_layer(layers, per_layer).items()))


def check_layer_index(idx: Any) -> None:
    """A ``per_layer`` key: ``TypeError`` unless an int (a layer index: ``per_layer={3: ...}``, not ``{"3": ...}``),
    ``ValueError`` when negative."""
    if isinstance(idx, bool) or not isinstance(idx, int):
        hint = f" (per_layer={{{idx}: ...}}, not {{{idx!r}: ...}})" if isinstance(idx, str) and idx.isdigit() else ""
        raise TypeError(f"per_layer keys must be layer indices (int >= 0), got {type(idx).__name__} {idx!r}{hint}")
    if idx < 0:
        raise ValueError(f"per_layer keys must be layer indices (int >= 0), got {idx}")


def _per_layer(layers: LayerConfig, per_layer: Any) -> dict[int, LayerConfig | None]:
    if per_layer is None:
        return {}
    if not isinstance(per_layer, Mapping):
        raise TypeError(f"per_layer must be a dict {{layer_idx: options dict, preset name or None}}, got "
                        f"{type(per_layer).__name__}")
    out: dict[int, LayerConfig | None] = {}
    for idx, override in per_layer.items():
        check_layer_index(idx)
        if override is None or isinstance(override, LayerConfig):
            out[idx] = override
        elif isinstance(override, str):
            from .presets import preset_config

            out[idx] = preset_config(override).layers
        elif isinstance(override, Mapping):
            out[idx] = layers.merged(override, where=f"per_layer[{idx}]")
        else:
            raise TypeError(f"per_layer[{idx}] must be a dict of codec options, a preset name or None, got "
                            f"{type(override).__name__}")
    return out


__all__ = ["CACHE_DEFAULTS", "CacheConfig", "LayerConfig", "StreamConfig", "cache_config"]
