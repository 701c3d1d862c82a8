"""The plugin's configuration, read from the environment (which reaches every vLLM process: engine core, workers).

- ``FLASHCODEC_VLLM_PRESET``: the preset every layer stores (one of :data:`VLLM_PRESETS`); unset or empty: the plugin
  stays off and vLLM runs as without it.
- ``FLASHCODEC_VLLM_LAYER_PRESETS``: per-layer overrides, ``"0=int8,28-29=4bit"`` (layer indices or ranges ``=``
  a preset or ``raw``).
- ``FLASHCODEC_VLLM_SKIP_LAYERS``: layers stored raw (model dtype, no codes), ``"0,1,28-29"``; same as ``=raw``.
- ``FLASHCODEC_VLLM_ANCHORS``: raw rows per page (default: the preset's sinks, 4 for the lossy presets, 0 for int8).

vLLM 0.32 gives every layer one page size (a backend's ``customize_spec`` does not see the layer), so every page is
as large as the largest format in use: overrides to a larger format, and raw layers, cost their size on every layer
(docs/vllm.md has the figures).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..presets import PRESETS
from .page import RAW, PageFormat, page_format

ENV_PRESET = "FLASHCODEC_VLLM_PRESET"
ENV_LAYER_PRESETS = "FLASHCODEC_VLLM_LAYER_PRESETS"
ENV_SKIP = "FLASHCODEC_VLLM_SKIP_LAYERS"
ENV_ANCHORS = "FLASHCODEC_VLLM_ANCHORS"
ENV_NAMES = (ENV_PRESET, ENV_LAYER_PRESETS, ENV_SKIP, ENV_ANCHORS)
# pages hold per-token codes (lossless keeps raw rows): the scalar presets and their trellis twins, which cost less
# quality on the pages at the same bytes (docs/vllm.md, results/vllm_pages_trellis.json)
VLLM_PRESETS = tuple(name for name in PRESETS if name != "lossless")


def _layers(variable: str, text: str) -> list[int]:
    """``"3"`` or ``"2-5"`` -> layer indices."""
    first, sep, last = text.strip().partition("-")
    try:
        lo, hi = int(first), int(last) if sep else int(first)
    except ValueError:
        raise ValueError(f"{variable}: layers must be indices or ranges like 3 or 2-5, got {text!r}") from None
    if lo < 0 or hi < lo:
        raise ValueError(f"{variable}: a layer range needs 0 <= first <= last, got {text!r}")
    return list(range(lo, hi + 1))


def _preset(variable: str, name: str, allowed: tuple[str, ...]) -> str:
    if name not in allowed:
        raise ValueError(f"{variable} must be one of {list(allowed)}, got {name!r}")
    return name


def parse_layer_presets(text: str) -> dict[int, str]:
    """``FLASHCODEC_VLLM_LAYER_PRESETS`` -> ``{layer: preset or "raw"}``."""
    out: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        layers, sep, name = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV_LAYER_PRESETS} entries must be LAYERS=PRESET (e.g. 0=int8,28-29=4bit), got {item!r}")
        preset = _preset(ENV_LAYER_PRESETS, name.strip(), (*VLLM_PRESETS, RAW))
        out.update(dict.fromkeys(_layers(ENV_LAYER_PRESETS, layers), preset))
    return out


def parse_skip_layers(text: str) -> dict[int, str]:
    """``FLASHCODEC_VLLM_SKIP_LAYERS`` -> ``{layer: "raw"}``."""
    return {i: RAW for item in filter(None, (p.strip() for p in text.split(","))) for i in _layers(ENV_SKIP, item)}


@dataclass(frozen=True)
class PluginConfig:
    """``preset`` for every layer, ``layers``: overrides by layer index, ``anchors``: raw rows per page (None: each
    preset's sinks)."""

    preset: str
    layers: Mapping[int, str] = field(default_factory=dict)
    anchors: int | None = None

    def __post_init__(self):
        _preset(ENV_PRESET, self.preset, VLLM_PRESETS)
        for name in self.layers.values():
            _preset(ENV_LAYER_PRESETS, name, (*VLLM_PRESETS, RAW))
        if self.anchors is not None and (isinstance(self.anchors, bool) or not isinstance(self.anchors, int)
                                         or self.anchors < 0):
            raise ValueError(f"{ENV_ANCHORS} must be an int >= 0, got {self.anchors!r}")

    def preset_of(self, layer_idx: int) -> str:
        return self.layers.get(layer_idx, self.preset)

    def layer_format(self, layer_idx: int, head_dim: int, dtype: torch.dtype) -> PageFormat:
        """Layer ``layer_idx``'s page format (ValueError naming ``FLASHCODEC_VLLM_PRESET`` for a head_dim the codes
        cannot hold)."""
        return self._format(self.preset_of(layer_idx), layer_idx, head_dim, dtype)

    def formats(self, head_dim: int, dtype: torch.dtype) -> list[PageFormat]:
        """One format per distinct preset in use, the default's included (with layer 0's seeds: sizes do not depend
        on the seed)."""
        return [self._format(name, 0, head_dim, dtype) for name in sorted({self.preset, *self.layers.values()})]

    def _format(self, name: str, layer_idx: int, head_dim: int, dtype: torch.dtype) -> PageFormat:
        try:
            return page_format(name, layer_idx, head_dim, dtype, self.anchors)
        except ValueError as err:
            raise ValueError(f"{ENV_PRESET}={self.preset} (layer {layer_idx}: {name}) cannot store this model's "
                             f"KV heads (head_dim={head_dim}, dtype={dtype}): {err}") from err

    def state_content_bytes(self, head_dim: int, dtype: torch.dtype, block_size: int) -> int:
        """Bytes per (token, KV head) slot of every page: the largest format's."""
        formats = self.formats(head_dim, dtype)
        for fmt in formats:
            if fmt.raw_rows(block_size) == block_size and not fmt.raw:
                raise ValueError(f"{ENV_ANCHORS}={fmt.anchors} raw rows leave no code slot in a page of "
                                 f"block_size={block_size}: use fewer anchors or a larger --block-size")
        return max(fmt.state_content_bytes(block_size) for fmt in formats)


def config_from_env(environ: Mapping[str, str] | None = None) -> PluginConfig | None:
    """The configuration the environment asks for, or None when ``FLASHCODEC_VLLM_PRESET`` is unset or empty (the
    plugin is off; the other variables must then be unset too)."""
    env = os.environ if environ is None else environ
    preset = env.get(ENV_PRESET, "").strip()
    if not preset:
        stray = [name for name in ENV_NAMES[1:] if env.get(name, "").strip()]
        if stray:
            raise ValueError(f"{', '.join(stray)} set but {ENV_PRESET} is not: set {ENV_PRESET} to one of "
                             f"{list(VLLM_PRESETS)} to turn the plugin on")
        return None
    layers = parse_layer_presets(env.get(ENV_LAYER_PRESETS, ""))
    for i, name in parse_skip_layers(env.get(ENV_SKIP, "")).items():
        if layers.get(i, RAW) != RAW:
            raise ValueError(f"layer {i} is in {ENV_SKIP} and in {ENV_LAYER_PRESETS} (={layers[i]}): pick one")
        layers[i] = name
    anchors_text = env.get(ENV_ANCHORS, "").strip()
    try:
        anchors = int(anchors_text) if anchors_text else None
    except ValueError:
        raise ValueError(f"{ENV_ANCHORS} must be an int >= 0, got {anchors_text!r}") from None
    return PluginConfig(_preset(ENV_PRESET, preset, VLLM_PRESETS), layers, anchors)
