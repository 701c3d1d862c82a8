"""The options of a :class:`~flashcodec_fx.hf.flash_codec_cache.FlashCodecCache`, checked before anything is built:
the cache-wide switches, the codecs asked for (a ``CacheConfig``, a preset, a spec string or codec options), and
``crop``'s argument."""

from __future__ import annotations

from typing import Any

import torch

from ..cache import CROP_MODES, LAYOUTS
from ..codecs import CODECS, codec_options
from ..codecs.base import check_choice, check_count
from ..config import CacheConfig, cache_config
from ..presets import PRESETS, preset_config

CODEC_KEYWORDS = ("preset", "per_layer", "key_options", "value_options", "mode")  # besides each codec's options
CACHE_SWITCHES = ("layout", "max_cache_len", "materialization_free", "strict", "memoize", "crop", "offloading",
                  "offload_only_non_sliding")


def check_cache_switches(layout: Any, max_cache_len: Any, materialization_free: Any, strict: Any, memoize: Any,
                         crop: Any = "decode") -> None:
    """Validate the cache-wide options (ValueError / TypeError naming the option), before anything is built."""
    check_choice("layout", layout, LAYOUTS)
    if layout == "static":
        if max_cache_len is None:
            raise ValueError("layout='static' needs max_cache_len (a positive int: the tokens each layer holds)")
        check_count("max_cache_len", max_cache_len, 1)
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
    check_choice("crop", crop, CROP_MODES)


def crop_count(tokens_to_remove: Any) -> int:
    """``crop``'s argument as an int: an int, or a one-element integer tensor (transformers 5.17's assisted decoding
    passes one; reading it is a host sync, outside any decode step)."""
    value = tokens_to_remove
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"tokens_to_remove must be an int (or a one-element integer tensor), got "
                        f"{type(tokens_to_remove).__name__}")
    return value


def resolve_codecs(codecs: CacheConfig | str | None, options: dict[str, Any]) -> CacheConfig:
    """The configuration ``FlashCodecCache(codecs, **options)`` asks for (see its docstring); raises naming what is
    wrong before anything is built."""
    if codecs is not None and not isinstance(codecs, (CacheConfig, str)):
        raise TypeError(_codecs_type_error(codecs))
    unknown = sorted(set(options) - set(CODEC_KEYWORDS) - {n for name in CODECS for n in codec_options(name)})
    if unknown:
        allowed = sorted(set(CODEC_KEYWORDS) | {n for name in CODECS for n in codec_options(name)})
        raise ValueError(f"unknown option(s) {unknown}; allowed: {allowed} and the cache options of FlashCodecCache")
    if codecs is None:
        return cache_config(**options)
    if options:
        raise ValueError(f"pass either codecs= or codec options, not both (got codecs and {sorted(options)})")
    if isinstance(codecs, CacheConfig):
        return codecs
    if isinstance(codecs, str):
        return preset_config(codecs) if codecs in PRESETS else CacheConfig.from_spec(codecs)
    return codecs


def is_model_config(value: Any) -> bool:
    """Whether ``value`` looks like a transformers model config (``PreTrainedConfig``: ``to_dict`` and
    ``model_type``), without importing its class."""
    return hasattr(value, "to_dict") and hasattr(value, "model_type")


def _codecs_type_error(codecs: Any) -> str:
    """The message for a ``codecs`` argument of another type, naming the usual mistake: a model's config (or the
    model) passed as the first positional argument."""
    wanted = "codecs (FlashCodecCache's first positional argument) must be a CacheConfig, a preset name or a " \
             "CacheConfig.spec string"
    if is_model_config(codecs) or is_model_config(getattr(codecs, "config", None)):
        what = "a model config" if is_model_config(codecs) else "a model"
        return (f"{wanted}, got {what} ({type(codecs).__name__}): a cache for a model's layers is built with "
                f"FlashCodecCache.from_config(model.config, preset=...) (or FlashCodecCache(config=model.config, "
                f"preset=...))")
    return f"{wanted}, got {type(codecs).__name__}"
