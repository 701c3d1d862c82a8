"""Paged attention on CUDA: decode steps and prefill chunks of many requests, on the stored codes (spec:
``reference.attention_reference``). Two paths, chosen per call by :func:`attention_plan`:

- **single** (every request's tokens of the call fit one query tile: decode steps, short chunks):
  ``_attention_kernel``, grid ``(R, H_kv, q tiles)``. A program takes ``TQ`` of request ``r``'s tokens in this call
  and the ``G`` query heads of one KV head (GQA: rows ``(token, g)``, ``BM = max(16, TQ * pow2(G))`` rows), walks the
  request's history pages through its block-table row (positions below ``seq_lens[r] - t``): a page's raw rows that
  hold history tokens (``page.history_rows``: the first page's sinks, a later page's ring) as stored, its code slots
  holding the others decoded in registers (``level[code] * scale``, in the codec's rotated space: the keys' scores
  use ``q @ R_k^T`` once per program, plus ``q . m`` for centered keys, ``m`` the mean of the page before's raw key
  rows; the values' weighted sum stays rotated and is rotated back once), then the call's own tokens exactly from
  ``key`` / ``value`` (causal). One online softmax (base 2, fp32) over all of them, optional sink logits ``s_aux``.
- **split** (a longer chunk, whose history the single kernel would decode once per query tile), as the CPU's
  ``cpu/paged_prefill.cpp``: own tokens and history apart, merged by their softmax states. Three launches:

  1. ``_prepare_kernel``, grid ``(cdiv(N, 16), H_q)``: every query row scaled (``scale * log2(e)``) and rotated into
     the keys' codec space (``q @ R_k^T``) once, into an fp32 scratch ``(N, H_q, D)``.
  2. ``_history_kernel``, grid ``(R, H_kv, S)``: program ``s`` takes split ``s`` of the request's history pages
     (:func:`history_splits`), decodes each page once (its raw rows rotated into the codec space, ``x @ R^T``; the
     key mean, rotated, added to the coded keys) and attends every query row of the request in this call against it,
     ``BM`` rows at a time, the rows' softmax states (max, sum, value sum in the values' rotated space) read from and
     written back to an fp32 scratch ``(S, N, H_q)`` / ``(S, N, H_q, D)``.
  3. ``_own_merge_kernel``, grid ``(R, H_kv, q tiles)``: causal flash attention over the call's own tokens, then the
     merge of ``paged_prefill.cpp``: the largest of the own state's max, the splits' maxima and the sink logit; each
     state weighted by ``exp2(max_i - max)``; the history's value sum rotated back (``R_v``) once; normalized; written
     in ``out``'s dtype.

Every dot is fp32 ``ieee``; rows of a request's tokens beyond a tile, heads ``>= G``, are masked. Scratch: ``N * H_q
* (D + S * (D + 2))`` fp32, the call's rows times the splits (``S <= MAX_SPLITS``, and ``S * N * H_q <=
MAX_STATE_ROWS``), never the history's length.

Untuned first choices (never run on a GPU): tiles of at most ``MAX_ROWS`` query rows (``TQ`` tokens), ``num_warps``
4; the split path from the first call whose longest request needs a second query tile; history splits of at least
``SPLIT_KEYS`` keys, as many as the block table's width allows (the longest history a request may have: no host sync).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...ops.triton.common import TupleFields, pow2
from ..page import PageFormat
from ..reference import page_view
from .page_form import (
    P_A,
    P_BS,
    P_CENTER,
    P_D,
    P_DP,
    P_RAW,
    P_RAW_ROW,
    P_SLOT,
    S_ROTATE,
    PageConsts,
    check_paged_limits,
    rotation_tile,
    slot_rows,
    stream_args,
)

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # scores in base 2: q scaled by scale * log2(e), exp2
MAX_ROWS = 16  # query rows (tokens x GQA heads) of one tile (64 spilled 91 KB at sm_90)
OWN_KEYS = 16  # own tokens per key tile
PREPARE_TOKENS = 16  # tokens per program of _prepare_kernel (>= 16: the rotation is a tl.dot)
SPLIT_KEYS = 256  # history keys (whole pages) per split at least
MAX_SPLITS = 16  # history splits per (request, KV head) at most: R * H_kv * 16 programs (one wave at H_kv=8 on H100)
MAX_STATE_ROWS = 2**18  # splits x query rows of history states at most (D + 2 fp32 each: 136 MB at D=128)

# The fields of the kernels' shape tuple (:class:`PagedTiles`), in tuple order (kernels: ``TQ: tl.constexpr =
# T[T_TQ]``):
_TILES = TupleFields("PagedTiles")
T_G = _TILES("g")  # query heads per KV head
T_GP = _TILES("gp")  # their power of two
T_TQ = _TILES("tq")  # tokens per query tile
T_BM = _TILES("bm")  # rows per query tile: max(16, TQ * GP)
T_BN_RAW = _TILES("bn_raw")  # a page's raw rows' tile
T_BN_CODE = _TILES("bn_code")  # a page's code slots' tile
T_BN_OWN = _TILES("bn_own")  # own tokens per key tile
T_SINKS = _TILES("sinks")  # sink logits s_aux


class PagedTiles(_TILES.namedtuple()):
    """The paged kernels' shape constexprs (its fields: the ``T_*`` declarations above, in tuple order)."""

    __slots__ = ()

    @classmethod
    def of(cls, fmt: PageFormat, block_size: int, group: int, tokens: int, sinks: bool) -> PagedTiles:
        """Tiles of ``tokens`` query tokens (at most ``MAX_ROWS // pow2(group)``, at least 1) of a GQA group."""
        gp = pow2(group)
        tq = max(1, min(pow2(tokens), MAX_ROWS // gp))
        a = fmt.raw_rows(block_size)
        return cls(g=group, gp=gp, tq=tq, bm=max(16, tq * gp), bn_raw=pow2(a, 16), bn_code=pow2(block_size - a, 16),
                   bn_own=OWN_KEYS, sinks=sinks)

    def constexpr(self) -> tuple:
        return tuple(self)


class AttentionPlan(NamedTuple):
    """A call's launches (shapes only): ``split`` (own tokens and history apart, else the single kernel), at most
    ``splits`` history splits of at least ``split_pages`` pages each per (request, KV head)."""

    tiles: PagedTiles
    split: bool
    splits: int
    split_pages: int


def attention_plan(fmt: PageFormat, block_size: int, group: int, max_query_len: int, table_pages: int, rows: int,
                   sinks: bool, single_tokens: int | None = None, split_keys: int = SPLIT_KEYS) -> AttentionPlan:
    """The plan of a call whose longest request has ``max_query_len`` tokens: split when that exceeds
    ``single_tokens`` (default: one query tile's, ``MAX_ROWS // pow2(group)``, at least 1); history splits of at least
    ``cdiv(split_keys, block_size)`` pages, as many as the longest history a block-table row holds
    (``table_pages``) needs, at most ``MAX_SPLITS`` and ``MAX_STATE_ROWS // rows`` (``rows``: the call's query rows,
    ``N * H_q``)."""
    tile_tokens = max(1, MAX_ROWS // pow2(group))
    split = max_query_len > (tile_tokens if single_tokens is None else single_tokens)
    tiles = PagedTiles.of(fmt, block_size, group, tile_tokens if split else max_query_len, sinks)
    split_pages = -(-split_keys // block_size)
    splits = max(1, min(-(-table_pages // split_pages), MAX_SPLITS, MAX_STATE_ROWS // max(1, rows)))
    return AttentionPlan(tiles, split, splits, split_pages)


def history_splits(plan: AttentionPlan, pages: int) -> int:
    """How many of ``plan``'s splits a history of ``pages`` pages takes (``_split_pages``' twin): splits of
    ``max(split_pages, cdiv(pages, splits))`` pages."""
    per = max(plan.split_pages, -(-pages // plan.splits))
    return -(-pages // per)


# --- device helpers ---------------------------------------------------------------------------------------------

@triton.jit
def _softmax_step(s, ok, m, mass):
    """One online-softmax step on scores ``s (BM, BN)`` (base 2) where ``ok``: ``(p, m, mass, alpha)``, the
    accumulators still to be rescaled by ``alpha`` and ``p`` to be multiplied by the tile's values."""
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.where(ok, tl.exp2(s - m_safe[:, None]), 0.0)
    return p, m_new, mass * alpha + tl.sum(p, 1), alpha


@triton.jit
def _tile_rows(qt, t, T: tl.constexpr):
    """Rows ``(BM,)`` of query tile ``qt`` of a request with ``t`` tokens in the call: ``(token, g, ok)``."""
    GP: tl.constexpr = T[T_GP]
    TQ: tl.constexpr = T[T_TQ]
    i = tl.arange(0, T[T_BM])
    tok = qt * TQ + i // GP
    g = i % GP
    return tok, g, (g < T[T_G]) & (tok < t) & (i < TQ * GP)


@triton.jit
def _load_queries(query, sq0, sq1, n, qh, row_ok, scale, P: tl.constexpr):
    """Query rows ``(BM, DP)`` fp32 of tokens ``n`` and heads ``qh``, scaled by ``scale * log2(e)``; zero where not
    ``row_ok``."""
    d = tl.arange(0, P[P_DP])
    ok = row_ok[:, None] & (d[None, :] < P[P_D])
    q = tl.load(query + n[:, None] * sq0 + qh[:, None] * sq1 + d[None, :], mask=ok, other=0.0)
    return q.to(tl.float32) * (scale * LOG2E)


@triton.jit
def _query_tile(query, sq0, sq1, seq_lens, starts, scale, P: tl.constexpr, T: tl.constexpr):
    """This program's query tile (program ids: request ``r``, KV head ``h``, tile ``qt``): ``(the request's first row,
    its tokens in the call, its history length, tokens (BM,), query heads (BM,), rows ok (BM,), queries (BM, DP))``,
    the queries scaled by ``scale * log2(e)``; no row ok where the tile starts past the request's tokens."""
    r = tl.program_id(0)
    qs = tl.load(starts + r).to(tl.int64)
    t = tl.load(starts + r + 1).to(tl.int64) - qs
    ctx = tl.load(seq_lens + r).to(tl.int64) - t
    tok, g, row_ok = _tile_rows(tl.program_id(2), t, T)
    qh = tl.program_id(1).to(tl.int64) * T[T_G] + g
    return qs, t, ctx, tok, qh, row_ok, _load_queries(query, sq0, sq1, qs + tok, qh, row_ok, scale, P)


@triton.jit
def _page(cache, sc0, sc1, block_table, bt_row, pg, h, ctx, total, P: tl.constexpr):
    """Page ``pg`` of a request's history (``ctx`` tokens; ``total`` stored by this call's store): ``(byte pointer of
    its head-``h`` page, history tokens it holds, its ring's first row)``."""
    BS: tl.constexpr = P[P_BS]
    phys = tl.load(block_table + bt_row + pg).to(tl.int64)
    held = tl.minimum(BS, ctx - pg * BS)
    ring_from = tl.maximum(tl.where(total - pg * BS >= BS, BS - P[P_A], held - P[P_A]), 0)
    return cache + phys * sc0 + h * sc1, held, ring_from


@triton.jit
def _raw_rows(page, pg, held, ring_from, like, P: tl.constexpr, BN: tl.constexpr):
    """The page's raw rows that hold history tokens (the first page's sinks; a later page's ring, row ``j`` holding
    offset ``ring_from + ((j - ring_from) mod A)``): ``(k, v (BN, DP) fp32, ok (BN,))``, rows as stored (the
    dtype of pointer ``like``)."""
    A: tl.constexpr = P[P_A]
    D: tl.constexpr = P[P_D]
    j = tl.arange(0, BN)
    d = tl.arange(0, P[P_DP])
    ok = (j < A) & tl.where(pg == 0, j < held, ring_from + (j - ring_from % A + A) % A < held)
    row = (page + j * P[P_RAW_ROW]).to(like.dtype)
    okd = ok[:, None] & (d[None, :] < D)
    k = tl.load(row[:, None] + d[None, :], mask=okd, other=0.0).to(tl.float32)
    v = tl.load(row[:, None] + D + d[None, :], mask=okd, other=0.0).to(tl.float32)
    return k, v, ok


@triton.jit
def _code_rows(page, pg, held, ring_from, levels_k, levels_v, KS: tl.constexpr, VS: tl.constexpr, P: tl.constexpr,
               BN: tl.constexpr):
    """The page's code slots that hold history tokens, decoded (the codecs' rotated spaces, keys not centered):
    ``(k, v (BN, DP) fp32, ok (BN,))``."""
    A: tl.constexpr = P[P_A]
    j = tl.arange(0, BN)
    ok = (j < P[P_BS] - A) & (j < tl.where(pg == 0, held - A, tl.minimum(ring_from, held)))
    slot = page + A * P[P_RAW_ROW] + j * P[P_SLOT]
    return slot_rows(slot, ok, levels_k, KS, P), slot_rows(slot, ok, levels_v, VS, P), ok


@triton.jit
def _key_mean(cache, sc0, sc1, block_table, bt_row, pg, h, like, P: tl.constexpr, BN: tl.constexpr):
    """The mean ``(DP,)`` fp32 of the raw key rows of the page before ``pg`` (the first page: its own), the centre of
    page ``pg``'s coded keys."""
    A: tl.constexpr = P[P_A]
    D: tl.constexpr = P[P_D]
    j = tl.arange(0, BN)
    d = tl.arange(0, P[P_DP])
    before = tl.load(block_table + bt_row + tl.maximum(pg - 1, 0)).to(tl.int64)
    rows = (cache + before * sc0 + h * sc1 + j * P[P_RAW_ROW]).to(like.dtype)
    k = tl.load(rows[:, None] + d[None, :], mask=(j < A)[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
    return tl.sum(k, 0) / A


@triton.jit
def _own_tokens(q, tok, row_ok, key, sk0, sk1, value, sv0, sv1, qs, t, h, last, m, mass, acc, P: tl.constexpr,
                BN: tl.constexpr):
    """The state ``(m, mass, acc)`` of query rows ``q (BM, DP)`` (tokens ``tok``) advanced over the request's own
    tokens ``[0, last)`` of this call (rows ``qs + j`` of ``key`` / ``value``, head ``h``), causal: key ``j`` is seen
    by the rows of tokens ``>= j``."""
    d = tl.arange(0, P[P_DP])
    dok = d[None, :] < P[P_D]
    for o in range(0, last, BN):
        j = o + tl.arange(0, BN)
        ok = j < t
        okd = ok[:, None] & dok
        k = tl.load(key + (qs + j)[:, None] * sk0 + h * sk1 + d[None, :], mask=okd, other=0.0).to(tl.float32)
        v = tl.load(value + (qs + j)[:, None] * sv0 + h * sv1 + d[None, :], mask=okd, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        visible = row_ok[:, None] & ok[None, :] & (j[None, :] <= tok[:, None])
        p, m, mass, alpha = _softmax_step(s, visible, m, mass)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m, mass, acc


@triton.jit
def _split_pages(ctx, splits, split_pages, BS: tl.constexpr):
    """``(pages, pages per split, splits used)`` of a history of ``ctx`` tokens (``history_splits``' twin)."""
    pages = tl.cdiv(ctx, BS)
    per = tl.maximum(tl.cdiv(pages, splits), split_pages)
    return pages, per, tl.cdiv(pages, per)


# --- kernels ----------------------------------------------------------------------------------------------------

@triton.jit
def _attention_kernel(query, sq0, sq1, key, sk0, sk1, value, sv0, sv1, out, so0, so1, cache, sc0, sc1,
                      block_table, sbt, seq_lens, starts, sinks, scale,
                      rot_k, levels_k, rot_v, levels_v,
                      P: tl.constexpr, KS: tl.constexpr, VS: tl.constexpr, T: tl.constexpr):
    """The single path: history and own tokens of one query tile in one online softmax (module docstring)."""
    D: tl.constexpr = P[P_D]
    DP: tl.constexpr = P[P_DP]
    BM: tl.constexpr = T[T_BM]
    TQ: tl.constexpr = T[T_TQ]
    KROT: tl.constexpr = (not P[P_RAW]) and KS[S_ROTATE]
    VROT: tl.constexpr = (not P[P_RAW]) and VS[S_ROTATE]
    r = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    qt = tl.program_id(2)
    qs, t, ctx, tok, qh, row_ok, q = _query_tile(query, sq0, sq1, seq_lens, starts, scale, P, T)
    if qt * TQ < t:
        qk = q
        if KROT:  # scores on rotated keys: (R q) . (R k)
            qk = tl.dot(q, rotation_tile(rot_k, D, DP, True), input_precision="ieee")
        m = tl.full((BM,), float("-inf"), tl.float32)
        mass = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, DP), tl.float32)
        acc_rot = tl.zeros((BM, DP), tl.float32)  # values' rotated space (VROT)
        bt_row = r.to(tl.int64) * sbt
        for pg in range(0, tl.cdiv(ctx, P[P_BS])):
            page, held, ring_from = _page(cache, sc0, sc1, block_table, bt_row, pg, h, ctx, ctx + t, P)
            if P[P_A] > 0:
                kr, vr, ok = _raw_rows(page, pg, held, ring_from, key, P, T[T_BN_RAW])
                s = tl.dot(q, tl.trans(kr), input_precision="ieee")
                p, m, mass, alpha = _softmax_step(s, row_ok[:, None] & ok[None, :], m, mass)
                acc = acc * alpha[:, None] + tl.dot(p, vr, input_precision="ieee")
                acc_rot = acc_rot * alpha[:, None]
            if not P[P_RAW]:
                kc, vc, ok = _code_rows(page, pg, held, ring_from, levels_k, levels_v, KS, VS, P, T[T_BN_CODE])
                s = tl.dot(qk, tl.trans(kc), input_precision="ieee")
                if P[P_CENTER]:  # + q . m
                    mk = _key_mean(cache, sc0, sc1, block_table, bt_row, pg, h, key, P, T[T_BN_RAW])
                    s += tl.sum(q * mk[None, :], 1)[:, None]
                p, m, mass, alpha = _softmax_step(s, row_ok[:, None] & ok[None, :], m, mass)
                acc = acc * alpha[:, None]
                acc_rot = acc_rot * alpha[:, None]
                if VROT:
                    acc_rot += tl.dot(p, vc, input_precision="ieee")
                else:
                    acc += tl.dot(p, vc, input_precision="ieee")
        if VROT:  # back from the values' rotated space: v = v_rot @ R
            acc += tl.dot(acc_rot, rotation_tile(rot_v, D, DP, False), input_precision="ieee")
        last = tl.minimum(t, (qt + 1) * TQ)  # own tokens up to the tile's last query (causal)
        m, mass, acc = _own_tokens(q, tok, row_ok, key, sk0, sk1, value, sv0, sv1, qs, t, h, last, m, mass, acc, P,
                                   T[T_BN_OWN])
        if T[T_SINKS]:
            sk = tl.load(sinks + qh, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            m_new = tl.maximum(m, sk)
            alpha = tl.exp2(m - m_new)
            mass = mass * alpha + tl.exp2(sk - m_new)
            acc = acc * alpha[:, None]
        res = acc / tl.where(mass > 0, mass, 1.0)[:, None]
        d = tl.arange(0, DP)
        tl.store(out + (qs + tok)[:, None] * so0 + qh[:, None] * so1 + d[None, :], res.to(out.dtype.element_ty),
                 mask=row_ok[:, None] & (d[None, :] < D))


@triton.jit
def _prepare_kernel(query, sq0, sq1, q_rows, n_tokens, scale, rot_k, P: tl.constexpr, KS: tl.constexpr,
                    BT: tl.constexpr):
    """The split path's queries: ``BT`` tokens of one query head scaled and rotated into ``q_rows (N, H_q, D)``."""
    D: tl.constexpr = P[P_D]
    DP: tl.constexpr = P[P_DP]
    n = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    qh = tl.program_id(1).to(tl.int64)
    hq = tl.num_programs(1)
    ok = n < n_tokens
    q = _load_queries(query, sq0, sq1, n, tl.zeros((BT,), tl.int64) + qh, ok, scale, P)
    if (not P[P_RAW]) and KS[S_ROTATE]:
        q = tl.dot(q, rotation_tile(rot_k, D, DP, True), input_precision="ieee")
    d = tl.arange(0, DP)
    tl.store(q_rows + (n * hq + qh)[:, None] * D + d[None, :], q, mask=ok[:, None] & (d[None, :] < D))


@triton.jit
def _history_kernel(q_rows, hq, cache, sc0, sc1, block_table, sbt, seq_lens, starts, key,
                    hist_max, hist_sum, hist_acc, n_rows, splits, split_pages,
                    rot_k, levels_k, rot_v, levels_v,
                    P: tl.constexpr, KS: tl.constexpr, VS: tl.constexpr, T: tl.constexpr):
    """The split path's history: split ``s`` of request ``r``'s pages for KV head ``h``, each page decoded once and
    every query row of the request attended against it; the rows' states in ``hist_* [s]`` (module docstring)."""
    D: tl.constexpr = P[P_D]
    DP: tl.constexpr = P[P_DP]
    G: tl.constexpr = T[T_G]
    KROT: tl.constexpr = (not P[P_RAW]) and KS[S_ROTATE]
    VROT: tl.constexpr = (not P[P_RAW]) and VS[S_ROTATE]
    r = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    qs = tl.load(starts + r).to(tl.int64)
    t = tl.load(starts + r + 1).to(tl.int64) - qs
    ctx = tl.load(seq_lens + r).to(tl.int64) - t
    pages, per, _ = _split_pages(ctx, splits, split_pages, P[P_BS])
    first = tl.program_id(2) * per
    end = tl.minimum(pages, first + per)
    if (t > 0) & (first < end):
        state = tl.program_id(2).to(tl.int64) * n_rows  # this split's first state row
        bt_row = r.to(tl.int64) * sbt
        d = tl.arange(0, DP)
        dok = d[None, :] < D
        for pg in range(first, end):
            page, held, ring_from = _page(cache, sc0, sc1, block_table, bt_row, pg, h, ctx, ctx + t, P)
            if P[P_A] > 0:  # rotated into the codecs' spaces: one (query, value) space for the whole history
                kr, vr, raw_ok = _raw_rows(page, pg, held, ring_from, key, P, T[T_BN_RAW])
                if KROT:
                    kr = tl.dot(kr, rotation_tile(rot_k, D, DP, True), input_precision="ieee")
                if VROT:
                    vr = tl.dot(vr, rotation_tile(rot_v, D, DP, True), input_precision="ieee")
            if not P[P_RAW]:
                kc, vc, code_ok = _code_rows(page, pg, held, ring_from, levels_k, levels_v, KS, VS, P, T[T_BN_CODE])
                if P[P_CENTER]:  # + R m
                    mk = _key_mean(cache, sc0, sc1, block_table, bt_row, pg, h, key, P, T[T_BN_RAW])
                    if KROT:
                        mk = tl.sum(mk[:, None] * rotation_tile(rot_k, D, DP, True), 0)
                    kc += mk[None, :]
            for qt in range(0, tl.cdiv(t, T[T_TQ])):
                tok, g, row_ok = _tile_rows(qt, t, T)
                row = (qs + tok) * hq + h * G + g
                okd = row_ok[:, None] & dok
                q = tl.load(q_rows + row[:, None] * D + d[None, :], mask=okd, other=0.0)
                seen = tl.where(pg > first, row_ok, False)  # the split's later pages continue its state
                m = tl.load(hist_max + state + row, mask=seen, other=float("-inf"))
                mass = tl.load(hist_sum + state + row, mask=seen, other=0.0)
                acc = tl.load(hist_acc + (state + row)[:, None] * D + d[None, :], mask=seen[:, None] & dok, other=0.0)
                if P[P_A] > 0:
                    s = tl.dot(q, tl.trans(kr), input_precision="ieee")
                    p, m, mass, alpha = _softmax_step(s, row_ok[:, None] & raw_ok[None, :], m, mass)
                    acc = acc * alpha[:, None] + tl.dot(p, vr, input_precision="ieee")
                if not P[P_RAW]:
                    s = tl.dot(q, tl.trans(kc), input_precision="ieee")
                    p, m, mass, alpha = _softmax_step(s, row_ok[:, None] & code_ok[None, :], m, mass)
                    acc = acc * alpha[:, None] + tl.dot(p, vc, input_precision="ieee")
                tl.store(hist_max + state + row, m, mask=row_ok)
                tl.store(hist_sum + state + row, mass, mask=row_ok)
                tl.store(hist_acc + (state + row)[:, None] * D + d[None, :], acc, mask=okd)


@triton.jit
def _own_merge_kernel(query, sq0, sq1, key, sk0, sk1, value, sv0, sv1, out, so0, so1, seq_lens, starts, sinks, scale,
                      hist_max, hist_sum, hist_acc, n_rows, splits, split_pages, rot_v,
                      P: tl.constexpr, VS: tl.constexpr, T: tl.constexpr):
    """The split path's own tokens of one query tile (causal), merged with the history's splits and the sink logit
    (``paged_prefill.cpp``'s merge), into ``out``."""
    D: tl.constexpr = P[P_D]
    DP: tl.constexpr = P[P_DP]
    BM: tl.constexpr = T[T_BM]
    G: tl.constexpr = T[T_G]
    TQ: tl.constexpr = T[T_TQ]
    h = tl.program_id(1).to(tl.int64)
    qt = tl.program_id(2)
    qs, t, ctx, tok, qh, row_ok, q = _query_tile(query, sq0, sq1, seq_lens, starts, scale, P, T)
    if qt * TQ < t:
        m = tl.full((BM,), float("-inf"), tl.float32)
        mass = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, DP), tl.float32)
        last = tl.minimum(t, (qt + 1) * TQ)
        m, mass, acc = _own_tokens(q, tok, row_ok, key, sk0, sk1, value, sv0, sv1, qs, t, h, last, m, mass, acc, P,
                                   T[T_BN_OWN])
        _, _, used = _split_pages(ctx, splits, split_pages, P[P_BS])
        row = (qs + tok) * tl.num_programs(1) * G + qh
        top = m  # the largest of the own max, the splits' maxima and the sink logit
        for s in range(0, used):
            top = tl.maximum(top, tl.load(hist_max + s * n_rows + row, mask=row_ok, other=float("-inf")))
        if T[T_SINKS]:
            sk = tl.load(sinks + qh, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            top = tl.maximum(top, sk)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp2(m - top)
        total = w * mass
        acc = acc * w[:, None]
        d = tl.arange(0, DP)
        okd = row_ok[:, None] & (d[None, :] < D)
        hist = tl.zeros((BM, DP), tl.float32)
        for s in range(0, used):
            ws = tl.exp2(tl.load(hist_max + s * n_rows + row, mask=row_ok, other=float("-inf")) - top)
            total += ws * tl.load(hist_sum + s * n_rows + row, mask=row_ok, other=0.0)
            hist += ws[:, None] * tl.load(hist_acc + (s * n_rows + row)[:, None] * D + d[None, :], mask=okd, other=0.0)
        if (not P[P_RAW]) and VS[S_ROTATE]:  # back from the values' rotated space: v = v_rot @ R
            acc += tl.dot(hist, rotation_tile(rot_v, D, DP, False), input_precision="ieee")
        else:
            acc += hist
        if T[T_SINKS]:
            total += tl.exp2(sk - top)
        res = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out + (qs + tok)[:, None] * so0 + qh[:, None] * so1 + d[None, :], res.to(out.dtype.element_ty),
                 mask=okd)


# --- launcher ---------------------------------------------------------------------------------------------------

def _check_call(fmt: PageFormat, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                s_aux: torch.Tensor | None, out: torch.Tensor) -> None:
    """ValueError for what the kernels cannot take (the caller, ``kernels.paged_attention``, checked shapes and
    dtypes)."""
    page_view(cache)
    check_paged_limits(fmt, cache.shape[2])
    for name, x in (("query", query), ("key", key), ("value", value), ("out", out)):
        if x.stride(2) != 1:
            raise ValueError(f"{name} rows must be contiguous along head_dim for the Triton attention")
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous")
    requests = seq_lens.shape[0]
    if query_start_loc.shape != (requests + 1,):
        raise ValueError(f"query_start_loc must be (R + 1,) = ({requests + 1},), got {tuple(query_start_loc.shape)}")
    if s_aux is not None and s_aux.numel() != query.shape[1]:
        raise ValueError(f"s_aux must hold one logit per query head ({query.shape[1]}), got {tuple(s_aux.shape)}")


def _split_scratch(query: torch.Tensor, splits: int) -> tuple[torch.Tensor, ...]:
    """The split path's fp32 scratch, one allocation: the prepared queries ``(N, H_q, D)``, the history splits'
    maxima and sums ``(S, N, H_q)``, their value sums ``(S, N, H_q, D)`` (flat)."""
    n, hq, d = query.shape
    rows = n * hq
    sizes = [rows * d, splits * rows, splits * rows, splits * rows * d]
    return torch.empty(sum(sizes), dtype=torch.float32, device=query.device).split(sizes)


def triton_paged_attention(fmt: PageFormat, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, scale: float, s_aux: torch.Tensor | None, out: torch.Tensor,
                           max_query_len: int | None = None, plan: AttentionPlan | None = None) -> None:
    """``attention_reference``'s twin into ``out (N, H_q, D)``. ``max_query_len``: the most tokens of one request in
    the call (computed when None: a host sync); ``plan``: :func:`attention_plan`'s for this call when None (tests
    pass one with other thresholds)."""
    _check_call(fmt, query, key, value, cache, block_table, seq_lens, query_start_loc, s_aux, out)
    requests, bs = seq_lens.shape[0], cache.shape[2]
    hq, heads = query.shape[1], cache.shape[1]
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if requests else 0
    if requests == 0 or max_query_len <= 0:
        return
    if plan is None:
        plan = attention_plan(fmt, bs, hq // heads, max_query_len, block_table.shape[1], query.shape[0] * hq,
                              s_aux is not None)
    if plan.tiles.g != hq // heads or plan.tiles.sinks != (s_aux is not None):
        raise ValueError(f"plan is for G={plan.tiles.g}, sinks={plan.tiles.sinks}; the call has G={hq // heads}, "
                         f"sinks={s_aux is not None}")
    (_, ks, kt), (_, vs, vt) = stream_args(fmt, cache.device)
    sinks = query.new_zeros(1, dtype=torch.float32) if s_aux is None else s_aux.float().contiguous()
    lens, starts = seq_lens.contiguous(), query_start_loc.contiguous()
    consts = {"P": PageConsts.of(fmt, bs).constexpr(), "T": plan.tiles.constexpr(), "num_warps": 4}
    rows = (query, query.stride(0), query.stride(1), key, key.stride(0), key.stride(1), value, value.stride(0),
            value.stride(1), out, out.stride(0), out.stride(1))
    pages = (cache, cache.stride(0), cache.stride(1), block_table, block_table.stride(0))
    q_tiles = (requests, heads, triton.cdiv(max_query_len, plan.tiles.tq))
    if not plan.split:
        _attention_kernel[q_tiles](*rows, *pages, lens, starts, sinks, float(scale), kt[0], kt[1], vt[0], vt[1],
                                   KS=ks, VS=vs, **consts)
        return
    q_rows, hist_max, hist_sum, hist_acc = _split_scratch(query, plan.splits)
    n_rows = query.shape[0] * hq
    _prepare_kernel[(triton.cdiv(query.shape[0], PREPARE_TOKENS), hq)](
        query, query.stride(0), query.stride(1), q_rows, query.shape[0], float(scale), kt[0], P=consts["P"], KS=ks,
        BT=PREPARE_TOKENS, num_warps=4)
    states = (hist_max, hist_sum, hist_acc, n_rows, plan.splits, plan.split_pages)
    _history_kernel[(requests, heads, plan.splits)](q_rows, hq, *pages, lens, starts, key, *states, kt[0], kt[1],
                                                    vt[0], vt[1], KS=ks, VS=vs, **consts)
    _own_merge_kernel[q_tiles](*rows, lens, starts, sinks, float(scale), *states, vt[0], VS=vs, **consts)
