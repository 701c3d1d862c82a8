"""Named presets, the way a serving stack picks a ``kv_cache_dtype``: a name -> a :class:`~flashcodec_fx.config.
CacheConfig` (``PRESETS``), written as the keyword options it is built from (``RECIPES``).

``FlashCodecCache.from_config(config, preset="3bit")``, ``apply_flash_codec(model, preset="3bit")``; options given
next to a preset override it (the rule of :mod:`flashcodec_fx.config`). The bits in a name are the target; what each
preset stores, measured on real models, is in the README (``benchmarks/bench_ppl.py``).

Recipes (docs/quantization.md; chosen by ``benchmarks/bench_ppl.py`` measurements on SmolLM2-135M, fp32, the
streaming protocol): every lossy preset quantizes per token after a random-sign Walsh-Hadamard rotation along
head_dim (one fp16 scale per token and head; the rotation is what makes one scale per vector work), on Lloyd-Max
levels of a Gaussian with the "fit" clipping (a closed-form start, then the least-squares scale of the codes, twice:
as good as the seven-trial search and cheaper, measured per preset in ``benchmarks/bench_clipping.py``); keys are
centered first (a per-channel mean of the prompt: keys carry large channel offsets; values do not, and centering them
measured worse). Both streams are normalized
(``normalize=True``: a channel more than twice as wide as the median channel on the prompt is stored divided by a
power of two, so outlier channels such as Qwen2's do not set every channel's step after the rotation; a model
without them stores what it stored before). The first ``SINKS`` tokens and the newest keys (``window``) stay raw:
raw recent keys halve the KL at 3 bits. Every lossy preset stores at most its name in bits per value from 897 tokens
on (``4bit``: 4.25, its 4-bit codes' scale included; issue 20), the raw sinks, windows, mean and channel exponents
counted (shorter caches store more: they are a fixed cost). Among recipes within that budget they were chosen by KL
both on the streaming protocol and token by token (decode, where even the newest values are read from their codes,
so a few raw values pay; docs/quantization.md): ``4bit`` 4-bit keys (newest 28 raw) and 3-bit values (newest 32
raw), 4.18 bits/value at 1024 tokens (4.24 worst); ``3bit`` 3-bit keys (newest 18 raw), 2-bit values (newest 4 raw),
2.96 (2.99); ``2.5bit`` 2-bit keys (newest 17 raw), 2-bit values (newest 4 raw), 2.47 (2.50); ``2bit`` 2-bit keys
(newest 12 raw) and 1-bit values (sign times the least-squares scale, newest 8 raw), 1.97 (2.00). ``int8``: both
streams 8-bit mid-rise after the rotation, no raw tokens (8.25 bits/value at head_dim 64). ``lossless``: every token
kept as given (per-token jpeg groups, no transform, no quantization: what a raw cache stores, 16 bits/value in
bf16); attention reads it through the model's own implementation, so its tokens equal an uncompressed run's, and
every crop is exact. ``4bit-tcq``, ``3bit-tcq``, ``2.5bit-tcq``, ``2bit-tcq`` (``TRELLIS_PRESETS``, issue 42): the four
lossy recipes with trellis codes (``levels="tcq"``) in both streams, the same bits as stored and 0.67-0.74x the KL on
the streaming protocol (docs/quantization.md "Trellis presets").
"""

from __future__ import annotations

import copy
from typing import Any

from .codecs import Codec
from .config import CacheConfig, cache_config

SINKS = 4


def _rotated(bits: int, window: int, center: bool, levels: str = "lloyd") -> dict[str, Any]:
    """Per-token ``bits``-bit codes (``levels``: Lloyd-Max, or trellis codes over the same bits) after the rotation,
    ``SINKS`` raw sinks and ``window`` raw newest."""
    return {"mode": "jpeg", "block_size": 1, "quant_bits": bits, "levels": levels, "rotate": True, "center": center,
            "normalize": True, "scale_search": "fit", "sinks": SINKS, "window": window}


def _preset(key_bits: int, key_window: int, value_bits: int, value_window: int, levels: str = "lloyd") -> dict[str, Any]:
    return {"key_options": _rotated(key_bits, key_window, center=True, levels=levels),
            "value_options": _rotated(value_bits, value_window, center=False, levels=levels)}


def _trellis(name: str) -> dict[str, Any]:
    """Scalar preset ``name``'s recipe with trellis codes in both streams (``levels="tcq"``): the same bits stored."""
    recipe = copy.deepcopy(RECIPES[name])
    for stream in ("key_options", "value_options"):
        recipe[stream]["levels"] = "tcq"
    return recipe


_INT8 = {"mode": "jpeg", "block_size": 1, "quant_bits": 8, "levels": "midrise", "rotate": True}

RECIPES: dict[str, dict[str, Any]] = {
    "lossless": {"mode": "jpeg", "block_size": 1, "quant_bits": None},
    "int8": {"key_options": dict(_INT8), "value_options": dict(_INT8)},
    "4bit": _preset(4, 28, 3, 32),
    "3bit": _preset(3, 18, 2, 4),
    "2.5bit": _preset(2, 17, 2, 4),
    "2bit": _preset(2, 12, 1, 8),
}
SCALAR_PRESETS = ("4bit", "3bit", "2.5bit", "2bit")
"""The lossy presets on scalar (Lloyd-Max) codes; each has a trellis twin ``NAME-tcq`` (``TRELLIS_PRESETS``)."""
TRELLIS_PRESETS = tuple(f"{name}-tcq" for name in SCALAR_PRESETS)
"""Trellis twins (issue 42): a scalar preset's recipe with ``levels="tcq"`` in both streams, so the same bits as
stored and 0.67-0.74x its KL on bench_ppl's streaming protocol (docs/quantization.md), for a Viterbi encode (about 2x
the scalar codes' on CPU; Triton's encoder is unmeasured on a GPU); vLLM's pages hold them too, in the scalar
preset's bytes (``vllm.VLLM_PRESETS``; docs/vllm.md measures them there)."""
RECIPES.update({f"{name}-tcq": _trellis(name) for name in SCALAR_PRESETS})
DEFAULT_PRESET = "int8"
PRESETS: dict[str, CacheConfig] = {name: cache_config(**recipe) for name, recipe in RECIPES.items()}


def preset_config(name: str) -> CacheConfig:
    """Preset ``name``'s configuration (TypeError / ValueError naming the presets for anything else)."""
    if not isinstance(name, str):
        raise TypeError(f"preset must be a preset name (str), got {type(name).__name__}")
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]


def preset_options(name: str) -> dict[str, Any]:
    """A copy of the keyword options preset ``name`` is built from (``RECIPES``), e.g. for benchmark tier files."""
    preset_config(name)
    return copy.deepcopy(RECIPES[name])


def preset_codecs(name: str, layer_idx: int = 0) -> tuple[Codec, Codec]:
    """``(key codec, value codec)`` of preset ``name`` as layer ``layer_idx`` gets them (``rotate=True`` seeds
    ``layer_idx``); no transformers import (serving hosts, the Triton tests and benchmarks use it)."""
    return preset_config(name).layers.build(layer_idx)
