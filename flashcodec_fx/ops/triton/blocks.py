"""Triton `encode` / `decode`: whole archive groups to and from their stored form, one program per group.

Both are the append's group kernels (``append``) over every group of the input:
``_encode_groups_kernel`` runs :func:`~flashcodec_fx.ops.triton.append.encode_group` on group ``k`` of ``x`` (the
append's work buffer with no old tail: token ``k * G + w`` is row ``w`` of group ``k``), ``_decode_groups_kernel``
writes out :func:`~flashcodec_fx.ops.triton.append.decode_group` (the dequantized rows the append's memo gets). One
launch each, grid ``(NG, B * H, channel chunks)`` from shapes only; the launchers validate with the reference's
checks and allocate, the kernels compute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...codecs import Codec
from ..plan import stored_form_plan
from ..reference.blocks import check_decode_args, check_encode_args
from .append import E_D, E_DC, EncodeTiles, decode_group, encode_fp_fusion, encode_group
from .common import (
    F_GROUP_BLOCKS,
    F_R,
    StreamForm,
    check_group_tokens,
    check_triton_limits,
    grid_rows,
    stream_tables,
)

BIG_TILE = 8192  # values of a program's tile from which it runs 8 warps (else 4)


def block_form(codec: Codec, head_dim: int, mean: torch.Tensor | None) -> tuple[tuple, EncodeTiles]:
    """The kernels' constexpr tuples for ``codec`` at ``head_dim``: its :class:`StreamForm` (centered only with a
    ``mean``, as ``codec.prepare`` / ``restore`` do) and the group tiles."""
    plan = stored_form_plan(codec.spec, head_dim)
    form = StreamForm.of(plan)
    return form._replace(center=form.center and mean is not None).constexpr(), EncodeTiles.of(plan, False)


def warps(rows: int, channels: int) -> int:
    """``num_warps`` of a program whose tile holds ``rows x channels`` values."""
    return 8 if rows * channels >= BIG_TILE else 4


# --- kernels ----------------------------------------------------------------------------------------------------

@triton.jit
def _encode_groups_kernel(x, sx0, sx1, sx2, sx3, data, scale, zero, index, mean, rot, rows_t, levels, analysis,
                          factors, H, NG, F: tl.constexpr, E: tl.constexpr):
    """Program ``(bh, k, chunk)``: channels ``chunk * DC ..`` of tokens ``k * G .. k * G + G - 1`` of ``x`` (strides
    ``sx*``) encoded into archive group ``bh * NG + k``."""
    G: tl.constexpr = F[F_R] * F[F_GROUP_BLOCKS]
    k = tl.program_id(0).to(tl.int64)  # archive groups on the grid's first axis (up to 2**31 - 1 programs)
    bh = tl.program_id(1).to(tl.int64)
    encode_group((data, scale, zero, index, mean), (rot, rows_t, levels, analysis, factors), x, x,
                 (sx0, sx1, sx2, sx3), bh // H, bh % H, bh, k, bh * NG + k, tl.program_id(2) * E[E_DC], 0, 0, NG * G,
                 F, E)


@triton.jit
def _decode_groups_kernel(data, scale, zero, index, mean, out, syn, rot, rows_t, levels, NG, F: tl.constexpr,
                          E: tl.constexpr):
    """Program ``(bh, k, chunk)``: output channels ``chunk * RC ..`` of archive group ``bh * NG + k`` decoded into
    tokens ``k * G ..`` of ``out (B, H, NG * G, D)``."""
    G: tl.constexpr = F[F_R] * F[F_GROUP_BLOCKS]
    D: tl.constexpr = E[E_D]
    k = tl.program_id(0).to(tl.int64)  # archive groups on the grid's first axis (up to 2**31 - 1 programs)
    bh = tl.program_id(1).to(tl.int64)
    rows, w, dc = decode_group((data, scale, zero, index, mean), (syn, rot, rows_t, levels), bh, bh * NG + k,
                               tl.program_id(2), F, E)
    dst = out + ((bh * NG + k) * G + w) * D + dc
    tl.store(dst, rows.to(out.dtype.element_ty), mask=(w < G) & (dc < D))


# --- launchers --------------------------------------------------------------------------------------------------

def nonempty(x: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    """``x``, or ``other`` where ``x`` is empty (never read: any pointer will do)."""
    return other if x is None or x.numel() == 0 else x


def triton_encode(x: torch.Tensor, spec: str, mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                        torch.Tensor, torch.Tensor]:
    """Triton ``flashcodec::encode`` (same contract and validation as
    :func:`~flashcodec_fx.ops.reference.blocks.encode_reference`): ``x (B, H, NG * G, D)`` (any strides) into contiguous
    ``(data, scale, zero, index)``, the append's group encode (stored codes may differ from the reference's by one
    step at an fp32 rounding tie, docs/triton.md)."""
    codec = check_encode_args(x, spec, mean)
    b, h, s, d = x.shape
    check_triton_limits(codec, d)
    check_group_tokens(codec, "encode")
    ng = s // codec.group
    enc = [torch.empty(b, h, ng, *shape, dtype=dtype, device=x.device)
           for shape, dtype in codec.archive_shapes(d, x.dtype).values()]
    if ng == 0 or b * h == 0:
        return tuple(enc)
    form, tiles = block_form(codec, d, mean)
    tab = stream_tables(codec, d, x.device)
    mean_t = None if mean is None else mean.contiguous()
    _encode_groups_kernel[(ng, grid_rows(b * h), tiles.dp // tiles.dc)](
        x, *x.stride(), enc[0], *(nonempty(t, x) for t in (*enc[1:], mean_t)), tab.rotation, tab.rows, tab.levels,
        tab.analysis, tab.factors, h, ng, F=form, E=tiles.constexpr(), num_warps=warps(tiles.gp, tiles.dc),
        enable_fp_fusion=encode_fp_fusion(stored_form_plan(spec, d)))
    return tuple(enc)


def triton_decode(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, index: torch.Tensor, spec: str,
                  dtype: torch.dtype, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``flashcodec::decode`` (same contract and validation as
    :func:`~flashcodec_fx.ops.reference.blocks.decode_reference`): stored groups (any layout: copied when not contiguous) into
    ``(B, H, NG * G, D)`` in ``dtype``, the append's group decode (fp32 products in another order than the
    reference's: within fp32 rounding of it before the cast to ``dtype``)."""
    codec, d = check_decode_args(data, scale, zero, index, spec, dtype, mean)
    b, h, ng = data.shape[:3]
    check_triton_limits(codec, d)
    check_group_tokens(codec, "decode")
    out = torch.empty(b, h, ng * codec.group, d, dtype=dtype, device=data.device)
    if ng == 0 or b * h == 0:
        return out
    form, tiles = block_form(codec, d, mean)
    tab = stream_tables(codec, d, data.device)
    data = data.contiguous()
    stored = (nonempty(t, data).contiguous() for t in (scale, zero, index, mean))
    _decode_groups_kernel[(ng, grid_rows(b * h), tiles.dp // tiles.rc)](
        data, *stored, out, tab.synthesis, tab.rotation, tab.rows, tab.levels, ng, F=form, E=tiles.constexpr(),
        num_warps=warps(tiles.gp, tiles.rc))
    return out

