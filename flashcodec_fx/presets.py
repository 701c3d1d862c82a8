"""Named presets, the way a serving stack picks a ``kv_cache_dtype``: a name -> FlashCodecCache options.

``FlashCodecCache.from_config(config, preset="3bit")``, ``apply_flash_codec(model, preset="3bit")``; options given
next to a preset override it (``key_options`` / ``value_options`` merged key by key). The bits in a name are the
target; what each preset stores, measured on real models, is in the README (``benchmarks/bench_ppl.py``).

Recipes (see docs/quantization.md): keys are DCT-coded along seq in blocks of 8 inside 128-token groups with one
scale per channel and group (DC asymmetric, one shared mid-rise step for the AC rows, a per-frequency bit table),
or quantized per channel over 128 tokens; values are centered (per-channel mean of the prompt), rotated along
head_dim (random signs + Walsh-Hadamard) and quantized per token on Lloyd-Max levels; a few first tokens ("sinks")
and the newest values stay raw.
"""

from __future__ import annotations

import copy
from typing import Any

SINKS = 4
_KEY_GROUP = 128


def _dct_keys(bits: tuple[int, ...]) -> dict[str, Any]:
    return {"mode": "jpeg", "block_size": 8, "quant_bits": bits, "levels": ("uniform", "midrise"),
            "scale_axis": "channel", "group": _KEY_GROUP, "scale_search": True, "rotate": True, "sinks": SINKS}


def _token_values(bits: int, window: int) -> dict[str, Any]:
    return {"mode": "jpeg", "block_size": 1, "quant_bits": bits, "levels": "lloyd", "rotate": True, "center": True,
            "scale_search": True, "sinks": SINKS, "window": window}


PRESETS: dict[str, dict[str, Any]] = {
    "lossless": {"mode": "png", "block_size": 8, "keep_ratio": 1.0},
    "int8": {"mode": "jpeg", "block_size": 8, "quant_bits": 8},
    "4bit": {
        "key_options": {"mode": "jpeg", "block_size": 1, "quant_bits": 4, "levels": "uniform", "scale_axis": "channel",
                        "group": _KEY_GROUP, "scale_search": True, "sinks": SINKS},
        "value_options": _token_values(4, 16),
    },
    "3bit": {"key_options": _dct_keys((5, 3, 3, 2, 2, 2, 2, 2)), "value_options": _token_values(2, 32)},
    "2.5bit": {"key_options": _dct_keys((4, 3, 2, 2, 2, 1, 1, 1)), "value_options": _token_values(2, 16)},
}
DEFAULT_PRESET = "int8"


def preset_options(name: str) -> dict[str, Any]:
    """A copy of preset ``name``'s options (ValueError naming the presets for an unknown one)."""
    if not isinstance(name, str):
        raise TypeError(f"preset must be a preset name (str), got {type(name).__name__}")
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return copy.deepcopy(PRESETS[name])


def with_preset(preset: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` over preset ``preset`` (None: ``options`` unchanged); stream option dicts merge key by key."""
    if preset is None:
        return dict(options)
    merged = preset_options(preset)
    for name, value in options.items():
        if name in ("key_options", "value_options") and isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name] = {**merged[name], **value}
        else:
            merged[name] = value
    return merged
