"""Stateless codec math: DCT basis, rotation, level sets, packing, the quantizer and the `jpeg` / `png` codecs."""

from __future__ import annotations

import functools

from .base import JPEG, MODE_NAMES, PNG, Codec, Encoded
from .dct import dct_basis
from .jpeg import JPEGCodec
from .levels import LEVELS, level_table, qmax
from .png import PNGCodec
from .quant import AXES, Quantizer
from .rotation import rotation

RESIDUAL_OPTIONS = ("sinks", "window")
OPTIONS = {
    "jpeg": ("block_size", "keep_freqs", "quant_bits", "levels", "scale_axis", "group", "scale_search", "rotate",
             "center", *RESIDUAL_OPTIONS),
    "png": ("block_size", "keep_ratio", *RESIDUAL_OPTIONS),
}


def make_codec(mode: str, **options) -> Codec:
    """Build a codec by name: ``make_codec("jpeg", block_size=8, keep_freqs=8, quant_bits=8)``,
    ``make_codec("png", block_size=8, keep_ratio=1.0)``; options per mode in ``OPTIONS``."""
    if mode not in OPTIONS:
        raise ValueError(f"mode must be one of {sorted(OPTIONS)}, got {mode!r}")
    unknown = sorted(set(options) - set(OPTIONS[mode]))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for mode={mode!r}; allowed: {list(OPTIONS[mode])}")
    return JPEGCodec(**options) if mode == "jpeg" else PNGCodec(**options)


def codec_from_spec(spec: str) -> Codec:
    """Inverse of ``Codec.spec`` (memoized)."""
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a codec spec string (Codec.spec), got {type(spec).__name__} {spec!r}")
    return _codec_from_spec(spec)


def _int(fields: dict, key: str) -> int:
    try:
        return int(fields[key])
    except (KeyError, ValueError):
        raise ValueError(f"spec field {key!r} missing or not an int in {fields}") from None


def _field(fields: dict, key: str) -> str:
    if key not in fields:
        raise ValueError(f"spec field {key!r} missing in {fields}")
    return fields[key]


def _ints(fields: dict, key: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in _field(fields, key).split("."))
    except ValueError:
        raise ValueError(f"spec field {key!r} must be dot-separated ints, got {fields[key]!r}") from None


@functools.lru_cache(maxsize=512)
def _codec_from_spec(spec: str) -> Codec:
    mode, *items = spec.split(";")
    try:
        fields = dict(item.split("=", 1) for item in items)
    except ValueError:
        raise ValueError(f"spec must be 'mode;key=value;...', got {spec!r}") from None
    residual = {"sinks": _int(fields, "sinks"), "window": _int(fields, "window")}
    if mode == "png":
        r, kept = _int(fields, "r"), _int(fields, "kept")
        if not 1 <= kept < r:
            raise ValueError(f"spec kept must be in 1..{r - 1} for png block_size={r}, got {kept}")
        codec = PNGCodec(r, kept / (r - 1), **residual)
    elif mode == "jpeg":
        options = dict(rotate=None if fields.get("rotate", "-") == "-" else _int(fields, "rotate"),
                       center=bool(_int(fields, "center")), **residual)
        r = _int(fields, "r")
        if "bits" in fields:
            options.update(quant_bits=_ints(fields, "bits"), levels=tuple(_field(fields, "levels").split(".")),
                           scale_axis=_field(fields, "axis"), group=_int(fields, "blocks") * r,
                           scale_search=bool(_int(fields, "search")))
        codec = JPEGCodec(r, _int(fields, "k"), **options)
    else:
        raise ValueError(f"spec mode must be 'jpeg' or 'png', got {mode!r} in {spec!r}")
    if codec.spec != spec:
        raise ValueError(f"spec {spec!r} is not canonical (it reads back as {codec.spec!r})")
    return codec


__all__ = [
    "AXES", "JPEG", "LEVELS", "MODE_NAMES", "OPTIONS", "PNG", "Codec", "Encoded", "JPEGCodec", "PNGCodec", "Quantizer",
    "codec_from_spec", "dct_basis", "level_table", "make_codec", "qmax", "rotation",
]
