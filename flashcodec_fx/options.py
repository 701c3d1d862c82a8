"""Validation of the cache options: codec choice per stream, per-layer overrides, cache-wide switches (no
transformers import: the transformers integration and other hosts share it).

Everything is checked up front and reported as ``ValueError``/``TypeError`` naming the option and what is allowed,
before any cache, model or class is touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .cache import CROP_MODES, LAYOUTS
from .codecs import Codec, make_codec

MODES = ("jpeg", "png")
UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<default>"})()

# Codec options, with the modes they apply to and their defaults (jpeg: all coefficients, int8; png: exact).
_JPEG_ONLY = ("keep_freqs", "quant_bits", "levels", "scale_axis", "group", "scale_search", "rotate", "center")
CODEC_OPTIONS = {"mode": MODES, "block_size": MODES, **dict.fromkeys(_JPEG_ONLY, ("jpeg",)), "keep_ratio": ("png",),
                 "sinks": MODES, "window": MODES}
DEFAULTS = {"mode": "jpeg", "block_size": 8, "keep_freqs": None, "quant_bits": 8, "levels": None, "scale_axis": "token",
            "group": None, "scale_search": False, "rotate": None, "center": False, "keep_ratio": 1.0, "sinks": 0,
            "window": 0}
STREAM_OPTIONS = ("key_options", "value_options")
LAYER_OPTIONS = (*CODEC_OPTIONS, *STREAM_OPTIONS)
CACHE_OPTIONS = (*LAYER_OPTIONS, "preset", "layout", "max_cache_len", "per_layer", "materialization_free", "strict",
                 "memoize", "crop", "offloading", "offload_only_non_sliding")


@dataclass(frozen=True)
class LayerCodecs:
    """The two codecs of one compressed layer (same block_size)."""

    key: Codec
    value: Codec


def _check_stream_dict(name: str, value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict of codec options or None, got {type(value).__name__}")
    unknown = sorted(set(value) - set(CODEC_OPTIONS))
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; allowed: {list(CODEC_OPTIONS)}")
    return dict(value)


def _build_codec(stream: str, shared: dict, own: dict, layer_idx: int) -> Codec:
    """Codec of one stream: ``own`` (from key_options/value_options) overrides ``shared``; options must fit the mode.
    ``rotate=True`` becomes the seed ``layer_idx`` (a fixed rotation per layer, reproducible from the spec)."""
    mode = own.get("mode", shared.get("mode", DEFAULTS["mode"]))
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}" + (f" (in {stream}_options)" if "mode" in own else ""))
    for name in own:
        if mode not in CODEC_OPTIONS[name]:
            raise ValueError(f"{stream}_options: option {name!r} applies to mode {CODEC_OPTIONS[name]} only, "
                             f"but this stream's mode is {mode!r}")
    merged = {**shared, **own}
    kwargs = {}
    for name in CODEC_OPTIONS:
        if name == "mode" or mode not in CODEC_OPTIONS[name]:
            continue
        kwargs[name] = merged.get(name, DEFAULTS[name])
    if kwargs.get("rotate") is True:
        kwargs["rotate"] = layer_idx
    return make_codec(mode, **kwargs)


def resolve_layer_codecs(options: Mapping[str, Any], where: str = "", layer_idx: int = 0) -> LayerCodecs:
    """``options``: any of ``LAYER_OPTIONS`` (absent = default). Returns the key and value codecs of layer
    ``layer_idx`` (it seeds ``rotate=True``).

    A shared option that fits neither stream's mode (e.g. ``keep_ratio`` with ``mode="jpeg"``) raises.
    """
    prefix = f"{where}: " if where else ""
    unknown = sorted(set(options) - set(LAYER_OPTIONS))
    if unknown:
        raise ValueError(f"{prefix}unknown option(s) {unknown}; allowed: {list(LAYER_OPTIONS)}")
    shared = {k: v for k, v in options.items() if k in CODEC_OPTIONS and v is not UNSET}
    own = {s: _check_stream_dict(s, options.get(s)) for s in STREAM_OPTIONS}
    try:
        key = _build_codec("key", shared, own["key_options"], layer_idx)
        value = _build_codec("value", shared, own["value_options"], layer_idx)
    except (ValueError, TypeError) as err:
        raise type(err)(f"{prefix}{err}") from None
    modes = {key.mode, value.mode}
    for name in shared:
        if name != "mode" and not any(_mode_name(m) in CODEC_OPTIONS[name] for m in modes):
            raise ValueError(f"{prefix}option {name!r} applies to mode {CODEC_OPTIONS[name]} only; "
                             f"this layer uses {sorted(_mode_name(m) for m in modes)}")
    return LayerCodecs(key, value)


def _mode_name(mode: int) -> str:
    return MODES[mode]


def check_cache_switches(layout: Any, max_cache_len: Any, materialization_free: Any, strict: Any, memoize: Any,
                         crop: Any = "exact") -> None:
    """Validate the cache-wide options."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "static":
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive int for layout='static', got {max_cache_len!r}")
    elif max_cache_len is not None:
        raise ValueError(f"max_cache_len applies to layout='static' only, got max_cache_len={max_cache_len!r} with "
                         f"layout={layout!r}")
    for name, value in (("materialization_free", materialization_free), ("strict", strict)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    if memoize is not None and not isinstance(memoize, bool):
        raise TypeError(f"memoize must be None (automatic) or a bool, got {type(memoize).__name__} {memoize!r}")
    if strict and not materialization_free:
        raise ValueError("strict=True only applies with materialization_free=True (it turns its fallbacks into errors)")
    if memoize and materialization_free:
        raise ValueError("memoize=True keeps a decoded view that attention on the stored form never reads: set "
                         "materialization_free=False to attend on the view, or leave memoize unset")
    if crop not in CROP_MODES:
        raise ValueError(f"crop must be one of {CROP_MODES}, got {crop!r}")


def check_per_layer(per_layer: Any) -> dict[int, dict | None]:
    """``per_layer``: ``{layer_idx: {codec options} | None}``; ``None`` keeps that layer uncompressed (native)."""
    if per_layer is None:
        return {}
    if not isinstance(per_layer, Mapping):
        raise TypeError(f"per_layer must be a dict {{layer_idx: options dict or None}}, got {type(per_layer).__name__}")
    out = {}
    for idx, opts in per_layer.items():
        if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
            raise ValueError(f"per_layer keys must be layer indices (ints >= 0), got {idx!r}")
        if opts is not None and not isinstance(opts, Mapping):
            raise TypeError(f"per_layer[{idx}] must be a dict of codec options or None, got {type(opts).__name__}")
        if opts is not None:
            unknown = sorted(set(opts) - set(LAYER_OPTIONS))
            if unknown:
                raise ValueError(f"per_layer[{idx}]: unknown option(s) {unknown}; allowed: {list(LAYER_OPTIONS)}")
        out[idx] = None if opts is None else dict(opts)
    return out


def layer_options(cache_wide: Mapping[str, Any], override: Mapping[str, Any] | None) -> dict[str, Any]:
    """Options of one layer: ``override`` merged over the cache-wide codec options (key_options / value_options merged
    key by key). An override that sets ``mode`` starts afresh from the defaults, keeping only the cache-wide
    ``block_size``: options of the other mode are not inherited."""
    base = {k: v for k, v in cache_wide.items() if k in LAYER_OPTIONS and v is not UNSET}
    if override is None:
        return base
    if "mode" in override:
        base = {k: v for k, v in base.items() if k == "block_size"}
    merged = {**base, **override}
    for stream in STREAM_OPTIONS:
        if stream in base and stream in override and base[stream] is not None and override[stream] is not None:
            merged[stream] = {**base[stream], **override[stream]}
    return merged


def check_option_names(options: Mapping[str, Any], allowed: tuple[str, ...] = CACHE_OPTIONS) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; allowed: {list(allowed)}")
