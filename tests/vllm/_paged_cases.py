"""Random paged layouts as vLLM builds them: requests of different lengths in one batch (decodes and prefill chunks),
their pages scattered over a cache of random bytes through block tables, padding slots, GQA."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from flashcodec_fx.codecs import JPEGCodec
from flashcodec_fx.vllm.config import VLLM_PRESETS
from flashcodec_fx.vllm.page import RAW, PageFormat, page_format
from flashcodec_fx.vllm.reference import store_reference

FORMATS = (*VLLM_PRESETS, RAW)
DTYPES = (torch.bfloat16, torch.float32, torch.float16)


@dataclass
class Batch:
    """One call: ``query (N, Hq, D)``, ``key`` / ``value (N + padding, H, D)`` (this call's tokens, then padding
    rows), ``slot_mapping (N + padding,)`` (-1 on padding),
    ``block_table (R, max_blocks)`` int32, ``seq_lens (R,)`` / ``query_start_loc (R + 1,)`` int32, and every
    request's full ``keys`` / ``values`` ``(L_r, H, D)`` (history and this call)."""

    fmt: PageFormat
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    num_blocks: int
    block_size: int

    def empty_cache(self, seed: int) -> torch.Tensor:
        """A cache of random bytes (pages never written must not be read; written ones must be overwritten)."""
        content = self.fmt.state_content_bytes(self.block_size)
        gen = torch.Generator().manual_seed(seed)
        heads = self.key.shape[1]
        return torch.randint(0, 256, (self.num_blocks, heads, self.block_size, content), dtype=torch.uint8,
                             generator=gen)

    def history_call(self) -> tuple:
        """Every request's positions before this call, as one earlier call: ``(keys, values, slot_mapping,
        block_table, seq_lens, query_start_loc)``."""
        ks, vs, slots, lens = [], [], [], []
        for r, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            ctx = int(self.seq_lens[r]) - int(self.query_start_loc[r + 1] - self.query_start_loc[r])
            pos = torch.arange(ctx)
            ks.append(k[:ctx])
            vs.append(v[:ctx])
            slots.append(self.block_table[r, pos // self.block_size].long() * self.block_size + pos % self.block_size)
            lens.append(ctx)
        starts = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        return (torch.cat(ks), torch.cat(vs), torch.cat(slots), self.block_table,
                torch.tensor(lens, dtype=torch.int32), starts)

    def store_args(self, cache: torch.Tensor, call: tuple | None = None) -> tuple:
        """The positional arguments of ``store_reference`` / ``paged_store`` after ``fmt``, before ``phase``: this
        call's (or ``call``'s, a ``history_call``)."""
        k, v, slots, table, lens, starts = call or (self.key, self.value, self.slot_mapping, self.block_table,
                                                   self.seq_lens, self.query_start_loc)
        return k, v, cache, slots, table, lens, starts

    def filled_cache(self, seed: int, store=store_reference) -> torch.Tensor:
        """A cache holding every request's history (stored, then its rings written after attention) and this call's
        tokens, as vLLM's store leaves it before forward."""
        cache = self.empty_cache(seed)
        history = self.history_call()
        store(self.fmt, *self.store_args(cache, history), "store")
        store(self.fmt, *self.store_args(cache, history), "ring")
        store(self.fmt, *self.store_args(cache), "store")
        return cache

    def attention_args(self, cache: torch.Tensor) -> tuple:
        """The positional arguments of ``attention_reference`` / ``paged_attention`` after ``fmt``, before scale."""
        n = self.query.shape[0]
        return (self.query, self.key[:n], self.value[:n], cache, self.block_table, self.seq_lens,
                self.query_start_loc)


@st.composite
def batch_cases(draw) -> dict:
    requests = draw(st.integers(1, 4))
    return {
        "format": draw(st.sampled_from(FORMATS)), "dtype": draw(st.sampled_from(DTYPES)),
        "heads": draw(st.integers(1, 3)), "group": draw(st.integers(1, 4)), "head_dim": draw(st.sampled_from([16, 64, 128])),
        "block_size": draw(st.sampled_from([16, 32])), "anchors": draw(st.sampled_from([None, 0, 1, 4])),
        "contexts": draw(st.lists(st.integers(0, 90), min_size=requests, max_size=requests)),
        "queries": draw(st.lists(st.sampled_from([1, 1, 2, 5, 16, 23, 33, 70]), min_size=requests, max_size=requests)),
        "padding": draw(st.integers(0, 3)), "seed": draw(st.integers(0, 10**6)),
        "search": draw(st.sampled_from([None, "trials", "fit"])),
    }


def with_search(fmt: PageFormat, search) -> PageFormat:
    """``fmt`` with both streams' scale search set to ``search`` (None: the preset's own)."""
    if search is None or fmt.key is None:
        return fmt
    k, v = (JPEGCodec(block_size=1, quant_bits=c.quantizer.bits, levels=c.quantizer.levels, scale_axis="token",
                      scale_search=search, rotate=c.rotate, center=c.center) for c in (fmt.key, fmt.value))
    return PageFormat(fmt.name, k, v, fmt.anchors, fmt.head_dim, fmt.dtype)


def make_batch(case: dict) -> Batch:
    """The batch of ``case`` (see :func:`batch_cases`); layer index from the seed (the rotation's seed)."""
    gen = torch.Generator().manual_seed(case["seed"])
    h, d, bs, dtype = case["heads"], case["head_dim"], case["block_size"], case["dtype"]
    fmt = with_search(page_format(case["format"], case["seed"] % 30, d, dtype, case["anchors"]), case.get("search"))
    lengths = [c + t for c, t in zip(case["contexts"], case["queries"], strict=True)]
    need = [-(-n // bs) for n in lengths]
    num_blocks = sum(need) + 3
    physical = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    width = max(need) + 1
    table = torch.randint(0, num_blocks, (len(lengths), width), generator=gen, dtype=torch.int32)  # unused: junk
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = physical[used: used + n]
        used += n
    keys = [torch.randn(n, h, d, generator=gen).to(dtype) for n in lengths]
    values = [torch.randn(n, h, d, generator=gen).to(dtype) for n in lengths]
    new_k, new_v, slots, starts = [], [], [], [0]
    for r, (ctx, t) in enumerate(zip(case["contexts"], case["queries"], strict=True)):
        pos = torch.arange(ctx, ctx + t)
        new_k.append(keys[r][ctx:])
        new_v.append(values[r][ctx:])
        slots.append(table[r, pos // bs].long() * bs + pos % bs)
        starts.append(starts[-1] + t)
    pad = case["padding"]  # padding rows after the batch's tokens: slot -1, never stored
    key = torch.cat([*new_k, torch.randn(pad, h, d, generator=gen).to(dtype)])
    value = torch.cat([*new_v, torch.randn(pad, h, d, generator=gen).to(dtype)])
    slot_mapping = torch.cat([*slots, torch.full((pad,), -1, dtype=torch.int64)])
    query = torch.randn(starts[-1], h * case["group"], d, generator=gen).to(dtype)
    return Batch(fmt, query, key, value, slot_mapping, table, torch.tensor(lengths, dtype=torch.int32),
                 torch.tensor(starts, dtype=torch.int32), keys, values, num_blocks, bs)
