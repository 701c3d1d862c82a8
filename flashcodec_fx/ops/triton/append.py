"""Triton `append`: new tokens into the stream; groups that complete and leave the window are encoded on the device.

Four launches, the same every step (grids depend on shapes only; lengths are read on the device: no host sync,
CUDA-graph capturable), in the reference's order (``ops/reference/append.py``):

1. ``_intake_kernel``, one program per (batch * head): sink rows, the per-channel mean (``center``: the first
   append reaching past the sinks), the new tokens' raw rows in the memo;
2. ``_encode_kernel``, one program per (completable group ``k``, batch * head): group ``k`` of the work buffer (old
   tail, then the new tokens) is encoded and stored when ``advance`` archives it and it fits in the capacity (never
   past it); else the program does nothing. Encoding: center, rotate (``x @ R^T``), the jpeg DCT (``M @ X`` per
   block) or png's anchor + deltas (pruned: the largest kept per channel), then the quantizer: each scale class's
   base scale (``int`` / ``midrise``: the largest magnitude over the class's step, ``uniform``: the range and its
   minimum as zero point, ``lloyd``: the RMS), the clipping search over ``quant.SHRINK_FACTORS`` /
   ``LLOYD_FACTORS`` (least squared error, the first of equal errors), fp16 scales and zero points, nearest codes
   (grids round half to even, Lloyd-Max by their midpoints), codes packed in power-of-two bit slices; trellis rows
   (``levels="tcq"``) take :func:`trellis_encode` instead (the Viterbi search of ``codecs/trellis.py``, bitwise the
   reference's on the same rows: its sums in the same order, FMA contraction off for these launches); the memo gets
   the group's decoded rows;
3. ``_tail_kernel``, one program per (batch * head): the rows after the archived groups become the tail (zeros
   past the length), after every reader of the old tail has run;
4. ``_advance_kernel``, one program: ``start`` moves past the archived groups, ``length += T``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...codecs import Codec, trellis
from ...codecs.quant import FIT_RANGE, FIT_ROUNDS
from ..plan import CHANNEL_CODES, PRUNED_ROWS, TOKEN_CODES, StoredFormPlan, stored_form_plan
from ..reference.append import append_stored, check_append_args, completable_groups
from ..state import StreamState
from .common import (
    F_CENTER,
    F_CLASSES,
    F_DENSE_P,
    F_FORM,
    F_GROUP_BLOCKS,
    F_KEPT,
    F_LEVELS_W,
    F_LLOYD,
    F_R,
    F_ROTATE,
    F_ROW_BYTES,
    F_ROWS,
    F_SINKS,
    F_SLICES,
    F_TAIL,
    F_TCQ,
    F_ZEROS,
    FACTOR_SLOTS,
    KIND_INT,
    KIND_LLOYD,
    KIND_TCQ,
    KIND_UNIFORM,
    N_LLOYD,
    N_SHRINK,
    ROW_BIT_OFFSET,
    ROW_CLASS,
    ROW_KIND,
    ROW_ZERO_SLOT,
    TCQ_SLOTS,
    StreamForm,
    TupleFields,
    check_group_tokens,
    check_triton_limits,
    float_rows,
    grid_rows,
    level_values,
    pow2,
    require_contiguous,
    row_info,
    stream_tables,
    trellis_index,
    unpack_codes,
)

_CHANNEL_CODES: tl.constexpr = tl.constexpr(CHANNEL_CODES)
_PRUNED_ROWS: tl.constexpr = tl.constexpr(PRUNED_ROWS)
_FP16_MAX: tl.constexpr = tl.constexpr(65504.0)
_FIT_ROUNDS: tl.constexpr = tl.constexpr(FIT_ROUNDS)
_FIT_LO: tl.constexpr = tl.constexpr(FIT_RANGE[0])
_FIT_HI: tl.constexpr = tl.constexpr(FIT_RANGE[1])
_CHUNK = 16  # token rows per step of the intake and tail loops
# The trellis encoder (``codecs/trellis.py``): its states, the most levels per subset (2**(MAX_BITS - 1))
TCQ_STATES: tl.constexpr = tl.constexpr(trellis.STATES)
TCQ_MAX_PER_SUBSET: tl.constexpr = tl.constexpr(1 << (trellis.MAX_BITS - 1))
# The fields of the append kernels' shape tuple (:class:`EncodeTiles`), in tuple order (kernels: ``E[E_D]``):
_ENCODE = TupleFields("EncodeTiles")
E_D = _ENCODE("head_dim")
E_DP = _ENCODE("dp")  # head_dim's tile
E_GP = _ENCODE("gp")  # rows of a group's token tile (a power of two >= 16, tl.dot's minimum)
E_RP = _ENCODE("rp")  # rows of its stored-row tile (likewise)
E_RC = _ENCODE("rc")  # the rotation's column chunk
E_WINDOW = _ENCODE("window")
E_IS_JPEG = _ENCODE("is_jpeg")
E_QUANT = _ENCODE("quant")
E_SEARCH = _ENCODE("search")  # the scale search: ops.plan SEARCH_NONE / SEARCH_TRIALS / SEARCH_FIT
E_HAS_MEMO = _ENCODE("has_memo")
E_CHUNK = _ENCODE("chunk")  # token rows per loop step of the intake and tail kernels
E_DC = _ENCODE("dc")  # channels per encode program: head_dim for token-axis codes (their scales span it), else rc
E_GBP = _ENCODE("gbp")  # gbp x rpp: the (blocks, positions) tile the memo decodes a group of several blocks in
E_RPP = _ENCODE("rpp")  # (gbp * rpp >= 16)


class EncodeTiles(_ENCODE.namedtuple()):
    """The append kernels' shape constexprs (its fields: the ``E_*`` declarations above, in tuple order)."""

    __slots__ = ()

    @classmethod
    def of(cls, plan: StoredFormPlan, has_memo: bool) -> EncodeTiles:
        dp = pow2(plan.head_dim, 16)
        stored = plan.group_blocks * pow2(plan.rows if plan.jpeg else plan.block_size)
        rc = min(32, dp)
        rpp = pow2(plan.block_size)
        return cls(head_dim=plan.head_dim, dp=dp, gp=pow2(plan.group, 16), rp=pow2(stored, 16), rc=rc,
                   window=plan.window, is_jpeg=plan.jpeg, quant=plan.quantized, search=plan.search,
                   has_memo=has_memo, chunk=_CHUNK, dc=dp if plan.form == TOKEN_CODES else rc,
                   gbp=max(pow2(plan.group_blocks), -(-16 // rpp)), rpp=rpp)

    def constexpr(self) -> tuple:
        return tuple(self)


# --- device helpers ---------------------------------------------------------------------------------------------

@triton.jit
def _work_rows(tail, new, NS, b, h, bh, w, d, ok, start, length, T, TAIL: tl.constexpr, D: tl.constexpr):
    """Rows ``w`` of the reference's work buffer (position ``start + w``): new token ``start + w - length`` when it
    exists, else old tail row ``w`` (zeros past the tail), fp32; zero where not ``ok``."""
    sn0, sn1, sn2, sn3 = NS
    token = start + w - length
    ok = ok & (d < D) & (w >= 0)
    is_new = ok & (token >= 0) & (token < T)
    x = tl.load(new + b * sn0 + h * sn1 + token * sn2 + d * sn3, mask=is_new, other=0.0).to(tl.float32)
    x += tl.load(tail + (bh * TAIL + w) * D + d, mask=ok & (token < 0) & (w < TAIL), other=0.0).to(tl.float32)
    return x


@triton.jit
def _advance(start, end, WINDOW: tl.constexpr, G: tl.constexpr):
    """``state.advance``: the archive's end after appending up to ``end``."""
    return start + tl.maximum(end - start - WINDOW, 0) // G * G


@triton.jit
def _fp16_toward(x, UP: tl.constexpr):
    """``quant.fp16_toward``: the nearest fp16 value ``>= x`` (``UP``) or ``<= x``, in fp32 (clamped to the fp16
    range): scales round up and zero points down, so the stored grid covers what the unrounded one covered."""
    half = tl.minimum(tl.maximum(x, -_FP16_MAX), _FP16_MAX).to(tl.float16)
    near = half.to(tl.float32)
    if UP:
        off = near < x
    else:
        off = near > x
    off = off & (tl.abs(x) <= _FP16_MAX)
    bits = half.to(tl.int16, bitcast=True).to(tl.int32)
    negative = bits < 0
    if UP:
        grow = ~negative  # away from zero: up from a positive value, down from a negative one
    else:
        grow = negative
    magnitude = tl.where(grow, (bits & 0x7FFF) + 1, (bits & 0x7FFF) - 1)
    crossing = magnitude < 0  # from a zero of the other sign: the smallest subnormal of the direction's sign
    negative = tl.where(crossing, not UP, negative)
    magnitude = tl.where(crossing, 1, magnitude)
    stepped = tl.where(negative, magnitude - 32768, magnitude).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where(off, stepped.to(tl.float32), near)


@triton.jit
def _candidate(base, zero0, fac, n1, kind_s):
    """``Quantizer._candidates`` for one clipping factor: the fp16 ``(scale, zero)`` (uniform grids keep their
    middle: zero point rounded down, then the scale that reaches the top rounded up; other kinds: no zero)."""
    s = base * fac
    mid = zero0 + base * n1 / 2
    low = _fp16_toward(mid - s * n1 / 2, False)
    uniform = kind_s == KIND_UNIFORM
    scale = _fp16_toward(tl.where(uniform, tl.math.div_rn(mid + s * n1 / 2 - low, n1), s), True)
    return scale, tl.where(uniform, low, 0.0)


@triton.jit
def _round_half_even(x):
    """``torch.round``: nearest integer, ties to even."""
    f = tl.floor(x)
    diff = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((diff > 0.5) | ((diff == 0.5) & odd), f + 1.0, f)


@triton.jit
def nearest_codes(x, s, z, bits, kind, j, levels, F: tl.constexpr):
    """Codes (int32) of the levels nearest to ``x`` for scale ``s`` and zero ``z`` (all broadcast): grids round half
    to even and clamp to their code range (``int`` skips code 0), Lloyd-Max rows count the level midpoints below."""
    W: tl.constexpr = F[F_LEVELS_W]
    LOG_W: tl.constexpr = W.bit_length() - 1
    LLOYD: tl.constexpr = F[F_LLOYD]
    y = tl.math.div_rn(x - z, tl.where(s > 0, s, 1.0))
    top = (1 << bits) - 1
    off = tl.where(kind == KIND_INT, -((1 << bits) >> 1).to(tl.float32),
                   tl.where(kind == KIND_UNIFORM, 0.0, 0.5 - ((1 << bits) >> 1).to(tl.float32)))
    code = _round_half_even(y - off)
    code = tl.minimum(tl.maximum(code, tl.where(kind == KIND_INT, 1.0, 0.0)), top.to(tl.float32)).to(tl.int32)
    if LLOYD:
        # the number of level midpoints below y (torch.bucketize), by binary lifting over the sorted midpoints
        count = tl.zeros(code.shape, tl.int32)
        for k in tl.static_range(LOG_W):
            active = ((W >> 1) >> k) <= top
            mid = count + ((W >> 1) >> k) - 1
            lo = tl.load(levels + j * W + mid, mask=active, other=0.0)
            hi = tl.load(levels + j * W + mid + 1, mask=active, other=0.0)
            count = tl.where(active & ((hi + lo) / 2 < y), count + ((W >> 1) >> k), count)
        code = tl.where(kind == KIND_LLOYD, count, code)
    return code


@triton.jit
def _level(code, bits, kind, j, levels, ok, F: tl.constexpr):
    """``level[code]``, fp32: affine grids by arithmetic, Lloyd-Max rows from the level table."""
    W: tl.constexpr = F[F_LEVELS_W]
    LLOYD: tl.constexpr = F[F_LLOYD]
    half = ((1 << bits) >> 1).to(tl.float32)
    value = code.to(tl.float32) - tl.where(kind == KIND_INT, half, tl.where(kind == KIND_UNIFORM, 0.0, half - 0.5))
    if LLOYD:
        value = tl.where(kind == KIND_LLOYD, tl.load(levels + j * W + code, mask=ok & (kind == KIND_LLOYD), other=0.0),
                         value)
    return value


@triton.jit
def base_scales(x, ok, bits, kind, axis: tl.constexpr, count):
    """Each slice's no-clipping ``(scale, zero)`` before the search (``levels.base_scale``; ``int`` / ``midrise``
    classes of several rows share the largest step any row needs), reducing ``x`` over ``axis`` where ``ok``."""
    step = tl.where(kind == KIND_INT, ((1 << bits) >> 1) - 1, (1 << bits) >> 1).to(tl.float32)
    amax = tl.max(tl.where(ok, tl.math.div_rn(tl.abs(x), tl.where(step > 0, step, 1.0)), 0.0), axis)
    low = tl.min(tl.where(ok, x, float("inf")), axis)
    high = tl.max(tl.where(ok, x, float("-inf")), axis)
    rms = tl.sqrt_rn(tl.math.div_rn(tl.sum(tl.where(ok, x * x, 0.0), axis), count))
    return amax, low, high, rms


@triton.jit
def _fp16_nearest(x):
    """``quant.fp16_nearest``: the nearest fp16 value (ties to even) of fp32 ``x``, clamped to the fp16 range."""
    return tl.minimum(tl.maximum(x, -_FP16_MAX), _FP16_MAX).to(tl.float16).to(tl.float32)


@triton.jit
def search_scales(x, ok, bits, kind, j, levels, factors, amax, low, high, rms, kind_s, bits_s, j_s,
                  axis: tl.constexpr, F: tl.constexpr, SEARCH: tl.constexpr):
    """The fp16 ``(scale, zero, codes)`` of each slice (``Quantizer.quantize``): ``SEARCH`` 0 the no-clipping scale,
    1 the least squared error over the clipping factors (``Quantizer._candidates`` then the argmin; the first of
    equal errors), 2 "fit" (``Quantizer._fit``: the start line of row ``j_s``'s class, then ``FIT_ROUNDS`` times
    nearest codes and their least-squares scale; ``codes`` are the last pass's, zeros for the other searches:
    their callers take the nearest codes of the scale), given the slice's kind / bits."""
    n1 = ((1 << bits_s) - 1).to(tl.float32)
    base = tl.where(kind_s == KIND_UNIFORM, tl.math.div_rn(high - low, n1), tl.where(kind_s == KIND_LLOYD, rms, amax))
    zero0 = tl.where(kind_s == KIND_UNIFORM, low, 0.0)
    code = tl.zeros(x.shape, tl.int32)
    if SEARCH == 2:
        K: tl.constexpr = F[F_ROWS]
        line_a = tl.load(factors + 2 * FACTOR_SLOTS + j_s)
        line_c = tl.load(factors + 2 * FACTOR_SLOTS + K + j_s)
        ratio = tl.math.div_rn(tl.max(tl.where(ok, tl.abs(x), 0.0), axis), tl.where(base > 0, base, 1.0))
        start = tl.minimum(tl.maximum(ratio * line_a + line_c, _FIT_LO), _FIT_HI)
        best_s, best_z = _candidate(base, zero0, start, n1, kind_s)
        count = tl.sum(ok.to(tl.float32), axis)
        for _round in tl.static_range(_FIT_ROUNDS):
            if axis == 1:
                sb, zb = best_s[:, None], best_z[:, None]
            else:
                sb, zb = best_s[None, :], best_z[None, :]
            code = nearest_codes(x, sb, zb, bits, kind, j, levels, F)
            lv = tl.where(ok, _level(code, bits, kind, j, levels, ok, F), 0.0)
            sxl = tl.sum(tl.where(ok, x * lv, 0.0), axis)
            sll = tl.sum(lv * lv, axis)
            fit = tl.math.div_rn(sxl, tl.where(sll > 0, sll, 1.0))
            sx = tl.sum(tl.where(ok, x, 0.0), axis)
            sl = tl.sum(lv, axis)
            det = count * sll - sl * sl
            fit_u = tl.math.div_rn(count * sxl - sx * sl, tl.where(det > 0, det, 1.0))
            uniform = kind_s == KIND_UNIFORM
            fit = tl.where(uniform, fit_u, fit)
            good = tl.where(uniform, det > 0, sll > 0) & (fit > 0) & (fit <= _FP16_MAX)
            best_s = tl.where(good, _fp16_nearest(fit), best_s)
            zfit = _fp16_nearest(tl.math.div_rn(sx - best_s * sl, tl.where(count > 0, count, 1.0)))
            best_z = tl.where(uniform & good, zfit, best_z)
    else:
        best_s, best_z = _candidate(base, zero0, 1.0, n1, kind_s)
    if SEARCH == 1:
        best_err = tl.full(base.shape, float("inf"), tl.float32)
        lloyd = kind_s == KIND_LLOYD
        for f in tl.static_range(FACTOR_SLOTS):
            fac = tl.load(factors + tl.where(lloyd, FACTOR_SLOTS, 0) + f)
            f_ok = f < tl.where(lloyd, N_LLOYD, N_SHRINK)
            s, z = _candidate(base, zero0, fac, n1, kind_s)
            if axis == 1:
                sb, zb = s[:, None], z[:, None]
            else:
                sb, zb = s[None, :], z[None, :]
            code = nearest_codes(x, sb, zb, bits, kind, j, levels, F)
            err = _level(code, bits, kind, j, levels, ok, F) * sb + zb - x
            err = tl.sum(tl.where(ok, err * err, 0.0), axis)
            better = f_ok & (err < best_err)
            best_err = tl.where(better, err, best_err)
            best_s = tl.where(better, s, best_s)
            best_z = tl.where(better, z, best_z)
    return best_s, best_z, code


@triton.jit
def _column(x, dd, t):
    """Column ``t`` of a ``(M, DC)`` tile (channels ``dd (1, DC)``) as an ``(M,)`` vector (exact: one term)."""
    return tl.sum(tl.where(dd == t, x, 0), 1)


@triton.jit
def _subset(state, branch):
    """``trellis.subset``: the subset (0..3) branch ``branch`` leaves ``state`` on."""
    return ((state >> 1) & 1) | (((branch ^ state ^ (state >> 2)) & 1) << 1)


@triton.jit
def _gather(tile, col, N: tl.constexpr):
    """``tile[:, col]`` of an ``(M, N)`` tile at the columns ``col (S,)``: ``(M, S)`` (exact: one term each)."""
    pick = tl.arange(0, N)[None, None, :] == col[None, :, None]
    return tl.sum(tl.where(pick, tile[:, None, :], 0), 2)


@triton.jit
def _viterbi(x, row_ok, s, bits, j, levels, dd, F: tl.constexpr, D: tl.constexpr):
    """``trellis.viterbi`` of the rows ``x (M, DC)`` (DC: the whole head_dim ``D``) at scales ``s (M,)``: ``(codes
    (M, DC) int32, cost (M,), levels (M, DC))``, the path's unscaled alphabet values. Each step's decisions (per next
    state the odd predecessor's bit and the level) are packed into one int32 per row (8 nibbles), kept in a tile like
    ``x`` for the traceback; the tie rules and the sums' order are the reference's."""
    W: tl.constexpr = F[F_LEVELS_W]
    M: tl.constexpr = x.shape[0]
    n = tl.arange(0, TCQ_STATES)
    pred = 2 * (n & 3)  # the even predecessor of each next state; both take branch n >> 2
    sub_even, sub_odd = _subset(pred, n >> 2), _subset(pred + 1, n >> 2)
    q = tl.arange(0, 4)
    per = 1 << (bits - 1)  # levels per subset
    cost = tl.where(n[None, :] == 0, 0.0, float("inf")) + tl.zeros((M, TCQ_STATES), tl.float32)
    trace = tl.zeros(x.shape, tl.int32)
    for t in range(D):
        xt = _column(x, dd, t)
        best = tl.full((M, 4), float("inf"), tl.float32)
        idx = tl.zeros((M, 4), tl.int32)
        for i in tl.static_range(TCQ_MAX_PER_SUBSET):  # the nearest level of each subset (ties: the lower)
            has = (i < per) & row_ok
            a = tl.load(levels + (j * W + i * 4)[:, None] + q[None, :], mask=has[:, None], other=0.0)
            diff = xt[:, None] - a * s[:, None]
            err = diff * diff
            closer = has[:, None] & (err < best)
            best = tl.where(closer, err, best)
            idx = tl.where(closer, i, idx)
        c_even = _gather(cost, pred, TCQ_STATES) + _gather(best, sub_even, 4)
        c_odd = _gather(cost, pred + 1, TCQ_STATES) + _gather(best, sub_odd, 4)
        odd = c_odd < c_even  # ties: the even predecessor
        level = tl.where(odd, _gather(idx, sub_odd, 4), _gather(idx, sub_even, 4))
        cost = tl.where(odd, c_odd, c_even)
        packed = tl.sum((level * 2 + odd.to(tl.int32)) << (4 * n)[None, :], 1)  # disjoint nibbles: the sum is the OR
        trace = tl.where(dd == t, packed[:, None], trace)
    final = tl.min(cost, 1)
    state = tl.min(tl.where(cost == final[:, None], n[None, :], TCQ_STATES), 1)  # the cheapest end (ties: lowest)
    codes = tl.zeros(x.shape, tl.int32)
    values = tl.zeros(x.shape, tl.float32)
    for back in range(D):
        t = D - 1 - back
        nibble = (_column(trace, dd, t) >> (4 * state)) & 15
        level = nibble >> 1
        branch = state >> 2
        prev = 2 * (state & 3) + (nibble & 1)
        a = tl.load(levels + j * W + ((level << 2) | _subset(prev, branch)), mask=row_ok, other=0.0)
        codes = tl.where(dd == t, ((level << 1) | branch)[:, None], codes)
        values = tl.where(dd == t, a[:, None], values)
        state = prev
    return codes, final, values


@triton.jit
def trellis_encode(x, row_ok, bits, j, levels, factors, dd, F: tl.constexpr, D: tl.constexpr, SEARCH: tl.constexpr):
    """``trellis.encode`` of the rows ``x (M, DC)`` (the whole head_dim ``D``; rows not ``row_ok`` ignored): ``(codes
    (M, DC) int32, scale (M,))``, the scale an fp16 value. The RMS, a Viterbi path at each of row ``j``'s candidate
    scales (``factors``' trellis slots: ``trellis.scale_factors``; the cheapest kept, ties: the first), then
    (``SEARCH`` nonzero) the least-squares refit; every sum sequential along the row as the reference's (the launch
    turns off FMA contraction)."""
    M: tl.constexpr = x.shape[0]
    K: tl.constexpr = F[F_ROWS]
    acc = tl.zeros((M,), tl.float32)
    for t in range(D):
        xt = _column(x, dd, t)
        acc = acc + xt * xt
    rms = tl.sqrt_rn(tl.math.div_rn(acc, D * 1.0))
    slots = factors + 2 * FACTOR_SLOTS + 2 * K + j * TCQ_SLOTS  # (M,): each row's first candidate
    listed = tl.load(slots[:, None] + tl.arange(0, TCQ_SLOTS)[None, :], mask=row_ok[:, None], other=0.0)
    candidates = tl.max(tl.sum((listed > 0).to(tl.int32), 1), 0)
    s = _fp16_toward(rms * tl.load(slots, mask=row_ok, other=1.0), True)
    codes, cost, values = _viterbi(x, row_ok, s, bits, j, levels, dd, F, D)
    for f in range(1, candidates):
        factor = tl.load(slots + f, mask=row_ok, other=0.0)
        s2 = _fp16_toward(rms * factor, True)
        codes2, cost2, values2 = _viterbi(x, row_ok, s2, bits, j, levels, dd, F, D)
        take = (factor > 0) & (cost2 < cost)  # ties: the first
        codes = tl.where(take[:, None], codes2, codes)
        values = tl.where(take[:, None], values2, values)
        cost = tl.where(take, cost2, cost)
        s = tl.where(take, s2, s)
    if SEARCH != 0:
        num = tl.zeros((M,), tl.float32)
        den = tl.zeros((M,), tl.float32)
        for t in range(D):
            lt = _column(values, dd, t)
            num = num + lt * _column(x, dd, t)
            den = den + lt * lt
        fit_ok = (den > 0) & (num > 0)
        fit = tl.where(fit_ok, tl.math.div_rn(num, tl.where(fit_ok, den, 1.0)), 0.0)
        fit = tl.minimum(fit, _FP16_MAX).to(tl.float16).to(tl.float32)
        err = tl.zeros((M,), tl.float32)
        for t in range(D):
            diff = _column(values, dd, t) * fit - _column(x, dd, t)
            err = err + diff * diff
        s = tl.where(fit_ok & (err < cost), fit, s)
    return codes, s


@triton.jit
def _store_slice(data, code, blk, bits, bit_off, row_ok, c0, w: tl.constexpr, F: tl.constexpr, D: tl.constexpr,
                 DC: tl.constexpr):
    """Store the ``w``-bit slice of codes ``(RP, DC)`` of channels ``c0 .. c0 + DC - 1``: row ``r``'s at byte
    ``(bit_off + shift) * D / 8`` of block ``blk[r]``, channel ``d`` at byte ``d * w // 8``, bit ``d * w % 8`` (rows
    without that slice: nothing). ``c0`` is a multiple of 8, so a chunk's channels fill whole bytes."""
    ROW_BYTES: tl.constexpr = F[F_ROW_BYTES]
    PB: tl.constexpr = 8 // w
    has = row_ok & ((bits & w) != 0)
    shift = bits - (bits & (2 * w - 1))
    part = (code >> shift[:, None]) & ((1 << w) - 1)
    weight = (tl.arange(0, PB) * w)[None, None, :]
    packed = tl.sum(tl.reshape(part, (code.shape[0], DC // PB, PB)) << weight, axis=2)
    byte = c0 // PB + tl.arange(0, DC // PB)
    ptr = data + (blk * ROW_BYTES + (bit_off + shift) * (D // 8))[:, None] + byte[None, :]
    tl.store(ptr, packed.to(tl.uint8), mask=has[:, None] & (byte[None, :] < D // PB))


@triton.jit
def _store_codes(data, code, blk, bits, bit_off, row_ok, c0, F: tl.constexpr, D: tl.constexpr, DC: tl.constexpr):
    """Pack codes ``(RP, DC)`` into the power-of-two bit slices their rows use (``codecs/pack.py``)."""
    SLICES: tl.constexpr = F[F_SLICES]
    if (SLICES & 8) != 0:
        _store_slice(data, code, blk, bits, bit_off, row_ok, c0, 8, F, D, DC)
    if (SLICES & 4) != 0:
        _store_slice(data, code, blk, bits, bit_off, row_ok, c0, 4, F, D, DC)
    if (SLICES & 2) != 0:
        _store_slice(data, code, blk, bits, bit_off, row_ok, c0, 2, F, D, DC)
    if (SLICES & 1) != 0:
        _store_slice(data, code, blk, bits, bit_off, row_ok, c0, 1, F, D, DC)


@triton.jit
def _quantize(coef, data, scale, zero, rows_t, levels, factors, grp, c0, F: tl.constexpr, E: tl.constexpr):
    """Quantize the stored rows ``coef (RP, DC)`` (row ``n * KP + j``: row ``j`` of block ``n`` of the group; channels
    ``c0 ..``) of linear group ``grp`` and store codes, scales and zero points."""
    FORM: tl.constexpr = F[F_FORM]
    K: tl.constexpr = F[F_ROWS]
    KP: tl.constexpr = F[F_DENSE_P]
    GB: tl.constexpr = F[F_GROUP_BLOCKS]
    C: tl.constexpr = F[F_CLASSES]
    Z: tl.constexpr = F[F_ZEROS]
    D: tl.constexpr = E[E_D]
    RP: tl.constexpr = E[E_RP]
    DC: tl.constexpr = E[E_DC]
    SEARCH: tl.constexpr = E[E_SEARCH]
    TCQ: tl.constexpr = F[F_TCQ]  # trellis rows (token axis only)
    c = tl.arange(0, RP)
    n = c // KP
    j = c % KP
    row_ok = (n < GB) & (j < K)
    dd = c0 + tl.arange(0, DC)
    ok = row_ok[:, None] & (dd[None, :] < D)
    bits = tl.load(rows_t + j, mask=row_ok, other=1)
    bit_off = tl.load(rows_t + ROW_BIT_OFFSET * K + j, mask=row_ok, other=0)
    cls = tl.load(rows_t + ROW_CLASS * K + j, mask=row_ok, other=0)
    zslot = tl.load(rows_t + ROW_ZERO_SLOT * K + j, mask=row_ok, other=-1)
    kind = tl.load(rows_t + ROW_KIND * K + j, mask=row_ok, other=0)
    x = tl.where(ok, coef, 0.0)
    bits2, kind2, j2 = bits[:, None], kind[:, None], j[:, None]
    if FORM == _CHANNEL_CODES:
        # one scale (and zero point) per (class, channel) over the group's rows of that class
        s_rows = tl.zeros((RP, DC), tl.float32)
        z_rows = tl.zeros((RP, DC), tl.float32)
        code_rows = tl.zeros((RP, DC), tl.int32)
        for k in tl.static_range(C):
            in_k = ok & (cls == k)[:, None]
            count = tl.sum(in_k.to(tl.float32), 0)
            kind_k = tl.load(rows_t + ROW_KIND * K + k + tl.zeros_like(dd))  # class k's level kind: row k's (DC 0, AC 1)
            bits_k = tl.load(rows_t + k + tl.zeros_like(dd))
            amax, low, high, rms = base_scales(x, in_k, bits2, kind2, 0, tl.where(count > 0, count, 1.0))
            s, z, fit_code = search_scales(x, in_k, bits2, kind2, j2, levels, factors, amax, low, high, rms, kind_k,
                                           bits_k, k + tl.zeros_like(dd), 0, F, SEARCH)
            d_ok = dd < D
            tl.store(scale + (grp * C + k) * D + dd, s.to(tl.float16), mask=d_ok)
            if Z > 0:
                slot = tl.load(rows_t + ROW_ZERO_SLOT * K + k + tl.zeros_like(dd))
                tl.store(zero + (grp * Z + slot) * D + dd, z.to(tl.float16), mask=d_ok & (slot >= 0))
            s_rows = tl.where(in_k, s[None, :], s_rows)
            z_rows = tl.where(in_k, z[None, :], z_rows)
            code_rows = tl.where(in_k, fit_code, code_rows)
    else:
        # token axis: every row its own class, one scale over head_dim (the chunk is the whole head_dim)
        amax, low, high, rms = base_scales(x, ok, bits2, kind2, 1, D * 1.0)
        s, z, code_rows = search_scales(x, ok, bits2, kind2, j2, levels, factors, amax, low, high, rms, kind, bits, j,
                                        1, F, SEARCH)
        if TCQ:  # trellis rows: the Viterbi encoder's codes and scale
            tcq_rows = kind == KIND_TCQ
            tcq_code, tcq_s = trellis_encode(x, row_ok & tcq_rows, bits, j, levels, factors, dd[None, :], F, D,
                                             SEARCH)
            s = tl.where(tcq_rows, tcq_s, s)
        tl.store(scale + grp * C + j, s.to(tl.float16), mask=row_ok)
        if Z > 0:
            tl.store(zero + grp * Z + zslot, z.to(tl.float16), mask=row_ok & (zslot >= 0))
        s_rows = s[:, None] + tl.zeros((RP, DC), tl.float32)
        z_rows = z[:, None] + tl.zeros((RP, DC), tl.float32)
    if SEARCH == 2:  # "fit": the codes of its last pass
        code = tl.where(ok, code_rows, 0)
    else:
        code = tl.where(ok, nearest_codes(x, s_rows, z_rows, bits2, kind2, j2, levels, F), 0)
    if TCQ:
        code = tl.where(ok & tcq_rows[:, None], tcq_code, code)
    _store_codes(data, code, grp * GB + n, bits, bit_off, row_ok, c0, F, D, DC)


@triton.jit
def _png_rows(x, x_prev, i, dd, d1, data, index, grp, F: tl.constexpr, E: tl.constexpr):
    """png: anchor + fp32 deltas of one block (``x`` rows ``i``, ``x_prev`` rows ``i - 1``, channels ``dd`` as a
    ``(1, DC)`` tile and ``d1`` as a vector), stored;
    pruned: the ``KEPT`` largest deltas per channel (ties to the earlier position) in decreasing magnitude, with
    their uint8 positions."""
    R: tl.constexpr = F[F_R]
    ROWS: tl.constexpr = F[F_ROWS]
    KEPT: tl.constexpr = F[F_KEPT]
    FORM: tl.constexpr = F[F_FORM]
    D: tl.constexpr = E[E_D]
    GP: tl.constexpr = E[E_GP]
    ok_d = dd < D
    dense = tl.where(i == 0, x, x - x_prev)
    dense = tl.where(i < R, dense, 0.0)
    base = data + grp * (ROWS * D)
    if FORM == _PRUNED_ROWS:
        mag = tl.abs(dense)
        j3 = tl.arange(0, GP)[None, :, None]
        i3 = tl.arange(0, GP)[:, None, None]
        a_i = tl.expand_dims(mag, 1)
        a_j = tl.expand_dims(mag, 0)
        beats = (j3 >= 1) & (j3 < R) & ((a_j > a_i) | ((a_j == a_i) & (j3 < i3)))
        rank = tl.sum(beats.to(tl.int32), axis=1)
        delta_row = (i >= 1) & (i < R)
        tl.store(base + i * D + dd, x, mask=(i == 0) & ok_d)
        for m in tl.static_range(KEPT):
            sel = delta_row & (rank == m)
            val = tl.sum(tl.where(sel, dense, 0.0), axis=0)
            pos = tl.sum(tl.where(sel, i - 1, 0), axis=0)
            tl.store(base + (1 + m) * D + d1, val, mask=d1 < D)
            tl.store(index + grp * (KEPT * D) + m * D + d1, pos.to(tl.uint8), mask=d1 < D)
    else:
        tl.store(base + i * D + dd, dense, mask=(i < R) & ok_d)


@triton.jit
def _block_matrix(ptr, F: tl.constexpr, E: tl.constexpr, SYNTHESIS: tl.constexpr):
    """The group's block-diagonal DCT matrix: analysis ``(RP, GP)`` (entry ``((n, j), w) = M[j, w - n r]``) or
    synthesis ``(GP, RP)`` (``A[w - n r, j]``), zero outside the blocks."""
    R: tl.constexpr = F[F_R]
    K: tl.constexpr = F[F_ROWS]
    KP: tl.constexpr = F[F_DENSE_P]
    GB: tl.constexpr = F[F_GROUP_BLOCKS]
    GP: tl.constexpr = E[E_GP]
    RP: tl.constexpr = E[E_RP]
    if SYNTHESIS:
        c = tl.arange(0, RP)[None, :]
        w = tl.arange(0, GP)[:, None]
    else:
        c = tl.arange(0, RP)[:, None]
        w = tl.arange(0, GP)[None, :]
    n = c // KP
    j = c % KP
    i = w - n * R
    ok = (n < GB) & (j < K) & (i >= 0) & (i < R)
    if SYNTHESIS:
        out = tl.load(ptr + i * K + j, mask=ok, other=0.0)
    else:
        out = tl.load(ptr + j * R + i, mask=ok, other=0.0)
    return out


@triton.jit
def _analysis_blocks(x, analysis, F: tl.constexpr, E: tl.constexpr):
    """``M[:K] @ X`` of every block of the group rows ``x (GB r, DC)``, position by position: ``(GB KP, DC)`` rows
    ``n KP + j`` (a block-diagonal product would hold ``GB`` times the matrix it needs). For groups of several
    blocks whose positions and stored rows fill the tiles exactly (``GB r = GP``, ``GB KP = RP``)."""
    R: tl.constexpr = F[F_R]
    K: tl.constexpr = F[F_ROWS]
    KP: tl.constexpr = F[F_DENSE_P]
    GB: tl.constexpr = F[F_GROUP_BLOCKS]
    DC: tl.constexpr = E[E_DC]
    x3 = tl.reshape(x, (GB, R, DC))
    i = tl.arange(0, R)[None, :, None]
    j = tl.arange(0, KP)
    coef = tl.zeros((GB, KP, DC), tl.float32)
    for r in tl.static_range(R):
        x_r = tl.sum(tl.where(i == r, x3, 0.0), axis=1)  # position r of every block, (GB, DC)
        m = tl.load(analysis + j * R + r, mask=j < K, other=0.0)  # column r of the analysis matrix
        coef += m[None, :, None] * x_r[:, None, :]
    return tl.reshape(coef, (GB * KP, DC))


@triton.jit
def _archives(start, length, T, k, NG, F: tl.constexpr, E: tl.constexpr):
    """``(whether this append archives group k of the work buffer, its archive slot)``: when ``advance`` moves the
    archive past it and the slot exists (never past the capacity ``NG``: a longer length records the overflow)."""
    G: tl.constexpr = F[F_R] * F[F_GROUP_BLOCKS]
    first = (start - F[F_SINKS]) // G
    return (start + (k + 1) * G <= _advance(start, length + T, E[E_WINDOW], G)) & (first + k < NG), first + k


# --- kernels ----------------------------------------------------------------------------------------------------

@triton.jit
def _intake_kernel(sink, mean, memo, len_ptr, new, sn0, sn1, sn2, sn3, H, T, MEMO_CAP,
                   F: tl.constexpr, E: tl.constexpr):
    """Program ``bh``: sink rows from the new tokens at positions ``< sinks``; the per-channel mean of the first
    append that reaches past the sinks (its non-sink tokens); the new tokens' raw rows in the memo."""
    SINKS: tl.constexpr = F[F_SINKS]
    CENTER: tl.constexpr = F[F_CENTER]
    D: tl.constexpr = E[E_D]
    DP: tl.constexpr = E[E_DP]
    HAS_MEMO: tl.constexpr = E[E_HAS_MEMO]
    CH: tl.constexpr = E[E_CHUNK]
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    length = tl.load(len_ptr)
    dd = tl.arange(0, DP)
    src = new + b * sn0 + h * sn1 + dd[None, :] * sn3
    if SINKS > 0:
        s = tl.arange(0, CH)
        for s0 in tl.static_range(0, SINKS, CH):
            token = s0 + s - length
            ok = ((s0 + s < SINKS) & (token >= 0) & (token < T))[:, None] & (dd[None, :] < D)
            x = tl.load(src + token[:, None] * sn2, mask=ok, other=0.0)
            tl.store(sink + (bh * SINKS + s0 + s)[:, None] * D + dd[None, :], x, mask=ok)
    if CENTER:
        total = tl.zeros((DP,), tl.float32)
        count = tl.zeros((DP,), tl.float32)
        for c0 in range(0, T, CH):
            t = c0 + tl.arange(0, CH)
            counted = (t < T) & (length + t >= SINKS)
            x = tl.load(src + t[:, None] * sn2, mask=counted[:, None] & (dd[None, :] < D), other=0.0)
            total += tl.sum(x.to(tl.float32), 0)
            count += tl.sum(counted.to(tl.float32), 0)
        first = (length + tl.zeros_like(dd) <= SINKS) & (length + T + tl.zeros_like(dd) > SINKS)
        tl.store(mean + bh * D + dd, tl.math.div_rn(total, tl.maximum(count, 1.0)), mask=first & (dd < D))
    if HAS_MEMO:
        for c0 in range(0, T, CH):
            t = c0 + tl.arange(0, CH)
            pos = length + t
            ok = ((t < T) & (pos < MEMO_CAP))[:, None] & (dd[None, :] < D)
            x = tl.load(src + t[:, None] * sn2, mask=ok, other=0.0)
            tl.store(memo + (bh * MEMO_CAP + pos)[:, None] * D + dd[None, :], x, mask=ok)


@triton.jit
def encode_group(ST, TB, tail, new, NS, b, h, bh, k, grp, c0, start, length, T, F: tl.constexpr, E: tl.constexpr):
    """Encode channels ``c0 .. c0 + DC - 1`` of group ``k`` of the work buffer (rows ``start + k * G ..``:
    :func:`_work_rows` of ``tail`` and the ``T`` tokens of ``new``, strides ``NS``) and store them in linear archive
    group ``grp``: centered, rotated, DCT or png deltas, quantized and packed. ``ST``: the archive's pointers
    ``(data, scale, zero, index, mean)``; ``TB``: the tables ``(rotation, rows, levels, analysis, factors)``."""
    data, scale, zero, index, mean = ST
    rot, rows_t, levels, analysis, factors = TB
    R: tl.constexpr = F[F_R]
    G: tl.constexpr = R * F[F_GROUP_BLOCKS]
    TAIL: tl.constexpr = F[F_TAIL]
    ROTATE: tl.constexpr = F[F_ROTATE]
    CENTER: tl.constexpr = F[F_CENTER]
    K: tl.constexpr = F[F_ROWS]
    D: tl.constexpr = E[E_D]
    DP: tl.constexpr = E[E_DP]
    GP: tl.constexpr = E[E_GP]
    RC: tl.constexpr = E[E_RC]
    DC: tl.constexpr = E[E_DC]
    IS_JPEG: tl.constexpr = E[E_IS_JPEG]
    QUANT: tl.constexpr = E[E_QUANT]
    GB: tl.constexpr = F[F_GROUP_BLOCKS]
    # the DCT block by block (:func:`_analysis_blocks`) when the group's blocks fill the tiles exactly
    BLOCKWISE: tl.constexpr = (GB > 1) & (GB * R == GP) & (GB * F[F_DENSE_P] == E[E_RP])
    w = tl.arange(0, GP)[:, None]
    dd = c0 + tl.arange(0, DC)[None, :]
    row = k * G + w
    in_group = w < G
    if ROTATE:
        # centered then rotated: (x - mean) @ R^T, this chunk's output channels, all input channels by chunks (a
        # loop, not unrolled: unrolled, sm_90's ptxas spilled 2.6 KB per thread of the DCT keys' 128-token groups)
        x = tl.zeros((GP, DC), tl.float32)
        for c in range(DP // RC):
            di = c * RC + tl.arange(0, RC)
            xc = _work_rows(tail, new, NS, b, h, bh, row, di[None, :], in_group, start, length, T, TAIL, D)
            if CENTER:
                xc -= tl.load(mean + bh * D + di, mask=di < D, other=0.0)[None, :]
            rt = tl.load(rot + dd * D + di[:, None], mask=(di[:, None] < D) & (dd < D), other=0.0)
            x += tl.dot(tl.where(in_group & (di[None, :] < D), xc, 0.0), rt, input_precision="ieee")
    else:
        x = _work_rows(tail, new, NS, b, h, bh, row, dd, in_group, start, length, T, TAIL, D)
        if CENTER:
            x = tl.where(in_group & (dd < D), x - tl.load(mean + bh * D + dd, mask=dd < D, other=0.0), 0.0)
    if IS_JPEG:
        if R == 1:
            coef = x
        elif BLOCKWISE:
            coef = _analysis_blocks(x, analysis, F, E)
        else:
            coef = tl.dot(_block_matrix(analysis, F, E, False), x, input_precision="ieee")
        if QUANT:
            _quantize(coef, data, scale, zero, rows_t, levels, factors, grp, c0, F, E)
        else:
            jr = tl.arange(0, E[E_RP])[:, None]
            tl.store(data + (grp * K + jr) * D + dd, coef.to(data.dtype.element_ty), mask=(jr < K) & (dd < D))
    else:
        prev = _work_rows(tail, new, NS, b, h, bh, row - 1, dd, in_group & (w >= 1), start, length, T, TAIL, D)
        _png_rows(x, prev, w, dd, c0 + tl.arange(0, DC), data, index, grp, F, E)


@triton.jit
def _encode_kernel(data, scale, zero, index, mean, tail, len_ptr, start_ptr, new, sn0, sn1, sn2, sn3,
                   rot, rows_t, levels, analysis, factors, H, NG, T, F: tl.constexpr, E: tl.constexpr):
    """Program ``(bh, k, chunk)``: channels ``chunk * DC ..`` of group ``k`` of the work buffer (the whole head_dim
    for token-axis codes, whose scales span it), encoded (:func:`encode_group`) and stored in its archive slot when
    the append archives it (:func:`_archives`); else nothing."""
    k = tl.program_id(0)  # archive groups on the grid's first axis (up to 2**31 - 1 programs)
    bh = tl.program_id(1).to(tl.int64)
    length = tl.load(len_ptr)
    start = tl.load(start_ptr)
    write, slot = _archives(start, length, T, k, NG, F, E)
    if write:
        encode_group((data, scale, zero, index, mean), (rot, rows_t, levels, analysis, factors), tail, new,
                     (sn0, sn1, sn2, sn3), bh // H, bh % H, bh, k, bh * NG + slot, tl.program_id(2) * E[E_DC], start,
                     length, T, F, E)


@triton.jit
def _decoded(data, scale, zero, index, syn, rows_t, levels, grp, c0, F: tl.constexpr, E: tl.constexpr):
    """Channels ``c0 .. c0 + RC - 1`` of archive group ``grp`` decoded from its stored form (``A @ S`` per block, in
    the rotated space, before the mean), ``(GP, RC)`` fp32."""
    FORM: tl.constexpr = F[F_FORM]
    R: tl.constexpr = F[F_R]
    K: tl.constexpr = F[F_ROWS]
    KP: tl.constexpr = F[F_DENSE_P]
    GB: tl.constexpr = F[F_GROUP_BLOCKS]
    C: tl.constexpr = F[F_CLASSES]
    Z: tl.constexpr = F[F_ZEROS]
    D: tl.constexpr = E[E_D]
    GP: tl.constexpr = E[E_GP]
    RP: tl.constexpr = E[E_RP]
    RC: tl.constexpr = E[E_RC]
    w = tl.arange(0, GP)[:, None]
    dd = c0 + tl.arange(0, RC)[None, :]
    if E[E_IS_JPEG]:
        c = tl.arange(0, RP)
        n = c // KP
        j = c % KP
        row_ok = (n < GB) & (j < K)
        ok = row_ok[:, None] & (dd < D)
        if E[E_QUANT]:
            bits, bit_off, cls, zslot, lloyd, off = row_info(rows_t, levels, j, row_ok, F)
            code = unpack_codes(data, (grp * GB + n)[:, None], dd, ok, bits[:, None], bit_off[:, None], F, D)
            code = trellis_index(code, data, rows_t, (grp * GB + n)[:, None], j[:, None], dd, ok, bits[:, None],
                                 bit_off[:, None], F, D)
            value = level_values(code, j[:, None], lloyd[:, None], levels, ok, F) + off[:, None]
            if FORM == _CHANNEL_CODES:
                s = tl.load(scale + ((grp * C + cls) * D)[:, None] + dd, mask=ok, other=0.0).to(tl.float32)
                z = tl.load(zero + ((grp * Z + zslot) * D)[:, None] + dd, mask=ok & (zslot >= 0)[:, None],
                            other=0.0).to(tl.float32)
            else:
                s = tl.load(scale + grp * C + cls, mask=row_ok, other=0.0).to(tl.float32)[:, None]
                z = tl.load(zero + grp * Z + zslot, mask=row_ok & (zslot >= 0), other=0.0).to(tl.float32)[:, None]
            rows = tl.where(ok, value * s + z, 0.0)
        else:
            rows = tl.load(data + (grp * K + j[:, None]) * D + dd, mask=ok, other=0.0).to(tl.float32)
        if R == 1:
            xs = rows
        else:
            xs = tl.dot(_block_matrix(syn, F, E, True), rows, input_precision="ieee")
    else:
        xs = tl.cumsum(float_rows(data, index, grp, w, dd, w < R, F, D), axis=0)
    return xs


@triton.jit
def _decoded_blocks(data, scale, zero, syn, rows_t, levels, grp, c0, F: tl.constexpr, E: tl.constexpr):
    """Channels ``c0 .. c0 + RC - 1`` of a group of several blocks of channel-axis codes decoded (``A @ S`` per
    block, in the rotated space, before the mean), stored row by stored row: ``(GBP * RPP, RC)`` fp32, row ``n * RPP
    + i`` position ``i`` of block ``n`` (a block-diagonal product would hold ``GB`` times the matrix it needs)."""
    R: tl.constexpr = F[F_R]
    K: tl.constexpr = F[F_ROWS]
    GB: tl.constexpr = F[F_GROUP_BLOCKS]
    C: tl.constexpr = F[F_CLASSES]
    Z: tl.constexpr = F[F_ZEROS]
    D: tl.constexpr = E[E_D]
    RC: tl.constexpr = E[E_RC]
    GBP: tl.constexpr = E[E_GBP]
    RPP: tl.constexpr = E[E_RPP]
    n = tl.arange(0, GBP)[:, None]
    dd = c0 + tl.arange(0, RC)[None, :]
    ok = (n < GB) & (dd < D)
    i = tl.arange(0, RPP)
    xs = tl.zeros((GBP, RPP, RC), tl.float32)
    for j in tl.static_range(K):
        jj = tl.full((1,), j, tl.int32)
        bits, bit_off, cls, zslot, lloyd, off = row_info(rows_t, levels, jj, jj < K, F)
        code = unpack_codes(data, grp * GB + n, dd, ok, bits[:, None], bit_off[:, None], F, D)
        value = level_values(code, jj[:, None], lloyd[:, None], levels, ok, F) + off[:, None]
        s = tl.load(scale + (grp * C + cls[:, None]) * D + dd, mask=dd < D, other=0.0).to(tl.float32)
        z = tl.load(zero + (grp * Z + zslot[:, None]) * D + dd, mask=(dd < D) & (zslot[:, None] >= 0),
                    other=0.0).to(tl.float32)
        a = tl.load(syn + i * K + j, mask=i < R, other=0.0)  # column j of the synthesis matrix
        xs += a[None, :, None] * tl.where(ok, value * s + z, 0.0)[:, None, :]
    return tl.reshape(xs, (GBP * RPP, RC))


@triton.jit
def decode_group(ST, TB, bh, grp, chunk, F: tl.constexpr, E: tl.constexpr):
    """Output channels ``dc = chunk * RC ..`` of linear archive group ``grp`` decoded from its stored form (what
    ``codec.decode`` rebuilds: ``A @ S`` per block, rotated back from every input chunk, the mean of head ``bh``
    added). ``ST``: ``(data, scale, zero, index, mean)`` pointers; ``TB``: the tables ``(synthesis, rotation, rows,
    levels)``. Returns ``(rows (W, RC) fp32, w (W, 1): each row's position in the group (>= G: padding), dc (1,
    RC))``."""
    data, scale, zero, index, mean = ST
    syn, rot, rows_t, levels = TB
    R: tl.constexpr = F[F_R]
    G: tl.constexpr = R * F[F_GROUP_BLOCKS]
    D: tl.constexpr = E[E_D]
    DP: tl.constexpr = E[E_DP]
    RC: tl.constexpr = E[E_RC]
    # a group of several blocks of R > 1 positions (channel-axis codes only): decoded block by block
    BLOCKWISE: tl.constexpr = (F[F_GROUP_BLOCKS] > 1) & (R > 1)
    dc = chunk * RC + tl.arange(0, RC)
    if BLOCKWISE:
        c = tl.arange(0, E[E_GBP] * E[E_RPP])
        w = tl.where(c % E[E_RPP] < R, c // E[E_RPP] * R + c % E[E_RPP], G)[:, None]
    else:
        w = tl.arange(0, E[E_GP])[:, None]
    if F[F_ROTATE]:
        # back in the stream's space: xs @ R, this chunk's output channels, summed over the input chunks (a loop,
        # not unrolled: unrolled, sm_90's ptxas spilled 1.6 to 22 KB per thread of the DCT keys' 128-token groups)
        out = tl.zeros((w.shape[0], RC), tl.float32)
        for c in range(DP // RC):
            di = c * RC + tl.arange(0, RC)
            r = tl.load(rot + di[:, None] * D + dc[None, :], mask=(di[:, None] < D) & (dc[None, :] < D), other=0.0)
            if BLOCKWISE:
                xs = _decoded_blocks(data, scale, zero, syn, rows_t, levels, grp, c * RC, F, E)
            else:
                xs = _decoded(data, scale, zero, index, syn, rows_t, levels, grp, c * RC, F, E)
            out += tl.dot(xs, r, input_precision="ieee")
    elif BLOCKWISE:
        out = _decoded_blocks(data, scale, zero, syn, rows_t, levels, grp, chunk * RC, F, E)
    else:
        out = _decoded(data, scale, zero, index, syn, rows_t, levels, grp, chunk * RC, F, E)
    if F[F_CENTER]:
        out += tl.load(mean + bh * D + dc, mask=dc < D, other=0.0)[None, :]
    return out, w, dc[None, :]


@triton.jit
def _memo_kernel(data, scale, zero, index, mean, len_ptr, start_ptr, memo, syn, rot, rows_t, levels, NG, T,
                 MEMO_CAP, F: tl.constexpr, E: tl.constexpr):
    """Program ``(bh, k, chunk)``: when group ``k`` was archived by this append, output channels ``chunk * RC ..`` of
    its decoded rows (:func:`decode_group`) into the memo."""
    G: tl.constexpr = F[F_R] * F[F_GROUP_BLOCKS]
    D: tl.constexpr = E[E_D]
    k = tl.program_id(0)  # archive groups on the grid's first axis (up to 2**31 - 1 programs)
    bh = tl.program_id(1).to(tl.int64)
    length = tl.load(len_ptr)
    start = tl.load(start_ptr)
    write, slot = _archives(start, length, T, k, NG, F, E)
    if write:
        out, w, dc = decode_group((data, scale, zero, index, mean), (syn, rot, rows_t, levels), bh, bh * NG + slot,
                                  tl.program_id(2), F, E)
        pos = F[F_SINKS] + slot * G + w
        dst = memo + (bh * MEMO_CAP + pos) * D + dc
        tl.store(dst, out.to(memo.dtype.element_ty), mask=(w < G) & (pos < MEMO_CAP) & (dc < D))


@triton.jit
def _tail_kernel(tail, len_ptr, start_ptr, new, sn0, sn1, sn2, sn3, H, T, F: tl.constexpr, E: tl.constexpr):
    """Program ``bh``: tail row ``i`` becomes work row ``advance(start, end) - start + i`` (zeros past the new length);
    read ahead of writing, one chunk at a time (rows move towards the front only)."""
    R: tl.constexpr = F[F_R]
    G: tl.constexpr = R * F[F_GROUP_BLOCKS]
    TAIL: tl.constexpr = F[F_TAIL]
    D: tl.constexpr = E[E_D]
    DP: tl.constexpr = E[E_DP]
    WINDOW: tl.constexpr = E[E_WINDOW]
    CH: tl.constexpr = E[E_CHUNK]
    bh = tl.program_id(0).to(tl.int64)
    length = tl.load(len_ptr)
    start = tl.load(start_ptr)
    end = length + T
    new_start = _advance(start, end, WINDOW, G)
    shift = new_start - start
    dd = tl.arange(0, DP)[None, :]
    for i0 in tl.static_range(0, TAIL, CH):
        i = i0 + tl.arange(0, CH)[:, None]
        rows = _work_rows(tail, new, (sn0, sn1, sn2, sn3), bh // H, bh % H, bh, shift + i, dd,
                          (i < TAIL) & (new_start + i < end), start, length, T, TAIL, D)
        tl.debug_barrier()  # every row of this chunk is read before any is overwritten
        tl.store(tail + (bh * TAIL + i) * D + dd, rows.to(tail.dtype.element_ty), mask=(i < TAIL) & (dd < D))


@triton.jit
def _advance_kernel(len_ptr, start_ptr, T, F: tl.constexpr, E: tl.constexpr):
    """``start = advance(start, length + T)``; ``length += T`` (after every reader of the old values)."""
    G: tl.constexpr = F[F_R] * F[F_GROUP_BLOCKS]
    length = tl.load(len_ptr)
    start = tl.load(start_ptr)
    tl.store(start_ptr, _advance(start, length + T, E[E_WINDOW], G))
    tl.store(len_ptr, length + T)


# --- launcher ---------------------------------------------------------------------------------------------------

def triton_append(state: list[torch.Tensor], new: torch.Tensor, spec: str, memo: torch.Tensor | None = None) -> None:
    """Triton ``flashcodec::append`` (same contract and validation as
    :func:`~flashcodec_fx.ops.reference.append.append_reference`): append ``new (B, H, T, D)`` (any strides) in place; no host
    sync. State tensors and the memo must be contiguous (the cache allocates them so). Stored codes may differ from
    the reference's by one step where an fp32 sum in another order lands on a rounding tie, and the clipping search
    may pick another factor where two factors' errors tie within fp32 rounding (docs/triton.md)."""
    codec, st = check_append_args(state, new, spec, memo)
    b, h, t, d = new.shape
    check_triton_limits(codec, d)
    check_group_tokens(codec, "append")
    require_contiguous(**{f"state.{f}": x for f, x in zip(st._fields, st, strict=True)}, memo=memo)
    if t == 0 or b * h == 0:
        return
    append_stored(codec, st, new, memo, lambda stored, kept: _launch(codec, st, stored, kept, spec))


def encode_fp_fusion(plan: StoredFormPlan) -> bool:
    """The encode kernels' ``enable_fp_fusion``: off for trellis rows, whose encoder rounds every product before its
    sum as the reference does (``codecs/trellis.py``: no fused multiply-add), on otherwise."""
    return not StreamForm.of(plan).tcq


def _launch(codec: Codec, st: StreamState, new: torch.Tensor, memo: torch.Tensor | None, spec: str) -> None:
    """The append's launches over the stored domain (checked arguments, at least one token and one row)."""
    b, h, t, d = new.shape
    plan = stored_form_plan(spec, d)
    form = StreamForm.of(plan).constexpr()
    enc = EncodeTiles.of(plan, memo is not None)
    tiles = enc.constexpr()  # (the tuple the kernels take)
    tab = stream_tables(codec, d, new.device)
    ng = st.data.shape[2]
    memo_t = new if memo is None else memo
    memo_cap = 0 if memo is None else memo.shape[2]

    def some(x: torch.Tensor) -> torch.Tensor:  # empty state tensors are never read: any pointer will do
        return new if x.numel() == 0 else x

    strides = new.stride()
    groups = completable_groups(t, codec.group)
    _intake_kernel[(b * h,)](some(st.sink), some(st.mean), memo_t, st.length, new, *strides, h, t, memo_cap,
                             F=form, E=tiles)
    _encode_kernel[(groups, grid_rows(b * h), enc.dp // enc.dc)](
        st.data, some(st.scale), some(st.zero), some(st.index), some(st.mean), st.tail, st.length, st.start, new,
        *strides, tab.rotation, tab.rows, tab.levels, tab.analysis, tab.factors, h, ng, t, F=form, E=tiles,
        num_warps=8 if enc.gp * enc.dc >= 8192 else 4, enable_fp_fusion=encode_fp_fusion(plan))
    if memo is not None:
        _memo_kernel[(groups, grid_rows(b * h), enc.dp // enc.rc)](
            st.data, some(st.scale), some(st.zero), some(st.index), some(st.mean), st.length, st.start, memo,
            tab.synthesis, tab.rotation, tab.rows, tab.levels, ng, t, memo_cap, F=form, E=tiles,
            num_warps=8 if enc.gp * enc.rc >= 8192 else 4)
    _tail_kernel[(b * h,)](st.tail, st.length, st.start, new, *strides, h, t, F=form, E=tiles)
    _advance_kernel[(1,)](st.length, st.start, t, F=form, E=tiles)
