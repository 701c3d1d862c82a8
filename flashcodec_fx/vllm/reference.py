"""Reference store and attention on vLLM pages, in plain torch: the spec the fused kernels are tested against.

Shapes (vLLM's): ``cache (num_blocks, H_kv, block_size, C)`` uint8 with its last two dims contiguous (a page is
``block_size * C`` bytes, laid out by :class:`~flashcodec_fx.vllm.page.PageFormat`); ``key``, ``value``
``(N, H_kv, D)``; ``query (N, H_q, D)``; ``slot_mapping (N,)`` (``block * block_size + offset``, negative: padding,
not stored); ``block_table (R, max_blocks)``, ``seq_lens (R,)`` (each request's length including this call's
tokens), ``query_start_loc (R + 1,)``: request ``r``'s tokens of this call are rows ``query_start_loc[r] ..
query_start_loc[r + 1] - 1``, at positions ``seq_lens[r] - q_len .. seq_lens[r] - 1``.

The store writes each token where ``page.store_plan`` says (raw rows first, then the code slots: a key is coded minus
the mean of raw key rows this call may itself have written). Attention reads positions below ``seq_lens[r] - q_len``
from the cache where ``page.history_rows`` says (raw rows as stored, code slots as the codec decodes them plus the
page's key mean, in fp32) and the call's own tokens exactly from ``key`` / ``value``; causal within the call;
GQA; fp32 softmax, with optional per-query-head sink logits ``s_aux (H_q,)`` (a learned extra logit that takes
probability mass and adds no value, as vLLM's ``sinks``); the output is in the query's dtype.
"""

from __future__ import annotations

import torch

from ..codecs import Encoded
from .page import PageFormat, history_rows, store_plan


def page_view(cache: torch.Tensor) -> torch.Tensor:
    """``(num_blocks, H, block_size, C)`` uint8 -> ``(num_blocks, H, block_size * C)``, a view (no copy)."""
    if cache.dtype != torch.uint8 or cache.dim() != 4:
        raise ValueError(f"cache must be a uint8 (num_blocks, H_kv, block_size, C) tensor, got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    if cache.stride(3) != 1 or cache.stride(2) != cache.shape[3]:
        raise ValueError(f"cache pages must be contiguous (block_size, C) bytes, got strides {cache.stride()}")
    return cache.flatten(2)


def _write(pages: torch.Tensor, blocks: torch.Tensor, starts: torch.Tensor, data: torch.Tensor) -> None:
    """``pages[blocks[i], h, starts[i] + j] = data[i, h, j]``."""
    n, heads, width = data.shape
    if n == 0:
        return
    cols = starts[:, None, None] + torch.arange(width, device=data.device)
    pages[blocks[:, None, None], torch.arange(heads, device=data.device)[None, :, None], cols] = data


def raw_key_mean(fmt: PageFormat, pages: torch.Tensor) -> torch.Tensor:
    """The mean of pages' raw key rows, ``(..., C_page)`` uint8 -> ``(..., D)`` fp32: rows added in order, then divided
    by their count (the kernels add in this order too, so the centered keys they code are bitwise these)."""
    a = fmt.anchors
    rows = pages[..., : a * fmt.raw_row_bytes].contiguous().view(fmt.dtype).unflatten(-1, (a, 2, fmt.head_dim))
    total = rows[..., 0, 0, :].float()
    for j in range(1, a):
        total = total + rows[..., j, 0, :].float()
    return total / a


def encode_slots(fmt: PageFormat, key: torch.Tensor, value: torch.Tensor,
                 key_mean: torch.Tensor | None = None) -> torch.Tensor:
    """Code slots of tokens ``key``, ``value (n, H, D)`` (keys minus ``key_mean (n, H, D)`` when the format centers
    them): ``(n, H, code_slot_bytes)`` uint8."""
    n, heads, _ = key.shape
    out = torch.zeros(n, heads, fmt.code_slot_bytes, dtype=torch.uint8, device=key.device)
    for slot, x, mean in zip(fmt.slots, (key, value), (key_mean, None), strict=True):
        enc = slot.codec.encode(x.unsqueeze(-2), mean)  # one group of one token: data (n, H, 1, 1, bytes)
        scale = enc.scale.reshape(n, heads, slot.scales).contiguous().view(torch.uint8)
        zero = enc.zero.reshape(n, heads, slot.zeros).contiguous().view(torch.uint8)
        out[..., slot.scale_offset: slot.scale_offset + scale.shape[-1]] = scale
        out[..., slot.zero_offset: slot.zero_offset + zero.shape[-1]] = zero
        out[..., slot.code_offset: slot.code_offset + slot.code_bytes] = enc.data.reshape(n, heads, slot.code_bytes)
    return out


def store_reference(fmt: PageFormat, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                    slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, phase: str = "store") -> None:
    """Write this call's tokens ``key``, ``value (N, H, D)`` into their pages as ``page.store_plan`` says for
    ``phase`` (``store`` before attention, ``ring`` after it): raw rows first, then the code slots, whose keys are
    centered on raw rows this call may have written."""
    nb, heads, bs, c = cache.shape
    fmt.check_page(bs, c)
    pages = page_view(cache)
    plan = store_plan(fmt, bs, slot_mapping, block_table, seq_lens, query_start_loc, phase)
    block = slot_mapping.long() // bs
    raw = (plan.raw_row >= 0).nonzero()[:, 0]
    rows = torch.cat([key[raw], value[raw]], dim=-1).to(fmt.dtype).contiguous().view(torch.uint8)
    _write(pages, block[raw], plan.raw_row[raw] * fmt.raw_row_bytes, rows)
    coded = (plan.code_slot >= 0).nonzero()[:, 0]
    if coded.numel() == 0:
        return
    mean = raw_key_mean(fmt, pages[plan.mean_block[coded]]) if fmt.center else None
    _write(pages, block[coded], fmt.raw_rows(bs) * fmt.raw_row_bytes + plan.code_slot[coded] * fmt.code_slot_bytes,
           encode_slots(fmt, key[coded], value[coded], mean))


def decode_pages(fmt: PageFormat, pages: torch.Tensor, block_size: int,
                 key_mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages ``(m, H, block_size * C)`` -> their rows ``(m, H, block_size, D)`` fp32, keys and values: the raw rows
    as stored, then the code slots decoded (keys plus ``key_mean (m, H, D)`` when the format centers them)."""
    m, heads, _ = pages.shape
    d, a = fmt.head_dim, fmt.raw_rows(block_size)
    raw_end = a * fmt.raw_row_bytes
    raw = pages[..., :raw_end].contiguous().view(fmt.dtype).reshape(m, heads, a, 2, d).float()
    if fmt.raw:
        return raw[..., 0, :], raw[..., 1, :]
    n = block_size - a
    slots = pages[..., raw_end: raw_end + n * fmt.code_slot_bytes].reshape(m, heads, n, fmt.code_slot_bytes)
    out = []
    for i, (slot, mean) in enumerate(zip(fmt.slots, (key_mean, None), strict=True)):
        scale = slots[..., slot.scale_offset: slot.scale_offset + 2 * slot.scales].contiguous().view(torch.float16)
        zero = slots[..., slot.zero_offset: slot.zero_offset + 2 * slot.zeros].contiguous().view(torch.float16)
        data = slots[..., slot.code_offset: slot.code_offset + slot.code_bytes]
        empty = torch.zeros(m, heads, n, 0, dtype=torch.uint8, device=pages.device)
        enc = Encoded(data[..., None, :], scale[..., None, :], zero[..., None, :], empty)  # n groups of one token
        coded = slot.codec.decode(enc, torch.float32, mean)  # (m, H, n, D)
        out.append(torch.cat([raw[..., i, :], coded], dim=2))
    return out[0], out[1]


def history(fmt: PageFormat, pages: torch.Tensor, blocks: torch.Tensor, block_size: int, length: int,
            total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``0 .. length - 1`` of a sequence whose pages are ``blocks`` (in order), as the pages give them
    back to a call that stored positions up to ``total`` (``page.history_rows``): ``(H, length, D)`` fp32 keys,
    values."""
    held = pages[blocks]
    mean = None
    if fmt.center:  # page i's keys: the page before's raw key rows' mean (the first page: its own)
        means = raw_key_mean(fmt, held)
        mean = torch.cat([means[:1], means[:-1]])
    k, v = decode_pages(fmt, held, block_size, mean)
    rows = history_rows(fmt, block_size, length, total).to(pages.device)  # (P, bs)
    heads, d = k.shape[1], k.shape[3]
    flat = []
    for x in (k, v):
        picked = x.gather(2, rows.clamp_min(0)[:, None, :, None].expand(-1, heads, -1, d))  # (P, H, bs, D)
        flat.append(picked.transpose(0, 1).reshape(heads, -1, d)[:, :length])
    return flat[0], flat[1]


def attention_reference(fmt: PageFormat, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, s_aux: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this call's ``query`` over each request's history in ``cache`` and its own ``key`` / ``value``
    (module docstring): ``(N, H_q, D)`` in ``query.dtype``, ``N = query_start_loc[-1]``."""
    nb, heads, bs, c = cache.shape
    fmt.check_page(bs, c)
    pages = page_view(cache)
    starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
    hq, d = query.shape[1], query.shape[2]
    group = hq // heads
    out = torch.zeros(starts[-1], hq, d, dtype=query.dtype, device=query.device)
    for r, length in enumerate(lengths):
        qs, qe = starts[r], starts[r + 1]
        t = qe - qs
        if t == 0:
            continue
        ctx = length - t
        blocks = block_table[r, : -(-ctx // bs)].long()
        k_hist, v_hist = history(fmt, pages, blocks, bs, ctx, length)
        k_all = torch.cat([k_hist, key[qs:qe].transpose(0, 1).float()], dim=1).repeat_interleave(group, 0)
        v_all = torch.cat([v_hist, value[qs:qe].transpose(0, 1).float()], dim=1).repeat_interleave(group, 0)
        q = query[qs:qe].transpose(0, 1).float()
        logits = (q @ k_all.transpose(1, 2)) * scale  # (H_q, t, length)
        visible = torch.arange(length, device=q.device)[None, :] <= ctx + torch.arange(t, device=q.device)[:, None]
        logits = logits.masked_fill(~visible, float("-inf"))
        if s_aux is not None:
            logits = torch.cat([logits, s_aux.float().view(hq, 1, 1).expand(hq, t, 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :length]
        out[qs:qe] = (probs @ v_all).transpose(0, 1).to(query.dtype)
    return out
