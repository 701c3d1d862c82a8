"""The :class:`~flashcodec_fx.ops.plan.StoredFormPlan` serialized for the C++ kernels: an int64 ``meta`` vector and
fp32 matrices (memoized per spec).

``meta`` is the fields of :data:`META_FIELDS` (by name and in that order), then one record of :data:`ROW_FIELDS`
per stored row of a quantized block and one of :data:`CLASS_FIELDS` per scale class. The C++ side reads them by
name: its ``CodecMeta`` struct and the enums that place each field (and each tensor of :class:`Plan` and of a
stream's state) are generated from these declarations (``layout.py``), so a field added here is one line plus its
use in the kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from ...codecs import jpeg, png
from ..plan import CHANNEL_CODES, TOKEN_CODES, StoredFormPlan, stored_form_plan, tcq_slots

LEVEL_WIDTH = 256  # columns of the per-row level table (8-bit codes at most)
MAX_ROWS = max(jpeg.MAX_BLOCK, png.MAX_BLOCK)  # stored rows of a block, at most (the C++ arrays' size)
QUANT_AXES = {TOKEN_CODES: 1, CHANNEL_CODES: 2}  # the rest: 0

# The head of ``meta``: each field's C++ type (a member of ``CodecMeta``) and its value for a plan and the summation
# width (``sum_width``, the one input that is not the plan's).
META_FIELDS: dict[str, tuple[str, Callable[[StoredFormPlan, int], int]]] = {
    "jpeg": ("bool", lambda p, w: p.jpeg),  # stored rows are DCT coefficients, else png's anchor + deltas
    "r": ("int", lambda p, w: p.block_size),
    "rows": ("int", lambda p, w: p.rows),
    "dense": ("int", lambda p, w: p.dense),
    "blocks": ("int", lambda p, w: p.group_blocks),
    "group": ("int", lambda p, w: p.group),
    "sinks": ("int", lambda p, w: p.sinks),
    "window": ("int", lambda p, w: p.window),
    "tail_cap": ("int", lambda p, w: p.tail),
    "center": ("bool", lambda p, w: p.center),
    "rotate": ("bool", lambda p, w: p.rotate),
    "quant": ("int", lambda p, w: QUANT_AXES.get(p.form, 0)),
    "pruned": ("int", lambda p, w: p.kept),
    "classes": ("int", lambda p, w: p.classes),
    "zero_classes": ("int", lambda p, w: p.zero_classes),
    "head_dim": ("int", lambda p, w: p.head_dim),
    "row_bytes": ("int", lambda p, w: p.row_bytes),
    "search": ("int", lambda p, w: p.search),  # ops.plan SEARCH_NONE / SEARCH_TRIALS / SEARCH_FIT
    "n_shrink": ("int", lambda p, w: len(p.shrink_factors)),
    "n_lloyd": ("int", lambda p, w: len(p.lloyd_factors)),
    "sum_width": ("int", lambda p, w: w),
}
ROW_FIELDS = ("bits", "byte_offset", "row_class")  # per stored row of a quantized block: StoredFormPlan's tuples
CLASS_FIELDS = ("class_levels", "class_zero", "class_first", "class_last")  # per scale class: StoredFormPlan's


class Plan(NamedTuple):
    """What the C++ kernels need of one codec for one head_dim (all on the CPU, contiguous)."""

    meta: torch.Tensor  # int64, see the module docstring
    synth: torch.Tensor  # (r, dense) fp32: a block is synth @ dense rows
    analysis: torch.Tensor  # (rows, r) fp32 jpeg DCT rows kept, (0, r) for png
    levels: torch.Tensor  # (rows, LEVEL_WIDTH) fp32 level value of each code (quantized), else (0, LEVEL_WIDTH)
    rot: torch.Tensor  # (D, D) fp32 rotation, or (0, 0)
    factors: torch.Tensor  # fp32: the trials' clipping factors (shrink, then lloyd), then (a, c) of "fit" per class,
    # then per class the trellis candidates (trellis.FACTOR_SLOTS each, zeros after the last)


def meta(plan: StoredFormPlan, sum_width: int) -> list[int]:
    """The ``meta`` vector of ``plan`` (see the module docstring)."""
    out = [int(value(plan, sum_width)) for _, value in META_FIELDS.values()]
    for fields in (ROW_FIELDS, CLASS_FIELDS):
        for record in zip(*(getattr(plan, name) for name in fields), strict=True):
            out += record
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
                torch.tensor(plan.shrink_factors + plan.lloyd_factors + sum(plan.class_fit, ())
                             + sum((tcq_slots(f) for f in plan.tcq_factors), ()), dtype=torch.float32))
