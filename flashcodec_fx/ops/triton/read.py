"""Triton `read`: the view attention reads, in one launch (``ops/reference/read.py``: sinks raw, archive decoded, tail raw, the
call's new tokens overlaid, zeros past the length).

Program ``(bh, k, chunk)``, output channels ``chunk * RC ..``: for ``k < NG`` the positions ``sinks + k * G ..`` of
archive group ``k``, decoded (:func:`~flashcodec_fx.ops.triton.append.decode_group`) when the group starts before
the archive's end (``start``, read on the device), else zeros; for ``k == NG`` (launched when there are sinks) the
sink rows. Each program then applies the reference's overrides to its rows (:func:`_assemble`). The grid depends on
shapes only: no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.normalize import from_stored, to_stored
from ..reference.read import check_read_args
from ..state import StreamState, capacity, stream_dtype
from .append import E_D, E_GP, E_RC, decode_group
from .blocks import block_form, nonempty, warps
from .common import (
    F_GROUP_BLOCKS,
    F_R,
    F_SINKS,
    F_TAIL,
    check_group_tokens,
    check_triton_limits,
    grid_rows,
    stream_tables,
)

SINK_ROWS: tl.constexpr = tl.constexpr(16)  # sink rows per step of the sinks program's loop


@triton.jit
def _assemble(view, x, pos, dc, ok, tail, new, NS, b, h, bh, start, length, T, CAP, F: tl.constexpr,
              D: tl.constexpr):
    """Store rows ``x`` (the view's dtype) at positions ``pos`` / channels ``dc`` of head ``bh``'s view (``CAP``
    positions) where ``ok``, with the reference's overrides: tail row ``pos - start`` where ``start <= pos <
    length``, new token ``pos - (length - T)`` where it exists (strides ``NS``), zeros from ``length``. Raw rows are
    copied in their dtype, never through fp32."""
    TAIL: tl.constexpr = F[F_TAIL]
    sn0, sn1, sn2, sn3 = NS
    in_tail = ok & (pos >= start) & (pos < length)
    row = tl.minimum(tl.maximum(pos - start, 0), TAIL - 1)
    x = tl.where(in_tail, tl.load(tail + (bh * TAIL + row) * D + dc, mask=in_tail, other=0.0), x)
    token = pos - (length - T)
    fresh = ok & (token >= 0) & (token < T)
    x = tl.where(fresh, tl.load(new + b * sn0 + h * sn1 + token * sn2 + dc * sn3, mask=fresh, other=0.0), x)
    tl.store(view + (bh * CAP + pos) * D + dc, tl.where(pos < length, x, tl.zeros_like(x)), mask=ok)


@triton.jit
def _read_kernel(data, scale, zero, index, mean, sink, tail, len_ptr, start_ptr, new, sn0, sn1, sn2, sn3, view,
                 syn, rot, rows_t, levels, H, NG, T, F: tl.constexpr, E: tl.constexpr):
    """Program ``(bh, k, chunk)``: the view's positions of archive group ``k < NG``, or the sinks (``k == NG``),
    channels ``chunk * RC ..``. Per stream: the state tensors' pointers but ``norm`` (``from_stored`` applies it), the
    new tokens and their strides (``T`` of them), the view, the tables (synthesis, rotation, rows, levels)."""
    G: tl.constexpr = F[F_R] * F[F_GROUP_BLOCKS]
    SINKS: tl.constexpr = F[F_SINKS]
    D: tl.constexpr = E[E_D]
    GP: tl.constexpr = E[E_GP]
    RC: tl.constexpr = E[E_RC]
    k = tl.program_id(0).to(tl.int64)  # archive groups on the grid's first axis (up to 2**31 - 1 programs)
    bh = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    b = bh // H
    h = bh % H
    length = tl.load(len_ptr)
    start = tl.load(start_ptr)
    NS = (sn0, sn1, sn2, sn3)
    cap = SINKS + NG * G
    out_t = view.dtype.element_ty
    if k < NG:
        pos0 = SINKS + k * G
        if pos0 < start:
            rows, w, dc = decode_group((data, scale, zero, index, mean), (syn, rot, rows_t, levels), bh, bh * NG + k,
                                       chunk, F, E)
            _assemble(view, rows.to(out_t), pos0 + w, dc, (w < G) & (dc < D), tail, new, NS, b, h, bh, start, length,
                      T, cap, F, D)
        else:  # (names apart from the other branch's: a name both branches define must keep its type)
            wz = tl.arange(0, GP)[:, None]
            dz = chunk * RC + tl.arange(0, RC)[None, :]
            _assemble(view, tl.zeros((GP, RC), out_t), pos0 + wz, dz, (wz < G) & (dz < D), tail, new, NS, b, h, bh,
                      start, length, T, cap, F, D)
    else:
        ds = chunk * RC + tl.arange(0, RC)[None, :]
        for s0 in tl.static_range(0, SINKS, SINK_ROWS):
            s = s0 + tl.arange(0, SINK_ROWS)[:, None]
            ok = (s < SINKS) & (ds < D)
            x = tl.load(sink + (bh * SINKS + s) * D + ds, mask=ok, other=0.0)
            _assemble(view, x, s, ds, ok, tail, new, NS, b, h, bh, start, length, T, cap, F, D)


def triton_read(state: list[torch.Tensor], spec: str, new: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``flashcodec::read`` (same contract and validation as :func:`~flashcodec_fx.ops.reference.read.read_reference`):
    ``(B, H, capacity, D)`` in the stream dtype; ``new (B, H, T, D)`` any strides, state tensors any layout (copied
    when not contiguous). Raw rows are exact; decoded groups within fp32 rounding of the reference's before the cast
    to the stream dtype. One launch, no host sync."""
    codec, st = check_read_args(state, spec, new)
    b, h, _, d = st.tail.shape
    check_triton_limits(codec, d)
    check_group_tokens(codec, "read")
    ng = st.data.shape[2]
    cap = capacity(codec, st)
    view = torch.empty(b, h, cap, d, dtype=stream_dtype(codec, st.tail), device=st.tail.device)
    if cap == 0 or b * h == 0:
        return view
    form, tiles = block_form(codec, d, st.mean)
    tab = stream_tables(codec, d, st.tail.device)
    ct = StreamState(*(nonempty(t, st.tail).contiguous() for t in st))  # empty ones: never read
    new = to_stored(codec, st, new)
    new_t = st.tail if new is None else new
    strides = (0, 0, 0, 0) if new is None else new.stride()
    _read_kernel[(ng + (1 if codec.sinks else 0), grid_rows(b * h), tiles.dp // tiles.rc)](
        ct.data, ct.scale, ct.zero, ct.index, ct.mean, ct.sink, ct.tail, st.length, st.start, new_t, *strides, view,
        tab.synthesis, tab.rotation, tab.rows, tab.levels, h, ng, 0 if new is None else new.shape[2], F=form,
        E=tiles.constexpr(), num_warps=warps(tiles.gp, tiles.rc))
    return from_stored(codec, st, view)
