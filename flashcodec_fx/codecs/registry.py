"""The codec registry: each codec class owns its name, its options (its constructor's keywords, with their defaults)
and its spec fields; :func:`make_codec` and :func:`codec_from_spec` find it by name.

A new codec is one file: a :class:`~flashcodec_fx.codecs.base.Codec` subclass with a ``name``, a constructor taking
its options as keywords, :meth:`~Codec.spec_fields` and :meth:`~Codec.from_spec_fields`, decorated with
:func:`register_codec`. The reference ops, the caches and the compile pass use only the ``Codec`` interface; fast
kernels serve the codecs they know and leave the others to the reference.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, TypeVar

from .base import Codec, check_choice

CODECS: dict[str, type[Codec]] = {}
C = TypeVar("C", bound=type[Codec])


def register_codec(cls: C) -> C:
    """Class decorator: make ``cls`` reachable by its ``name`` (a new name; the options are its ``__init__``'s)."""
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"register_codec takes a Codec subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{cls.__name__}.name must be an identifier string, got {name!r}")
    if CODECS.get(name, cls) is not cls:
        raise ValueError(f"codec name {name!r} is taken by {CODECS[name].__name__}")
    CODECS[name] = cls
    _parsed.cache_clear()
    return cls


def codec_class(name: str) -> type[Codec]:
    """The codec class registered as ``name`` (ValueError naming the registered ones; TypeError for a non-str)."""
    return CODECS[check_choice("mode", name, sorted(CODECS))]


def codec_options(name: str) -> dict[str, Any]:
    """``{option: default}`` of codec ``name``: its constructor's keywords."""
    params = inspect.signature(codec_class(name).__init__).parameters.values()
    return {p.name: p.default for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD}


def make_codec(mode: str, **options: Any) -> Codec:
    """Build a codec by name: ``make_codec("jpeg", block_size=8, keep_freqs=8, quant_bits=8)``,
    ``make_codec("png", block_size=8, keep_ratio=1.0)``; the options of each are in :func:`codec_options`."""
    allowed = codec_options(mode)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for mode={mode!r}; allowed: {list(allowed)}")
    return CODECS[mode](**options)


class SpecFields:
    """The ``key=value`` fields of a spec string, read with the codec's error messages."""

    def __init__(self, spec: str, fields: dict[str, str]):
        self.spec, self.fields = spec, fields

    def str(self, key: str) -> str:
        if key not in self.fields:
            raise ValueError(f"spec field {key!r} missing in {self.spec!r}")
        return self.fields[key]

    def int(self, key: str) -> int:
        try:
            return int(self.str(key))
        except ValueError:
            raise ValueError(f"spec field {key!r} must be an int in {self.spec!r}") from None

    def ints(self, key: str) -> tuple[int, ...]:
        try:
            return tuple(int(b) for b in self.str(key).split("."))
        except ValueError:
            raise ValueError(f"spec field {key!r} must be dot-separated ints in {self.spec!r}") from None

    def has(self, key: str) -> bool:
        return key in self.fields


def codec_from_spec(spec: str) -> Codec:
    """Inverse of ``Codec.spec`` (memoized): ``"<name>;key=value;..."``, canonical."""
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a codec spec string (Codec.spec), got {type(spec).__name__} {spec!r}")
    return _parsed(spec)


@functools.lru_cache(maxsize=512)
def _parsed(spec: str) -> Codec:
    name, *items = spec.split(";")
    if name not in CODECS:
        raise ValueError(f"spec mode must be one of {sorted(CODECS)}, got {name!r} in {spec!r}")
    try:
        fields = dict(item.split("=", 1) for item in items)
    except ValueError:
        raise ValueError(f"spec must be 'mode;key=value;...', got {spec!r}") from None
    codec = CODECS[name].from_spec_fields(SpecFields(spec, fields))
    if codec.spec != spec:
        raise ValueError(f"spec {spec!r} is not canonical (it reads back as {codec.spec!r})")
    return codec
