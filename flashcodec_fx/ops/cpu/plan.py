"""The :class:`~flashcodec_fx.ops.plan.StoredFormPlan` serialized for the C++ kernels: an int64 ``meta`` vector and
fp32 matrices (memoized per spec).

``meta`` starts with the fields of :data:`META_FIELDS`, then 4 entries per stored row (bits, byte offset inside a
block's packed codes, scale class, 0) and 4 per scale class (level set, zero slot, first row, last row). The order
is the contract with ``common.h`` (``Codec::parse``); keep both in sync.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..plan import CHANNEL_CODES, TOKEN_CODES, StoredFormPlan, stored_form_plan

META_FIELDS = ("mode", "r", "rows", "dense", "blocks", "group", "sinks", "window", "tail_cap", "center", "rotate",
               "quant", "pruned", "classes", "zero_classes", "cumsum", "head_dim", "row_bytes", "search",
               "n_shrink", "n_lloyd", "sum_width")
LEVEL_WIDTH = 256  # columns of the per-row level table (8-bit codes at most)
QUANT_AXES = {TOKEN_CODES: 1, CHANNEL_CODES: 2}  # the rest: 0


class Plan(NamedTuple):
    """What the C++ kernels need of one codec for one head_dim (all on the CPU, contiguous)."""

    meta: torch.Tensor  # int64, see the module docstring
    synth: torch.Tensor  # (r, dense) fp32: a block is synth @ dense rows
    analysis: torch.Tensor  # (rows, r) fp32 jpeg DCT rows kept, (0, r) for png
    levels: torch.Tensor  # (rows, 256) fp32 level value of each code (quantized), else (0, 256)
    rot: torch.Tensor  # (D, D) fp32 rotation, or (0, 0)
    factors: torch.Tensor  # fp32 clipping factors of the scale search: shrink then lloyd


def meta(plan: StoredFormPlan, sum_width: int) -> list[int]:
    """The ``meta`` vector of ``plan`` (see the module docstring)."""
    fields = {
        "mode": int(not plan.jpeg), "r": plan.block_size, "rows": plan.rows, "dense": plan.dense,
        "blocks": plan.group_blocks, "group": plan.group, "sinks": plan.sinks, "window": plan.window,
        "tail_cap": plan.tail, "center": int(plan.center), "rotate": int(plan.rotate),
        "quant": QUANT_AXES.get(plan.form, 0), "pruned": plan.kept, "classes": plan.classes,
        "zero_classes": plan.zero_classes, "cumsum": int(not plan.jpeg), "head_dim": plan.head_dim,
        "row_bytes": plan.row_bytes, "search": int(plan.search), "n_shrink": len(plan.shrink_factors),
        "n_lloyd": len(plan.lloyd_factors), "sum_width": sum_width,
    }
    out = [fields[name] for name in META_FIELDS]
    for row in zip(plan.bits, plan.byte_offset, plan.row_class, strict=True):
        out += [*row, 0]
    for cls in zip(plan.class_levels, plan.class_zero, plan.class_first, plan.class_last, strict=True):
        out += cls
    return out


@functools.lru_cache(maxsize=256)
def codec_plan(spec: str, head_dim: int, sum_width: int = 8) -> Plan:
    """The :class:`Plan` of the codec ``spec`` for vectors of ``head_dim`` channels; ``sum_width``: the vector width
    of torch's sum kernel, whose summation order the encoder follows (``launch.sum_width``)."""
    plan = stored_form_plan(spec, head_dim)
    levels = torch.zeros(plan.rows if plan.levels is not None else 0, LEVEL_WIDTH)
    if plan.levels is not None:
        levels[:, : plan.level_width] = plan.levels
    return Plan(torch.tensor(meta(plan, sum_width), dtype=torch.int64), plan.synthesis,
                torch.zeros(0, plan.block_size) if plan.analysis is None else plan.analysis, levels,
                torch.zeros(0, 0) if plan.rotation is None else plan.rotation,
                torch.tensor(plan.shrink_factors + plan.lloyd_factors, dtype=torch.float32))
