"""Triton `codec_attention`: flash-decoding split-K attention on the stored state, plus the combine kernel.

Positions are visited in *tiles* of ``BP`` positions aligned to the key stream's blocks (``BP`` a multiple of both
streams' block sizes, so the value stream's blocks sit at a constant offset inside every tile). For each tile:

- key scores: archived keys in the coefficient domain, ``C = q_k @ S_k^T`` (``q_k``: q rotated once per program when
  the keys are rotated; packed codes enter the dot as integers, their scales after it: token axis per column of
  ``C``, channel axis folded into ``q_k`` once per tile, which lies inside one scale group), expanded to positions
  through the block-diagonal synthesis matrix, plus ``q . mean_k``; raw keys (sinks, tail, the call's new tokens)
  as ``q @ k^T``;
- scale, the variants' softcap and ALiBi bias (``SOFTCAP`` / ``ALIBI``), mask, online softmax (base 2);
- values: archived ones as ``(P @ blockdiag(A_v)) * scales @ S_v`` (token-axis scales folded into the
  probabilities, channel-axis scales applied to the output columns: codes enter the dot exactly), accumulated in
  the values' rotated space together with raw values rotated into it and ``mass * mean_v``; the combine kernel
  rotates the merged output back once.

Split kernel, one program per (batch, kv head, row chunk, split): the ``G * T`` query rows of one kv head are
processed together (GQA), so each stored row is read once per kv head. Splits ``0 .. NUM_SPLITS - 1`` deal the
*main region* (positions archived in both streams) in equal runs of tiles, from the device lengths; the extra split
``NUM_SPLITS`` attends the *edge* (sinks, the region where one stream is archived and the other raw, the tails and
the new tokens: bounded by sinks + window + group + T). Each split writes its normalized partial output and
log-sum-exp; the combine kernel merges them, with the per-head sink logits in each row's max and denominator
(``SINKS``). The launch depends on shapes only (CUDA-graph safe). Each variant is a constexpr flag, and its
arguments are None without it, so a call without variants compiles to the kernels it compiled to before they existed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..plan import CHANNEL_CODES, FLOAT_ROWS, PRUNED_ROWS, TOKEN_CODES, stored_form_plan
from ..reference.attention import check_attention_args
from ..reference.normalize import attention_inputs, attention_output
from ..state import StreamState, spec_codec
from .common import (
    F_CENTER,
    F_CLASSES,
    F_DENSE,
    F_DENSE_P,
    F_FOLD,
    F_FORM,
    F_GROUP_BLOCKS,
    F_OFFSET,
    F_R,
    F_ROTATE,
    F_ROWS,
    F_SINKS,
    F_TAIL,
    F_ZEROS,
    MAX_TILE_POSITIONS,
    ROW_ZERO_SLOT,
    StreamForm,
    TupleFields,
    check_triton_limits,
    fdiv,
    float_rows,
    io_dtype,
    level_values,
    mdot,
    pow2,
    require_contiguous,
    row_info,
    stream_tables,
    trellis_index,
    unpack_codes,
)

LOG2E = 1.4426950408889634
_LOG2E: tl.constexpr = tl.constexpr(LOG2E)
_MAX_ROWS = 64  # query rows (G * T) per program; more rows get more programs
_TARGET_POSITIONS = 64  # positions per tile the plan aims at
EDGE_WARPS = 4  # the edge launch's small tiles
NUM_STAGES = 1  # software pipelining of the tile loop (2 doubles the shared memory: see docs/triton.md)
NO_MASK, BOOL_MASK, ADDITIVE_MASK = 0, 1, 2  # MASK_KIND
_NO_MASK: tl.constexpr = tl.constexpr(NO_MASK)
_BOOL_MASK: tl.constexpr = tl.constexpr(BOOL_MASK)
_FLOAT_ROWS: tl.constexpr = tl.constexpr(FLOAT_ROWS)
_PRUNED_ROWS: tl.constexpr = tl.constexpr(PRUNED_ROWS)
_TOKEN_CODES: tl.constexpr = tl.constexpr(TOKEN_CODES)
# The fields of the split kernel's shape tuple (:class:`AttentionTiles`), in tuple order (kernels: ``TL[T_D]``):
_TILES = TupleFields("AttentionTiles")
T_D = _TILES("head_dim")
T_DP = _TILES("dp")  # head_dim's tile
T_BP = _TILES("positions")  # positions per tile
T_BPP = _TILES("positions_p")  # their power-of-two tile
T_NKB = _TILES("key_blocks")  # key block slots per tile
T_NVB = _TILES("value_blocks")  # value block slots per tile
T_BLOCK_M = _TILES("block_m")  # query rows per program
T_RC = _TILES("rc")  # the column chunk of the rotations
T_A0 = _TILES("a0")  # the first position both streams archive
# The fields of one stream's tuple of kernel arguments (pointers), in tuple order (kernels: ``K[S_MEAN]``): the
# state's tensors the kernels read through pointers (StreamState's names: all but length and start, passed apart,
# and norm, applied by the launcher), the call's new tokens, the stream's tables (StreamTables' names).
_STREAM = TupleFields("StreamArgs")
S_DATA = _STREAM("data")
S_SCALE = _STREAM("scale")
S_ZERO = _STREAM("zero")
S_INDEX = _STREAM("index")
S_MEAN = _STREAM("mean")
S_SINK = _STREAM("sink")
S_TAIL = _STREAM("tail")
S_NEW = _STREAM("new")
S_SYNTHESIS = _STREAM("synthesis")
S_ROTATION = _STREAM("rotation")
S_ROWS = _STREAM("rows")
S_LEVELS = _STREAM("levels")


# --- one stream's pieces ----------------------------------------------------------------------------------------

@triton.jit
def _arch_rows_t(S, F: tl.constexpr, TL: tl.constexpr, bh, blk0, NB, KA_T: tl.constexpr, PREC: tl.constexpr,
                 q_k, qsum):
    """Key coefficients ``q_k . S[blk, j]`` of one tile, ``(BLOCK_M, NKB * DENSE_P)``, column ``n * DENSE_P + j`` for
    block ``blk0 + n`` (scales, level offsets and zero points applied)."""
    data, scale, zero, index = S[S_DATA], S[S_SCALE], S[S_ZERO], S[S_INDEX]
    rows, levels = S[S_ROWS], S[S_LEVELS]
    FORM: tl.constexpr = F[F_FORM]
    R: tl.constexpr = F[F_R]
    K: tl.constexpr = F[F_ROWS]
    DENSE: tl.constexpr = F[F_DENSE]
    DKP: tl.constexpr = F[F_DENSE_P]
    GB: tl.constexpr = F[F_GROUP_BLOCKS]
    C: tl.constexpr = F[F_CLASSES]
    Z: tl.constexpr = F[F_ZEROS]
    FOLD: tl.constexpr = F[F_FOLD]
    D: tl.constexpr = TL[T_D]
    DP: tl.constexpr = TL[T_DP]
    NKB: tl.constexpr = TL[T_NKB]
    BN: tl.constexpr = TL[T_BP] // R
    c = tl.arange(0, NKB * DKP)
    n = c // DKP
    j = c % DKP
    blk = blk0 + n
    col_ok = (n < BN) & (j < DENSE) & (blk >= 0) & (blk < NB)
    lin = bh * NB + blk
    dd = tl.arange(0, DP)
    if FORM == _FLOAT_ROWS or FORM == _PRUNED_ROWS:
        st = float_rows(data, index, lin[None, :], j[None, :], dd[:, None], col_ok[None, :], F, D)
        coef = mdot(q_k, st, KA_T, PREC)
    else:
        bits, bit_off, cls, zslot, lloyd, off = row_info(rows, levels, j, col_ok, F)
        ok = col_ok[None, :] & (dd[:, None] < D)
        codes = unpack_codes(data, lin[None, :], dd[:, None], ok, bits[None, :], bit_off[None, :], F, D)
        codes = trellis_index(codes, data, rows, lin[None, :], j[None, :], dd[:, None], ok, bits[None, :],
                              bit_off[None, :], F, D)
        vals = level_values(codes, j[None, :], lloyd[None, :], levels, ok, F)
        if FORM == _TOKEN_CODES:
            s = tl.load(scale + lin * C + cls, mask=col_ok, other=0.0).to(tl.float32)
            coef = s[None, :] * (mdot(q_k, vals, KA_T, PREC) + off[None, :] * qsum[:, None])
            if Z > 0:
                z = tl.load(zero + lin * Z + zslot, mask=col_ok & (zslot >= 0), other=0.0).to(tl.float32)
                coef += z[None, :] * qsum[:, None]
        elif FOLD:
            # the tile lies inside one scale group: fold its per-channel scales into q once per class
            NG = NB // GB
            grp = fdiv(blk0, GB) + tl.zeros_like(dd)  # (a vector: the interpreter mis-types scalar & vector masks)
            g_ok = (dd < D) & (grp >= 0) & (grp < NG)
            base = bh * NG + grp
            coef = tl.zeros((q_k.shape[0], NKB * DKP), tl.float32)
            for k in tl.static_range(C):
                q_c = q_k * tl.load(scale + (base * C + k) * D + dd, mask=g_ok, other=0.0).to(tl.float32)[None, :]
                part = mdot(q_c, vals, KA_T, PREC) + off[None, :] * tl.sum(q_c, 1)[:, None]
                if Z > 0:
                    slot = tl.load(rows + ROW_ZERO_SLOT * K + k + tl.zeros_like(dd))  # class k's zero slot: row k's
                    z = tl.load(zero + (base * Z + slot) * D + dd, mask=g_ok & (slot >= 0), other=0.0).to(tl.float32)
                    part += tl.sum(q_k * z[None, :], 1)[:, None]
                coef = tl.where((cls == k)[None, :], part, coef)
        else:
            # scales vary inside the tile: dequantize in registers (fp32 dot)
            base = bh * (NB // GB) + fdiv(blk, GB)
            s = tl.load(scale + ((base * C + cls) * D)[None, :] + dd[:, None], mask=ok, other=0.0).to(tl.float32)
            st = (vals + off[None, :]) * s
            if Z > 0:
                st += tl.load(zero + ((base * Z + zslot) * D)[None, :] + dd[:, None], mask=ok & (zslot >= 0)[None, :],
                              other=0.0).to(tl.float32)
            coef = mdot(q_k, st, tl.float32, PREC)
    return coef


@triton.jit
def _arch_values(S, F: tl.constexpr, TL: tl.constexpr, bh, blk0, NB, VA_T: tl.constexpr, PREC: tl.constexpr, pc):
    """``sum_(n, j) pc[:, (n, j)] * S[blk0 + n, j, :]`` ``(BLOCK_M, DP)`` for the value blocks of one tile; ``pc``
    ``(BLOCK_M, NVB * DENSE_P)``: the probabilities folded through the synthesis matrix."""
    data, scale, zero, index = S[S_DATA], S[S_SCALE], S[S_ZERO], S[S_INDEX]
    rows, levels = S[S_ROWS], S[S_LEVELS]
    FORM: tl.constexpr = F[F_FORM]
    R: tl.constexpr = F[F_R]
    K: tl.constexpr = F[F_ROWS]
    DENSE: tl.constexpr = F[F_DENSE]
    DVP: tl.constexpr = F[F_DENSE_P]
    GB: tl.constexpr = F[F_GROUP_BLOCKS]
    C: tl.constexpr = F[F_CLASSES]
    Z: tl.constexpr = F[F_ZEROS]
    FOLD: tl.constexpr = F[F_FOLD]
    D: tl.constexpr = TL[T_D]
    DP: tl.constexpr = TL[T_DP]
    NVB: tl.constexpr = TL[T_NVB]
    BN: tl.constexpr = TL[T_BP] // R + (F[F_OFFSET] > 0)
    c = tl.arange(0, NVB * DVP)
    u = c // DVP
    j = c % DVP
    blk = blk0 + u
    row_ok = (u < BN) & (j < DENSE) & (blk >= 0) & (blk < NB)
    lin = bh * NB + blk
    dd = tl.arange(0, DP)
    if FORM == _FLOAT_ROWS or FORM == _PRUNED_ROWS:
        sv = float_rows(data, index, lin[:, None], j[:, None], dd[None, :], row_ok[:, None], F, D)
        out = mdot(pc, sv, VA_T, PREC)
    else:
        bits, bit_off, cls, zslot, lloyd, off = row_info(rows, levels, j, row_ok, F)
        ok = row_ok[:, None] & (dd[None, :] < D)
        codes = unpack_codes(data, lin[:, None], dd[None, :], ok, bits[:, None], bit_off[:, None], F, D)
        codes = trellis_index(codes, data, rows, lin[:, None], j[:, None], dd[None, :], ok, bits[:, None],
                              bit_off[:, None], F, D)
        vals = level_values(codes, j[:, None], lloyd[:, None], levels, ok, F)
        if FORM == _TOKEN_CODES:
            pcs = pc * tl.load(scale + lin * C + cls, mask=row_ok, other=0.0).to(tl.float32)[None, :]
            extra = tl.sum(pcs * off[None, :], 1)
            if Z > 0:
                z = tl.load(zero + lin * Z + zslot, mask=row_ok & (zslot >= 0), other=0.0).to(tl.float32)
                extra += tl.sum(pc * z[None, :], 1)
            out = mdot(pcs, vals, VA_T, PREC) + extra[:, None]
        elif FOLD:
            # the tile lies inside one scale group: per-channel scales multiply the output columns, once per class
            NG = NB // GB
            grp = fdiv(blk0, GB) + tl.zeros_like(dd)
            g_ok = (dd < D) & (grp >= 0) & (grp < NG)
            base = bh * NG + grp
            out = tl.zeros((pc.shape[0], DP), tl.float32)
            for k in tl.static_range(C):
                pck = tl.where((cls == k)[None, :], pc, 0.0)
                s = tl.load(scale + (base * C + k) * D + dd, mask=g_ok, other=0.0).to(tl.float32)
                out += (mdot(pck, vals, VA_T, PREC) + tl.sum(pck * off[None, :], 1)[:, None]) * s[None, :]
                if Z > 0:
                    slot = tl.load(rows + ROW_ZERO_SLOT * K + k + tl.zeros_like(dd))
                    z = tl.load(zero + (base * Z + slot) * D + dd, mask=g_ok & (slot >= 0), other=0.0).to(tl.float32)
                    out += tl.sum(pck, 1)[:, None] * z[None, :]
        else:
            base = bh * (NB // GB) + fdiv(blk, GB)
            s = tl.load(scale + ((base * C + cls) * D)[:, None] + dd[None, :], mask=ok, other=0.0).to(tl.float32)
            sv = (vals + off[:, None]) * s
            if Z > 0:
                sv += tl.load(zero + ((base * Z + zslot) * D)[:, None] + dd[None, :], mask=ok & (zslot >= 0)[:, None],
                              other=0.0).to(tl.float32)
            out = mdot(pc, sv, tl.float32, PREC)
    return out


@triton.jit
def _raw_found(L, F: tl.constexpr, p, ok):
    """Which positions ``p`` one stream holds raw: a sink, a tail row, or one of the call's new tokens."""
    length, start, stored_end, arch_end, NB = L
    SINKS: tl.constexpr = F[F_SINKS]
    TAIL: tl.constexpr = F[F_TAIL]
    found = ok & (p >= start) & (p < stored_end) & (p - start < TAIL)
    found |= ok & (p >= stored_end) & (p < length)
    if SINKS > 0:
        found |= ok & (p >= 0) & (p < SINKS) & (p < stored_end)
    return found


@triton.jit
def _raw_rows(S, N, L, F: tl.constexpr, D: tl.constexpr, b, kvh, bh, p, d, ok):
    """Raw tokens of one stream at positions ``p``, channel ``d`` (broadcast to the tile), zero where not held raw:
    sink ``p``, tail row ``p - start`` or new token ``p - stored_end`` (``N``: the new tokens' strides)."""
    sink, tail, new = S[S_SINK], S[S_TAIL], S[S_NEW]
    length, start, stored_end, arch_end, NB = L
    sn0, sn1, sn2, sn3 = N
    SINKS: tl.constexpr = F[F_SINKS]
    TAIL: tl.constexpr = F[F_TAIL]
    ok = ok & (d < D)
    in_tail = ok & (p >= start) & (p < stored_end) & (p - start < TAIL)
    x = tl.load(tail + (bh * TAIL + (p - start)) * D + d, mask=in_tail, other=0.0).to(tl.float32)
    in_new = ok & (p >= stored_end) & (p < length)
    x += tl.load(new + b * sn0 + kvh * sn1 + (p - stored_end) * sn2 + d * sn3, mask=in_new, other=0.0).to(tl.float32)
    if SINKS > 0:
        in_sink = ok & (p >= 0) & (p < SINKS) & (p < stored_end)
        x += tl.load(sink + (bh * SINKS + p) * D + d, mask=in_sink, other=0.0).to(tl.float32)
    return x


@triton.jit
def _rotated(x_chunk_rows, rot, D: tl.constexpr, DP: tl.constexpr, RC: tl.constexpr, k: tl.constexpr, PREC: tl.constexpr):
    """``x[:, chunk k] @ R^T[chunk k, :]`` for one ``RC``-column chunk of ``x``: ``R (D, D)`` row-major."""
    dc = k * RC + tl.arange(0, RC)
    e = tl.arange(0, DP)
    rt = tl.load(rot + e[None, :] * D + dc[:, None], mask=(dc[:, None] < D) & (e[None, :] < D), other=0.0)
    return tl.dot(x_chunk_rows, rt, input_precision=PREC)


@triton.jit
def _mask_bias(mk, b, head, t, pos, ok, MASK_KIND: tl.constexpr):
    """Additive fp32 bias for rows (head, t) x positions ``pos``: 0 / -inf for bool masks, the value for float ones.
    Positions past the mask's width read its last column (as the reference's clamped gather). Every index is int64."""
    mask_ptr, smb, smh, smt, sml, mask_len = mk
    col = tl.minimum(tl.maximum(pos, 0), mask_len - 1).to(tl.int64)
    ptr = mask_ptr + b * smb + head[:, None] * smh + t[:, None] * smt + col[None, :] * sml
    if MASK_KIND == _BOOL_MASK:
        bias = tl.where(tl.load(ptr, mask=ok, other=1) != 0, 0.0, float("-inf"))
    else:
        bias = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    return bias


@triton.jit
def _tanh(x):
    """tanh: ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` from ``|x| = 0.25`` on, the Taylor polynomial to ``x^9``
    below (the quotient loses relative precision near 0), the sign put back (as the CPU kernels' ``softcap_row``)."""
    a = tl.abs(x)
    e = tl.exp2(a * (-2.0 * _LOG2E))
    z = a * a
    series = a + a * z * (-1.0 / 3.0 + z * (2.0 / 15.0 + z * (-17.0 / 315.0 + z * (62.0 / 2835.0))))
    t = tl.where(a < 0.25, series, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def _softmax_step(s, st):
    """One online-softmax step on log2-domain scores ``s (M, P)``; returns the probabilities and the rescaled state
    ``(max, sum, archive-space accumulator, archive mass, raw accumulator)``."""
    m_i, l_i, acc, mass, acc_raw = st
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, (m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None], mass * alpha, acc_raw * alpha[:, None])


# --- one tile of positions --------------------------------------------------------------------------------------

@triton.jit
def _tile(p0, lo, hi, st, qc, rc, mk, mats, K, KN, KL, V, VN, VL, qk_scale, cap_log2, slopes,
          KF: tl.constexpr, VF: tl.constexpr, TL: tl.constexpr, MASK_KIND: tl.constexpr, EDGE: tl.constexpr,
          IO_T: tl.constexpr, KA_T: tl.constexpr, VA_T: tl.constexpr, PREC: tl.constexpr, SOFTCAP: tl.constexpr,
          ALIBI: tl.constexpr):
    """Attend positions ``[p0, p0 + BP) & [lo, hi)``; returns the updated online-softmax state ``st``.

    Logits in base 2: ``s * qk_scale`` (``scale * log2(e)``), or with ``SOFTCAP`` ``tanh(s * qk_scale) *
    cap_log2`` (``qk_scale = scale / softcap``, ``cap_log2 = softcap * log2(e)``); with ``ALIBI`` plus ``slopes *
    position`` (``slopes``: the rows' ALiBi slopes times ``log2(e)``); then the mask.

    ``EDGE`` (the extra split): positions may also be raw in either stream; else every position is archived in
    both (or past a stream's capacity: not stored). Raw values of a rotated value stream accumulate apart (they are
    rotated into the archive's space once per program)."""
    q_io, q_k, qsum_k, qm_k = qc
    b, kvh, bh, head, t, row_ok = rc
    a_k, a_v, mean_v = mats
    k_len, k_start, k_se, k_arch_end, k_nb = KL
    v_len, v_start, v_se, v_arch_end, v_nb = VL
    D: tl.constexpr = TL[T_D]
    DP: tl.constexpr = TL[T_DP]
    BP: tl.constexpr = TL[T_BP]
    BPP: tl.constexpr = TL[T_BPP]
    i = tl.arange(0, BPP)
    p = p0 + i
    dd = tl.arange(0, DP)
    in_range = (i < BP) & (p >= lo) & (p < hi)
    # key scores
    k_arch = in_range & (p >= KF[F_SINKS]) & (p < k_arch_end)
    coef = _arch_rows_t(K, KF, TL, bh, fdiv(p0 - KF[F_SINKS], KF[F_R]), k_nb, KA_T, PREC, q_k, qsum_k)
    if KF[F_R] == 1:
        s = coef
    else:
        s = mdot(coef, a_k, tl.float32, PREC)
    if KF[F_CENTER]:
        s += qm_k[:, None]
    valid = k_arch
    if EDGE:
        k_raw = _raw_found(KL, KF, p, in_range)
        kt = _raw_rows(K, KN, KL, KF, D, b, kvh, bh, p[None, :], dd[:, None], k_raw[None, :])
        s = tl.where(k_raw[None, :], mdot(q_io, kt, IO_T, PREC), s)
        valid = valid | k_raw
    s = s * qk_scale
    if SOFTCAP:
        s = _tanh(s) * cap_log2
    if ALIBI:
        s += slopes[:, None] * p.to(tl.float32)[None, :]
    if MASK_KIND != _NO_MASK:
        s += _mask_bias(mk, b, head, t, p, row_ok[:, None] & valid[None, :], MASK_KIND) * _LOG2E
    s = tl.where(valid[None, :], s, float("-inf"))
    prob, st = _softmax_step(s, st)
    m_i, l_i, acc, mass, acc_raw = st
    # values
    v_arch = in_range & (p >= VF[F_SINKS]) & (p < v_arch_end)
    p_arch = tl.where(v_arch[None, :], prob, 0.0)
    if VF[F_R] == 1:
        pc = p_arch
    else:
        pc = mdot(p_arch, a_v, tl.float32, PREC)
    acc += _arch_values(V, VF, TL, bh, fdiv(p0 - VF[F_SINKS] - VF[F_OFFSET], VF[F_R]), v_nb, VA_T, PREC, pc)
    if VF[F_CENTER]:
        mass += tl.sum(p_arch, 1)
    if EDGE:
        v_raw = _raw_found(VL, VF, p, in_range)
        p_raw = tl.where(v_raw[None, :], prob, 0.0)
        rows = _raw_rows(V, VN, VL, VF, D, b, kvh, bh, p[:, None], dd[None, :], v_raw[:, None])
        if VF[F_ROTATE]:
            acc_raw += mdot(p_raw, rows, IO_T, PREC)  # rotated into the archive's space once, at the end
        else:
            acc += mdot(p_raw, rows, IO_T, PREC)
    return m_i, l_i, acc, mass, acc_raw


@triton.jit
def _tile_span(lo, hi, origin: tl.constexpr, BP: tl.constexpr):
    """``(first tile, tile count)`` of the tiles (of ``BP`` positions from ``origin``) meeting ``[lo, hi)``."""
    first = fdiv(lo - origin, BP)
    return first, tl.where(hi > lo, fdiv(hi - 1 - origin, BP) + 1 - first, 0)


@triton.jit
def _synthesis_blocks(syn, F: tl.constexpr, TL: tl.constexpr, BY_POSITION: tl.constexpr):
    """Block-diagonal synthesis matrix of one tile: entry ``((n, j), i)`` is ``A[i + offset - n * r, j]`` where
    position ``i`` of the tile lies in block ``n``; ``(NB * DENSE_P, BPP)`` (keys), or its transpose ``(BPP, ...)``
    with ``BY_POSITION`` (values); a placeholder for ``r = 1`` (the identity, skipped)."""
    R: tl.constexpr = F[F_R]
    DENSE: tl.constexpr = F[F_DENSE]
    DNP: tl.constexpr = F[F_DENSE_P]
    OFF: tl.constexpr = F[F_OFFSET]
    BP: tl.constexpr = TL[T_BP]
    BPP: tl.constexpr = TL[T_BPP]
    if R == 1:
        out = tl.zeros((1, 1), tl.float32)  # (the identity: never read)
    else:
        if BY_POSITION:
            NBLK: tl.constexpr = TL[T_NVB]
            c = tl.arange(0, NBLK * DNP)[None, :]
            i = tl.arange(0, BPP)[:, None]
        else:
            NBLK: tl.constexpr = TL[T_NKB]
            c = tl.arange(0, NBLK * DNP)[:, None]
            i = tl.arange(0, BPP)[None, :]
        n = c // DNP
        j = c % DNP
        row = i + OFF - n * R
        out = tl.load(syn + row * DENSE + j, mask=(i < BP) & (row >= 0) & (row < R) & (j < DENSE), other=0.0)
    return out


@triton.jit
def _split_kernel(
    q_ptr, sq0, sq1, sq2, sq3,
    K, klen, kstart, KN, NB_K,
    V, vlen, vstart, VN, NB_V,
    mask_ptr, smb, smh, smt, sml, mask_len,
    o_part, lse_part, qk_scale, HKV, T, G, N_MCHUNK, NUM_SPLITS, T_NEW, cap_log2, alibi_ptr,
    KF: tl.constexpr, VF: tl.constexpr, TL: tl.constexpr, MASK_KIND: tl.constexpr, EDGE: tl.constexpr,
    IO_T: tl.constexpr, KA_T: tl.constexpr, VA_T: tl.constexpr, PREC: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
):
    """Program ``(bh * N_MCHUNK + row chunk, split)`` of the main region (``EDGE`` False: splits ``0 .. NUM_SPLITS -
    1``) or of the edge (``EDGE``: one split, written as part ``NUM_SPLITS``; a launch of its own, so that each
    variant keeps only its own registers). Per stream (``K``, ``V``): one tuple of pointers (the state's data,
    scale, zero, index, mean, sink and tail, the new tokens, the tables synthesis, rotation, rows and levels: what
    the tile helpers read), the state's length and start, the new tokens' strides (a tuple) and the archive's
    capacity in blocks. Constexprs: ``KF``/``VF`` the streams' :class:`StreamForm` tuples, ``TL`` the
    :class:`AttentionTiles` tuple, the mask kind and the dot types (``IO_T`` raw operands, ``KA_T``/``VA_T`` archive
    operands, ``PREC`` fp32 dots). Variants (:func:`_tile`): ``SOFTCAP`` with ``cap_log2``, ``ALIBI`` with the
    ``(Hq,)`` fp32 slopes at ``alibi_ptr``; both None when off."""
    D: tl.constexpr = TL[T_D]
    DP: tl.constexpr = TL[T_DP]
    BP: tl.constexpr = TL[T_BP]
    BLOCK_M: tl.constexpr = TL[T_BLOCK_M]
    RC: tl.constexpr = TL[T_RC]
    A0: tl.constexpr = TL[T_A0]
    K_SINKS: tl.constexpr = KF[F_SINKS]
    kmean, k_syn, k_rot = K[S_MEAN], K[S_SYNTHESIS], K[S_ROTATION]
    vmean, v_syn, v_rot = V[S_MEAN], V[S_SYNTHESIS], V[S_ROTATION]
    pid = tl.program_id(0)
    split = tl.program_id(1)
    bh = (pid // N_MCHUNK).to(tl.int64)
    b = bh // HKV
    kvh = bh % HKV
    m = (pid % N_MCHUNK) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < G * T
    g = m // T
    t = (m % T).to(tl.int64)
    head = kvh * G + g
    dd = tl.arange(0, DP)
    q_row = q_ptr + b * sq0 + head[:, None] * sq1 + t[:, None] * sq2
    q = tl.load(q_row + dd[None, :] * sq3, mask=row_ok[:, None] & (dd[None, :] < D), other=0.0)
    q_f = q.to(tl.float32)
    q_k = q_f
    if KF[F_ROTATE]:
        # the keys' rotation folded into q once: q_k = q @ R_k^T
        q_k = tl.zeros((BLOCK_M, DP), tl.float32)
        for k in tl.static_range(DP // RC):
            dc = k * RC + tl.arange(0, RC)
            x = tl.load(q_row + dc[None, :] * sq3, mask=row_ok[:, None] & (dc[None, :] < D), other=0.0)
            q_k += _rotated(x.to(tl.float32), k_rot, D, DP, RC, k, PREC)
    qm_k = tl.zeros((BLOCK_M,), tl.float32)
    if KF[F_CENTER]:
        qm_k = tl.sum(q_f * tl.load(kmean + bh * D + dd, mask=dd < D, other=0.0)[None, :], 1)
    mean_v = tl.zeros((DP,), tl.float32)
    if VF[F_CENTER]:
        if VF[F_ROTATE]:
            for k in tl.static_range(DP // RC):
                dc = k * RC + tl.arange(0, RC)
                mv = tl.load(vmean + bh * D + dc, mask=dc < D, other=0.0)
                rot = tl.load(v_rot + dd[:, None] * D + dc[None, :], mask=(dd[:, None] < D) & (dc[None, :] < D),
                              other=0.0)
                mean_v += tl.sum(rot * mv[None, :], 1)
        else:
            mean_v = tl.load(vmean + bh * D + dd, mask=dd < D, other=0.0)
    # per stream: (length, start, stored end, archive end, capacity in blocks); positions are int64
    k_len = tl.load(klen)
    k_start = tl.load(kstart)
    k_se = k_len - T_NEW
    k_end = tl.minimum(tl.minimum(k_start, k_se), K_SINKS + NB_K.to(tl.int64) * KF[F_R])
    v_len = tl.load(vlen)
    v_start = tl.load(vstart)
    v_se = v_len - T_NEW
    v_end = tl.minimum(tl.minimum(v_start, v_se), VF[F_SINKS] + NB_V.to(tl.int64) * VF[F_R])
    KL = (k_len, k_start, k_se, k_end, NB_K)
    VL = (v_len, v_start, v_se, v_end, NB_V)
    qc = (q.to(IO_T), q_k, tl.sum(q_k, 1), qm_k)
    rc = (b, kvh, bh, head, t, row_ok)
    mk = (mask_ptr, smb, smh, smt, sml, mask_len)
    mats = (_synthesis_blocks(k_syn, KF, TL, False), _synthesis_blocks(v_syn, VF, TL, True), mean_v)  # (r > 1)
    slopes = tl.zeros((BLOCK_M,), tl.float32)
    if ALIBI:
        slopes = tl.load(alibi_ptr + head, mask=row_ok, other=0.0) * _LOG2E
    raw_width: tl.constexpr = DP if EDGE and VF[F_ROTATE] else 1
    st = (tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.zeros((BLOCK_M,), tl.float32),
          tl.zeros((BLOCK_M, DP), tl.float32), tl.zeros((BLOCK_M,), tl.float32),
          tl.zeros((BLOCK_M, raw_width), tl.float32))
    # main region [A0, A1): archived in both streams
    a1 = tl.maximum(tl.minimum(k_end, tl.minimum(v_start, v_se)), A0)
    if EDGE:
        # the edge: ranges [0, min(A0, k_end)), [A1, k_end), [min(start_k, stored_end_k), length_k), visited as one
        # run of tiles (tile i of the run lies in the first range whose tiles it has not passed yet)
        lo0, hi0 = k_len * 0, tl.minimum(k_end, A0)
        lo1, hi1 = a1, k_end
        lo2, hi2 = tl.minimum(k_start, k_se), k_len
        f0, n0 = _tile_span(lo0, hi0, K_SINKS, BP)
        f1, n1 = _tile_span(lo1, hi1, K_SINKS, BP)
        f2, n2 = _tile_span(lo2, hi2, K_SINKS, BP)
        for i in range(0, n0 + n1 + n2):
            in0 = i < n0
            in1 = (i >= n0) & (i < n0 + n1)
            tt = tl.where(in0, f0 + i, tl.where(in1, f1 + i - n0, f2 + i - n0 - n1))
            lo = tl.where(in0, lo0, tl.where(in1, lo1, lo2))
            hi = tl.where(in0, hi0, tl.where(in1, hi1, hi2))
            st = _tile(K_SINKS + tt * BP, lo, hi, st, qc, rc, mk, mats, K, KN, KL, V, VN, VL, qk_scale, cap_log2,
                       slopes, KF, VF, TL, MASK_KIND, True, IO_T, KA_T, VA_T, PREC, SOFTCAP, ALIBI)
    else:
        t_lo = (A0 - K_SINKS) // BP
        t_hi = (a1 - K_SINKS + BP - 1) // BP
        per = tl.cdiv(t_hi - t_lo, NUM_SPLITS)
        lo = t_lo + split * per
        hi = tl.minimum(lo + per, t_hi)
        for tt in range(lo, hi):
            st = _tile(K_SINKS + tt * BP, A0, a1, st, qc, rc, mk, mats, K, KN, KL, V, VN, VL, qk_scale, cap_log2,
                       slopes, KF, VF, TL, MASK_KIND, False, IO_T, KA_T, VA_T, PREC, SOFTCAP, ALIBI)
    m_i, l_i, acc, mass, acc_raw = st
    if VF[F_CENTER]:
        acc += mass[:, None] * mean_v[None, :]
    part = pid.to(tl.int64) * (NUM_SPLITS + 1) + (NUM_SPLITS if EDGE else split)
    rows = tl.arange(0, BLOCK_M)
    slot = o_part + part * (BLOCK_M * DP) + rows[:, None] * DP
    if EDGE and VF[F_ROTATE]:
        # the raw values into the archive's rotated space, once: acc_raw @ R_v^T, one column chunk at a time
        # (stashed in this program's own partial slot, read back after a barrier)
        tl.store(slot + dd[None, :], acc_raw)
        tl.debug_barrier()
        for k in tl.static_range(DP // RC):
            dc = k * RC + tl.arange(0, RC)
            acc += _rotated(tl.load(slot + dc[None, :]), v_rot, D, DP, RC, k, PREC)
        tl.debug_barrier()
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(slot + dd[None, :], out)
    tl.store(lse_part + part * BLOCK_M + rows, lse)


@triton.jit
def _combine_kernel(o_part, lse_part, out_ptr, so0, so1, so2, so3, v_rot, HKV, T, G, N_MCHUNK, PARTS, sinks_ptr,
                    D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, RC: tl.constexpr,
                    ROTATE: tl.constexpr, PREC: tl.constexpr, SINKS: tl.constexpr):
    """Merge the ``PARTS`` partial (output, log2-sum-exp) pairs of one program's rows; with ``SINKS`` the rows'
    sink logits (``(Hq,)`` fp32 at ``sinks_ptr``, None without) join each row's max and denominator; with ``ROTATE``
    the merged output (in the values' rotated space) is rotated back once, ``out @ R_v``, one column chunk at a
    time."""
    pid = tl.program_id(0)
    bh = (pid // N_MCHUNK).to(tl.int64)
    b = bh // HKV
    kvh = bh % HKV
    rows = tl.arange(0, BLOCK_M)
    m = (pid % N_MCHUNK) * BLOCK_M + rows
    dd = tl.arange(0, DP)
    m_run = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_run = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DP), tl.float32)
    for s in range(PARTS):
        part = pid.to(tl.int64) * PARTS + s
        lse = tl.load(lse_part + part * BLOCK_M + rows)
        o = tl.load(o_part + part * (BLOCK_M * DP) + rows[:, None] * DP + dd[None, :])
        m_new = tl.maximum(m_run, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_use)
        w = tl.exp2(lse - m_use)
        acc = acc * alpha[:, None] + w[:, None] * o
        l_run = l_run * alpha + w
        m_run = m_new
    g = m // T
    t = (m % T).to(tl.int64)
    if SINKS:
        sink = tl.load(sinks_ptr + kvh * G + g, mask=m < G * T, other=float("-inf")) * _LOG2E
        m_new = tl.maximum(m_run, sink)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_use)
        acc = acc * alpha[:, None]
        l_run = l_run * alpha + tl.exp2(sink - m_use)
    acc = tl.where((l_run > 0)[:, None], acc / tl.where(l_run > 0, l_run, 1.0)[:, None], 0.0)
    row_ptr = out_ptr + b * so0 + (kvh * G + g)[:, None] * so1 + t[:, None] * so2
    row_ok = (m < G * T)[:, None]
    if ROTATE:
        for k in tl.static_range(DP // RC):
            dc = k * RC + tl.arange(0, RC)
            rot = tl.load(v_rot + dd[:, None] * D + dc[None, :], mask=(dd[:, None] < D) & (dc[None, :] < D),
                          other=0.0)
            o = tl.dot(acc, rot, input_precision=PREC)
            tl.store(row_ptr + dc[None, :] * so3, o.to(out_ptr.dtype.element_ty), mask=row_ok & (dc[None, :] < D))
    else:
        tl.store(row_ptr + dd[None, :] * so3, acc.to(out_ptr.dtype.element_ty), mask=row_ok & (dd[None, :] < D))


# --- launcher ---------------------------------------------------------------------------------------------------

def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


class AttentionTiles(_TILES.namedtuple()):
    """The split kernel's shape constexprs (its fields: the ``T_*`` declarations above, in tuple order)."""

    __slots__ = ()

    def constexpr(self) -> tuple:
        return tuple(self)


@dataclass(frozen=True)
class TilePlan:
    """How positions are tiled for one (key codec, value codec) pair (shapes only): ``positions`` per tile of the
    main region, ``edge_positions`` per tile of the edge (its own launch: the smallest tile with the same folds, as
    the edge tile also loads raw rows and rotates raw values), the value blocks' offset inside a tile, the folds."""

    positions: int
    edge_positions: int
    value_offset: int
    fold_k: bool
    fold_v: bool


def tile_plan(ck, cv) -> TilePlan:
    """Tile positions ``BP``: a multiple of ``lcm(r_k, r_v)`` (tiles start on key block boundaries, value blocks sit
    at the constant offset ``(sinks_k - sinks_v) mod r_v``), large enough for ``tl.dot`` (>= 16 per dimension),
    preferring tiles inside one scale group of each channel-axis stream (the scale fold), then about 64 positions."""
    rk, rv = ck.block_size, cv.block_size
    step = math.lcm(rk, rv)
    if step > MAX_TILE_POSITIONS:
        raise ValueError(f"the Triton kernels need lcm(block_size of k, block_size of v) <= {MAX_TILE_POSITIONS}, "
                         f"got lcm({rk}, {rv}) = {step}")
    off = (ck.sinks - cv.sinks) % rv
    fits = []
    bp = step
    while bp <= MAX_TILE_POSITIONS:
        if (pow2(bp) >= 16 and pow2(bp // rk) * pow2(ck.dense_rows) >= 16
                and pow2(bp // rv + (off > 0)) * pow2(cv.dense_rows) >= 16):
            fold_k = ck.quantizer is not None and ck.quantizer.axis == "channel" and ck.group % bp == 0
            fold_v = (cv.quantizer is not None and cv.quantizer.axis == "channel" and cv.group % bp == 0
                      and (ck.sinks - cv.sinks) % cv.group == 0)
            fits.append(((fold_k + fold_v, -abs(math.log2(bp / _TARGET_POSITIONS)), -bp), bp, fold_k, fold_v))
        bp *= 2
    if not fits:
        raise ValueError(f"the Triton kernels find no tile of <= {MAX_TILE_POSITIONS} positions for block sizes "
                         f"{rk} (k) and {rv} (v)")
    _, bp, fold_k, fold_v = max(fits)
    edge = min(e for _, e, fk, fv in fits if (fk, fv) == (fold_k, fold_v))
    return TilePlan(bp, edge, off, fold_k, fold_v)


def _tiles(ck, cv, positions: int, offset: int, head_dim: int, block_m: int) -> AttentionTiles:
    dp = pow2(head_dim, 16)
    return AttentionTiles(head_dim=head_dim, dp=dp, positions=positions, positions_p=pow2(positions),
                          key_blocks=pow2(positions // ck.block_size),
                          value_blocks=pow2(positions // cv.block_size + (offset > 0)), block_m=block_m,
                          rc=min(32, dp), a0=max(ck.sinks, cv.sinks))


def attention_plan(batch: int, kv_heads: int, rows: int, ck, cv, groups_k: int, head_dim: int, device: torch.device,
                   num_splits: int | None = None) -> dict:
    """Tiles and split count from shapes only (never from the device lengths, so the launch is fixed).

    - ``BLOCK_M``: the ``G * T`` query rows of a kv head, padded to a power of two >= 16 (tl.dot minimum), at most 64
      per program; larger groups get more programs.
    - tile positions: :func:`tile_plan`.
    - splits: enough programs to fill the device twice over (``2 * SMs`` on CUDA), never more splits than tiles of
      the key archive's capacity; each split's tile range comes from the device lengths inside the kernel (the
      stored tiles are dealt evenly over the splits, so a short fill of a large static cache spreads over all).
    - ``num_warps``: 8 when a stored tile holds >= 8192 values (e.g. 64 positions x 8 rows / 8 x D=128), else 4.
    """
    plan = tile_plan(ck, cv)
    block_m = pow2(rows, 16) if rows <= _MAX_ROWS else _MAX_ROWS
    n_mchunk = -(-rows // block_m)
    n_tiles = max(1, -(-(groups_k * ck.group) // plan.positions))
    if num_splits is None:
        base = batch * kv_heads * n_mchunk
        num_splits = min(n_tiles, max(1, -(-2 * _sm_count(device) // base)))
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    num_splits = max(1, min(num_splits, n_tiles))
    tiles = _tiles(ck, cv, plan.positions, plan.value_offset, head_dim, block_m)
    stored = max(tiles.key_blocks * pow2(ck.dense_rows), tiles.value_blocks * pow2(cv.dense_rows))
    warps = 8 if stored * tiles.dp >= 8192 else 4
    return {"BLOCK_M": block_m, "n_mchunk": n_mchunk, "num_splits": num_splits, "num_warps": warps,
            "num_stages": NUM_STAGES, "tiles": tiles, "tile_plan": plan,
            "edge_tiles": _tiles(ck, cv, plan.edge_positions, plan.value_offset, head_dim, block_m)}


def _mask_args(mask: torch.Tensor | None, q: torch.Tensor) -> tuple:
    """``(tensor, stride_b, stride_h, stride_t, stride_l, length, kind)``; broadcast dims get stride 0."""
    if mask is None:
        return q, 0, 0, 0, 0, 1, NO_MASK
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    strides = [0 if mask.shape[i] == 1 else mask.stride(i) for i in range(3)]
    return mask, *strides, mask.stride(3), mask.shape[3], BOOL_MASK if mask.dtype == torch.uint8 else ADDITIVE_MASK


def _exact16(form: StreamForm, data: torch.Tensor) -> bool:
    """Whether a stream's archive operand is exact in a 16-bit dot: integer codes of affine levels, jpeg rows stored
    in a 16-bit dtype (not lloyd levels or trellis alphabets, not png's fp32 deltas)."""
    if form.form in (TOKEN_CODES, CHANNEL_CODES):
        return not form.lloyd
    return form.form == FLOAT_ROWS and data.dtype in (torch.float16, torch.bfloat16)


def _stream_args(codec, st, new: torch.Tensor | None, placeholder: torch.Tensor, tables) -> list:
    """One stream's kernel arguments: the tuple of its ``S_*`` fields (state tensors, empty ones replaced by
    ``placeholder``: never read; the new tokens; the tables), then length, start, the new tokens' strides and the
    archive's capacity in blocks."""
    given = {**st._asdict(), **vars(tables), "new": placeholder if new is None else new}
    state = set(StreamState._fields)
    pointers = tuple(placeholder if name in state and given[name].numel() == 0 else given[name]
                     for name in _STREAM.names)
    strides = (0, 0, 0, 0) if new is None else tuple(new.stride())
    return [pointers, st.length, st.start, strides, st.data.shape[2] * codec.blocks]


def split_partials(q: torch.Tensor, k_state, v_state, spec_k: str, spec_v: str, k_new: torch.Tensor | None = None,
                   v_new: torch.Tensor | None = None, mask: torch.Tensor | None = None, scale: float | None = None,
                   num_splits: int | None = None, *, softcap: float | None = None, sinks: torch.Tensor | None = None,
                   alibi: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Validate, plan and launch the split kernel. Returns the partial outputs ``(programs, splits + 1, BLOCK_M,
    DP)`` fp32 (in the values' rotated space), their log2-sum-exp ``(programs, splits + 1, BLOCK_M)`` (``-inf``: the
    split saw nothing) and the plan; part ``splits`` is the edge's. ``softcap`` and ``alibi`` enter the logits here;
    ``sinks`` is only validated (the combine adds it)."""
    ck, cv, ks, vs = check_attention_args(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, softcap, sinks,
                                          alibi)
    io_t = io_dtype(q.dtype)
    b, hq, t, d = q.shape
    check_triton_limits(ck, d, "spec_k")
    check_triton_limits(cv, d, "spec_v")
    require_contiguous(**{f"{name}.{field}": getattr(st, field) for name, st in (("k_state", ks), ("v_state", vs))
                          for field in _STREAM.names if field in st._fields})
    hkv = ks.tail.shape[1]
    g = hq // hkv
    plan = attention_plan(b, hkv, g * t, ck, cv, ks.data.shape[2], d, q.device, num_splits)
    tp: TilePlan = plan["tile_plan"]
    kf = StreamForm.of(stored_form_plan(spec_k, d), fold=tp.fold_k)
    vf = StreamForm.of(stored_form_plan(spec_v, d), fold=tp.fold_v, offset=tp.value_offset)
    tk, tv = stream_tables(ck, d, q.device), stream_tables(cv, d, q.device)
    parts, programs, dp = plan["num_splits"] + 1, b * hkv * plan["n_mchunk"], plan["tiles"].dp
    o_part = torch.empty(programs, parts, plan["BLOCK_M"], dp, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(programs, parts, plan["BLOCK_M"], dtype=torch.float32, device=q.device)
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    mask_t, smb, smh, smt, sml, mask_len, mask_kind = _mask_args(mask, q)
    wide = q.dtype == torch.float32
    ka_t = io_t if not wide and _exact16(kf, ks.data) and not kf.rotate and kf.form != CHANNEL_CODES else tl.float32
    va_t = io_t if not wide and _exact16(vf, vs.data) else tl.float32
    # base-2 logits: scale * log2(e), or with a softcap tanh(s * scale / softcap) * softcap * log2(e) (see _tile)
    qk_scale = sm_scale * LOG2E if softcap is None else sm_scale / softcap
    cap_log2 = None if softcap is None else float(softcap) * LOG2E
    args = (q, *q.stride(), *_stream_args(ck, ks, k_new, q, tk), *_stream_args(cv, vs, v_new, q, tv),
            mask_t, smb, smh, smt, sml, mask_len, o_part, lse_part, qk_scale, hkv, t, g, plan["n_mchunk"],
            plan["num_splits"], 0 if k_new is None else k_new.shape[2], cap_log2,
            None if alibi is None else alibi.contiguous())
    constexprs = dict(KF=kf.constexpr(), VF=vf.constexpr(), MASK_KIND=mask_kind, IO_T=io_t, KA_T=ka_t, VA_T=va_t,
                      PREC="ieee" if wide else "tf32x3", SOFTCAP=softcap is not None, ALIBI=alibi is not None,
                      num_stages=plan["num_stages"])
    _split_kernel[(programs, plan["num_splits"])](*args, TL=plan["tiles"].constexpr(), EDGE=False,
                                                  num_warps=plan["num_warps"], **constexprs)
    _split_kernel[(programs, 1)](*args, TL=plan["edge_tiles"].constexpr(), EDGE=True, num_warps=EDGE_WARPS,
                                 **constexprs)
    return o_part, lse_part, plan


def triton_codec_attention(q: torch.Tensor, k_state: list[torch.Tensor], v_state: list[torch.Tensor], spec_k: str,
                           spec_v: str, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                           mask: torch.Tensor | None = None, scale: float | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Triton ``flashcodec::codec_attention``: ``q (B, Hq, T, D)`` over the stored states; ``(B, Hq, T, D)`` in q's
    dtype. Same contract and validation as :func:`~flashcodec_fx.ops.reference.attention.codec_attention_reference`; every
    stored form within the Triton limits (``common``). fp16/bf16/fp32 I/O, fp32 accumulation (docs/triton.md:
    which operands enter 16-bit dots). Tiles and split count: :func:`attention_plan` (``num_splits`` overrides the
    heuristic). The variants ``softcap``, ``sinks``, ``alibi`` as the reference's (constexpr flags: a call without
    them runs the kernels compiled without them). Two launches (splits, combine) whose grid depends on shapes only:
    capturable in a CUDA graph."""
    ck, cv = spec_codec("spec_k", spec_k), spec_codec("spec_v", spec_v)
    vs = StreamState(*v_state)
    q_in, k_new, v_new, out_factors = attention_inputs(ck, cv, StreamState(*k_state), vs, q, k_new, v_new)
    o_part, lse_part, plan = split_partials(q_in, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, scale,
                                            num_splits, softcap=softcap, sinks=sinks, alibi=alibi)
    b, hq, t, d = q.shape
    hkv = vs.tail.shape[1]
    out = torch.empty(b, hq, t, d, dtype=q.dtype, device=q.device)
    rot = stream_tables(cv, d, q.device).rotation
    tiles = plan["tiles"]
    sink_logits = None if sinks is None else sinks.float().contiguous()
    _combine_kernel[(o_part.shape[0],)](o_part, lse_part, out, *out.stride(), rot, hkv, t, hq // hkv,
                                        plan["n_mchunk"], o_part.shape[1], sink_logits, D=d, DP=tiles.dp,
                                        BLOCK_M=plan["BLOCK_M"], RC=tiles.rc, ROTATE=cv.rotate is not None,
                                        PREC="ieee" if q.dtype == torch.float32 else "tf32x3",
                                        SINKS=sinks is not None)
    return attention_output(out, out_factors)
