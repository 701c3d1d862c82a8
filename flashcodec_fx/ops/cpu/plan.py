"""A codec as the flat tables the C++ kernels read: an int64 ``meta`` vector and fp32 matrices (memoized per spec).

``meta`` starts with the fields of :data:`META_FIELDS`, then 4 entries per stored row (bits, byte offset inside a
block's packed codes, scale class, 0) and 4 per scale class (level set, zero slot, first row, last row). The order
is the contract with ``common.h`` (``Codec::parse``); keep both in sync.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ...codecs import Codec, JPEGCodec, codec_from_spec
from ...codecs.levels import LEVELS
from ...codecs.quant import LLOYD_FACTORS, SHRINK_FACTORS

META_FIELDS = ("mode", "r", "rows", "dense", "blocks", "group", "sinks", "window", "tail_cap", "center", "rotate",
               "quant", "pruned", "classes", "zero_classes", "cumsum", "head_dim", "row_bytes", "search",
               "n_shrink", "n_lloyd", "sum_width")
ROW_FIELDS = 4
CLASS_FIELDS = 4
LEVEL_WIDTH = 256  # columns of the per-row level table (8-bit codes at most)
QUANT_AXES = {None: 0, "token": 1, "channel": 2}


class Plan(NamedTuple):
    """What the C++ kernels need of one codec for one head_dim (all on the CPU, contiguous)."""

    meta: torch.Tensor  # int64, see the module docstring
    synth: torch.Tensor  # (r, dense) fp32: a block is synth @ dense rows
    analysis: torch.Tensor  # (rows, r) fp32 jpeg DCT rows kept, (0, r) for png
    levels: torch.Tensor  # (rows, 256) fp32 level value of each code (quantized), else (0, 256)
    rot: torch.Tensor  # (D, D) fp32 rotation, or (0, 0)
    factors: torch.Tensor  # fp32 clipping factors of the scale search: shrink then lloyd


def _meta(codec: Codec, head_dim: int, sum_width: int) -> list[int]:
    q = codec.quantizer
    fields = {
        "mode": int(not isinstance(codec, JPEGCodec)), "r": codec.block_size, "rows": codec.rows, "dense": codec.dense_rows,
        "blocks": codec.blocks, "group": codec.group, "sinks": codec.sinks, "window": codec.window,
        "tail_cap": codec.tail_capacity, "center": int(codec.center), "rotate": int(codec.rotate is not None),
        "quant": QUANT_AXES[None if q is None else q.axis], "pruned": codec.index_rows,
        "classes": 0 if q is None else len(q.classes), "zero_classes": 0 if q is None else q.zero_classes,
        "cumsum": int(not isinstance(codec, JPEGCodec)), "head_dim": head_dim,
        "row_bytes": 0 if q is None else q.row_bytes(head_dim), "search": int(q is not None and q.search),
        "n_shrink": len(SHRINK_FACTORS), "n_lloyd": len(LLOYD_FACTORS), "sum_width": sum_width,
    }
    meta = [fields[name] for name in META_FIELDS]
    if q is None:
        return meta
    for j, bits in enumerate(q.bits):
        meta += [bits, q.row_offsets[j] * head_dim // 8, q.row_class[j], 0]
    for c, rows in enumerate(q.classes):
        meta += [LEVELS.index(q.levels[c]), q.zero_slot[c], rows[0], rows[-1]]
    return meta


@functools.lru_cache(maxsize=256)
def codec_plan(spec: str, head_dim: int, sum_width: int = 8) -> Plan:
    """The :class:`Plan` of the codec ``spec`` for vectors of ``head_dim`` channels; ``sum_width``: the vector width
    of torch's sum kernel, whose summation order the encoder follows (``launch.sum_width``)."""
    codec = codec_from_spec(spec)
    q = codec.quantizer
    if isinstance(codec, JPEGCodec):
        analysis = codec.analysis()
    else:
        analysis = torch.zeros(0, codec.block_size)
    levels = torch.zeros(0, LEVEL_WIDTH)
    if q is not None:
        levels = torch.zeros(codec.rows, LEVEL_WIDTH)
        table = q.level_rows()
        levels[:, : table.shape[1]] = table
    rot = codec.rotation(head_dim)
    return Plan(torch.tensor(_meta(codec, head_dim, sum_width), dtype=torch.int64), codec.synthesis().contiguous(),
                analysis.contiguous(), levels.contiguous(),
                torch.zeros(0, 0) if rot is None else rot.contiguous(),
                torch.tensor(SHRINK_FACTORS + LLOYD_FACTORS, dtype=torch.float32))
