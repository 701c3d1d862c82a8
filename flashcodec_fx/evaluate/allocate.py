"""Per-layer bit allocation: which layers gain most from a costlier stream recipe, measured on calibration text.

A uniform recipe spends the same bits in every layer, but layers are not equally sensitive: on SmolLM2-135M the
KL that 3-bit values instead of 2-bit ones remove, one layer at a time, ranges from nothing to a tenth of the whole
(docs/quantization.md, "Per-layer allocation"). :func:`layer_gains` streams calibration windows through the raw cache,
a ``base`` recipe and, for every layer, the base with that layer ``upgrade``-d (``per_layer`` options, e.g.
``{"value_options": {"quant_bits": 3}}``), all in lockstep by the streaming protocol (:func:`~.drive.streaming`), and
returns each one's KL against the raw cache; :meth:`LayerGains.allocation` turns the ``count`` largest gains into
``FlashCodecCache`` options. How many layers a bits budget allows is the caller's count (every upgraded layer adds
the same bits when the layers have one shape; ``benchmarks/bench_allocate.py`` counts them as stored).

The gains are noisy (one layer's is a few percent of the KL); calibrate on text other than the text the result is
judged on, and on enough tokens: a layer whose gain is within the noise is as likely picked as not.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .drive import streaming
from .metrics import token_kl
from .tiers import RAW, Tier, make_cache, prepared


@dataclass(frozen=True)
class LayerGains:
    """KL (vs the raw cache, mean over scored tokens) of ``base`` and of ``base`` with each layer upgraded."""

    base: Mapping[str, Any]
    upgrade: Mapping[str, Any]
    base_kl: float
    layer_kl: tuple[tuple[int, float], ...]  # (layer index, KL with only that layer upgraded), in layer order

    @property
    def gains(self) -> dict[int, float]:
        """``{layer: base KL - KL with that layer upgraded}`` (negative: the upgrade measured worse, within noise)."""
        return {layer: self.base_kl - kl for layer, kl in self.layer_kl}

    def ranked(self) -> list[int]:
        """Layer indices, the largest gain first (ties: the lower index first)."""
        gains = self.gains
        return sorted(gains, key=lambda layer: (-gains[layer], layer))

    def allocation(self, count: int) -> dict[str, Any]:
        """``FlashCodecCache`` options: ``base`` with the ``count`` largest gains' layers upgraded (``per_layer``)."""
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"count must be an int, got {type(count).__name__}")
        if not 0 <= count <= len(self.layer_kl):
            raise ValueError(f"count must be in [0, {len(self.layer_kl)}] (the layers measured), got {count}")
        return upgraded(self.base, self.upgrade, self.ranked()[:count])


def upgraded(base: Mapping[str, Any], upgrade: Mapping[str, Any], layers: Sequence[int]) -> dict[str, Any]:
    """``base`` options with ``upgrade`` as the ``per_layer`` override of each of ``layers`` (merged over ``base``'s
    own overrides of those layers, if any: ``config.cache_config``'s rule)."""
    options = copy.deepcopy(dict(base))
    per_layer = dict(options.pop("per_layer", None) or {})
    for layer in layers:
        merged = copy.deepcopy(dict(per_layer.get(layer) or {}))
        merged.update(copy.deepcopy(dict(upgrade)))
        per_layer[layer] = merged
    if per_layer:
        options["per_layer"] = per_layer
    return options


@torch.no_grad()
def layer_gains(model: Any, ids: torch.Tensor, base: Mapping[str, Any], upgrade: Mapping[str, Any],
                layers: Sequence[int] | None = None, prefill: int = 128, chunk: int = 16) -> LayerGains:
    """Stream ``ids (B, L)`` (calibration windows) through the raw cache, ``base`` (``FlashCodecCache`` options) and
    ``base`` with each of ``layers`` (default: every layer that carries a codec, so not a hybrid model's linear
    attention layers) given ``upgrade`` as its ``per_layer`` options, in lockstep (``prefill`` exact tokens, then chunks
    of ``chunk``); the KL of each against the raw cache."""
    if not isinstance(upgrade, Mapping):
        raise TypeError(f"upgrade must be a dict of per-layer options, got {type(upgrade).__name__}")
    if not upgrade:
        raise ValueError("upgrade must name at least one per-layer option, got an empty dict")
    tiers = [RAW, Tier("base", dict(base))]
    caches = [make_cache(model, tier) for tier in tiers]
    layers = list(caches[1].codec_layers if layers is None else layers)
    tiers += [Tier(f"layer {i}", upgraded(base, upgrade, [i])) for i in layers]
    caches += [make_cache(model, tier) for tier in tiers[2:]]  # builds every recipe first: bad options raise here
    streams = [streaming(model, ids, cache, prefill, chunk) for cache in caches]
    kl = torch.zeros(len(tiers), dtype=torch.float64)
    scored = 0
    for ref in streams[0]:
        scored += ref.logprobs.shape[0] * ref.logprobs.shape[1]
        for i in range(1, len(tiers)):
            with prepared(model, tiers[i]):
                step = next(streams[i])
            kl[i] += token_kl(ref.logprobs, step.logprobs).double().sum()
    kl /= scored
    return LayerGains(copy.deepcopy(dict(base)), copy.deepcopy(dict(upgrade)), float(kl[1]),
                      tuple((layer, float(kl[2 + j])) for j, layer in enumerate(layers)))
