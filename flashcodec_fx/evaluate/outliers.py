"""Outlier channels made without changing a model's function: a few key channels ``factor`` times larger (their query
channels ``factor`` times smaller) and a few value channels ``factor`` times larger (the output projection's inputs
``factor`` times smaller), as models such as Qwen2 carry them. Attention scores and outputs are unchanged up to
rounding; only what the cache stores changes.
"""

from __future__ import annotations

from typing import Any

import torch

KEY_CHANNELS = (3, 17)  # with their rotary partners (c + D/2): RoPE mixes the pair, so both scale together
VALUE_CHANNELS = (5, 40)


def _attention_modules(model: Any) -> list[Any]:
    mods = [m for m in model.modules() if all(hasattr(m, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))]
    if not mods:
        raise ValueError("model must have attention modules with q_proj, k_proj, v_proj and o_proj (Llama family)")
    for m in mods:
        if hasattr(m, "q_norm") or hasattr(m, "k_norm"):
            raise ValueError("models with q_norm / k_norm (Gemma 3, Qwen3) normalize the scaled channels away: "
                             "use a Llama-family model")
    return mods


@torch.no_grad()
def add_outlier_channels(model: Any, factor: float = 16.0, key_channels: tuple[int, ...] = KEY_CHANNELS,
                         value_channels: tuple[int, ...] = VALUE_CHANNELS) -> Any:
    """Scale, in every layer and KV head of ``model`` (in place; returns it), keys' channels ``key_channels`` (and
    their rotary partners ``c + D/2``) and values' ``value_channels`` by ``factor``, and the matching query channels
    and ``o_proj`` input columns by ``1 / factor``: the model computes the same function."""
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
        raise ValueError(f"factor must be a positive number, got {factor!r}")
    config = model.config.get_text_config(decoder=True)
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hkv, groups = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    for name, channels in (("key_channels", key_channels), ("value_channels", value_channels)):
        if any(not 0 <= c < (d // 2 if name == "key_channels" else d) for c in channels):
            raise ValueError(f"{name} must lie in [0, {d // 2 if name == 'key_channels' else d}), got {channels}")
    keys = [c + half for c in key_channels for half in (0, d // 2)]
    for m in _attention_modules(model):
        for h in range(hkv):
            k_rows = [h * d + c for c in keys]
            v_rows = [h * d + c for c in value_channels]
            q_rows = [(h * groups + g) * d + c for g in range(groups) for c in keys]
            o_cols = [(h * groups + g) * d + c for g in range(groups) for c in value_channels]
            _scale_rows(m.k_proj, k_rows, factor)
            _scale_rows(m.q_proj, q_rows, 1 / factor)
            _scale_rows(m.v_proj, v_rows, factor)
            m.o_proj.weight[:, o_cols] /= factor
    return model


def _scale_rows(linear: Any, rows: list[int], factor: float) -> None:
    linear.weight[rows] *= factor
    if getattr(linear, "bias", None) is not None:
        linear.bias[rows] *= factor
