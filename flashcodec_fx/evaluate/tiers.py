"""Tiers: named recipes for building a transformers cache, and the cache a tier builds for a model.

A *tier* is the raw ``DynamicCache`` (the reference), a ``FlashCodecCache`` with given options, or any other cache
factory (peers such as transformers' ``QuantizedCache``). transformers is imported only when a cache is built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Tier:
    """A named cache recipe. ``options``: ``FlashCodecCache.from_config`` options, or ``None`` for the raw
    ``DynamicCache``; ``factory(model) -> cache`` overrides both (peers). ``note`` is printed with the results."""

    name: str
    options: Mapping[str, Any] | None = None
    factory: Callable[[Any], Any] | None = field(default=None, compare=False)
    note: str = ""

    @property
    def is_raw(self) -> bool:
        return self.options is None and self.factory is None


RAW = Tier("raw DynamicCache")


def main_tiers(view: bool = True) -> list[Tier]:
    """The main job's tiers: raw, png lossless, jpeg float, jpeg int8 at K = 8, 4, 2 (r = 8), all on the default
    decode path (attention on the stored form), and optionally the int8 tier attending on its decoded view (a memo)."""
    tiers = [
        RAW,
        Tier("png keep=1.0", {"mode": "png", "block_size": 8, "keep_ratio": 1.0}),
        Tier("jpeg r=8 K=8", {"mode": "jpeg", "block_size": 8, "keep_freqs": 8, "quant_bits": None}),
        Tier("jpeg r=8 K=8 int8", {"mode": "jpeg", "block_size": 8, "keep_freqs": 8, "quant_bits": 8}),
        Tier("jpeg r=8 K=4 int8", {"mode": "jpeg", "block_size": 8, "keep_freqs": 4, "quant_bits": 8}),
        Tier("jpeg r=8 K=2 int8", {"mode": "jpeg", "block_size": 8, "keep_freqs": 2, "quant_bits": 8}),
    ]
    if view:
        options = {"mode": "jpeg", "block_size": 8, "keep_freqs": 8, "quant_bits": 8, "materialization_free": False,
                   "memoize": True}
        tiers.append(Tier("jpeg r=8 K=8 int8 view", options,
                          note="decode attention on the decoded view, kept as a memo (the pre-0.2 default)"))
    return tiers


def make_cache(model: Any, tier: Tier) -> Any:
    """A fresh, empty cache of ``tier`` for ``model``."""
    if tier.factory is not None:
        return tier.factory(model)
    if tier.options is None:
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    from flashcodec_fx.hf import FlashCodecCache

    return FlashCodecCache.from_config(model.config, **tier.options)


@contextlib.contextmanager
def prepared(model: Any, tier: Tier) -> Iterator[None]:
    """Run ``tier`` on ``model``: a ``FlashCodecCache`` tier installs the ``"kvcodec"`` attention function for the
    duration (and removes it after), so layers that attend on their stored form (materialization-free) do; layers
    that do not compute exactly as without it. Other tiers run the model as it is."""
    if tier.options is None or tier.factory is not None:
        yield
        return
    from flashcodec_fx.hf import apply_codec_attention, remove_codec_attention

    apply_codec_attention(model)
    try:
        yield
    finally:
        remove_codec_attention(model)
