"""The vLLM plugin's Triton kernels (``flashcodec_fx/vllm/triton``) against the reference (the spec) on random paged
layouts (tiny sizes). The kernels run on ``DEVICE``: CPU tensors under ``TRITON_INTERPRET=1`` (the interpreter runs
every program in numpy), else CUDA tensors where a GPU is present (benchmarks/gpu_check.sh runs this file there),
else the module skips. The batches and the reference stay on the CPU: the kernels' inputs go to ``DEVICE`` and their
results come back (:func:`on_device`)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("the paged Triton kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1",
                allow_module_level=True)

from _paged_cases import make_batch  # noqa: E402

from flashcodec_fx.ops.triton.common import pow2  # noqa: E402
from flashcodec_fx.vllm.page import page_format, store_plan  # noqa: E402
from flashcodec_fx.vllm.reference import attention_reference, history, page_view  # noqa: E402
from flashcodec_fx.vllm.triton import (  # noqa: E402
    attention,
    check_paged_limits,
    page_form,
    triton_paged_attention,
    triton_paged_store,
)

# Attention, fp32: both accumulate in fp32 in different orders (the kernel folds the scale and log2(e) into q and
# takes exp2, the reference softmaxes), unit-scale data: within 2e-5 (measured: <= 7.2e-7). fp16: both round an fp32
# result once, so at most one fp16 ulp of the output apart (an ulp is <= 2**-10 of either value: rtol 2**-9).
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 1e-5}, torch.float16: {"atol": 1e-5, "rtol": 2.0**-9}}


def _case(fmt, dtype, heads=2, group=1, head_dim=16, block_size=16, anchors=None, contexts=(20, 37),
          queries=(1, 1), padding=1, seed=3, search=None):
    return {"format": fmt, "dtype": dtype, "heads": heads, "group": group, "head_dim": head_dim,
            "block_size": block_size, "anchors": anchors, "contexts": list(contexts), "queries": list(queries),
            "padding": padding, "seed": seed, "search": search}


# Every format (raw; int8: midrise, no search; 4bit / 2.5bit: lloyd with the search; 3bit: 3-bit keys in a 2-bit and
# a 1-bit slice, 2-bit values; trellis codes: 3-bit keys in two slices and 2-bit values, 4-bit both), anchors 0 / 1 /
# the preset's 4, pages of 16 and 32 slots, padding slots; the scale searches "trials" and "fit" on their own.
STORE_CASES = {
    "raw fp16": _case("raw", torch.float16),
    "int8 fp32 anchors=0": _case("int8", torch.float32, anchors=0, head_dim=32),
    "4bit fp16": _case("4bit", torch.float16, contexts=(5, 40), queries=(2, 1), padding=3),
    "3bit fp32 D=64": _case("3bit", torch.float32, head_dim=64, heads=1, contexts=(18,), queries=(3,)),
    "2.5bit fp16 bs=32 anchors=1": _case("2.5bit", torch.float16, block_size=32, anchors=1, seed=8),
    "4bit fp32 D=64 trials": _case("4bit", torch.float32, head_dim=64, contexts=(9,), queries=(20,), search="trials"),
    "4bit fp32 D=64 fit": _case("4bit", torch.float32, head_dim=64, contexts=(9,), queries=(20,), search="fit"),
    "2bit fp16 fit": _case("2bit", torch.float16, contexts=(5, 40), queries=(2, 1), search="fit"),
    "2.5bit-tcq fp16": _case("2.5bit-tcq", torch.float16, heads=1, contexts=(18,), queries=(3,)),
    "4bit-tcq fp32 bs=32 anchors=1 trials": _case("4bit-tcq", torch.float32, heads=1, block_size=32, anchors=1,
                                                  contexts=(20,), queries=(2,), search="trials"),
}


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` on ``DEVICE`` (copies keep their strides: a column slice stays one)."""
    return [x if x.device.type == DEVICE else torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                                                      device=DEVICE).copy_(x) for x in tensors]


def triton_store(fmt, key, value, cache, slots, block_table, seq_lens, query_start_loc, phase):
    """The Triton store with the reference store's arguments (``kernels.paged_store`` makes the plan the same way),
    on ``DEVICE``; ``cache`` (CPU) receives the result."""
    key, value, dev_cache, slots, block_table, seq_lens, query_start_loc = on_device(
        key, value, cache, slots, block_table, seq_lens, query_start_loc)
    plan = store_plan(fmt, dev_cache.shape[2], slots, block_table, seq_lens, query_start_loc, phase)
    triton_paged_store(fmt, key, value, dev_cache, slots, plan)
    cache.copy_(dev_cache)


@pytest.mark.parametrize(("module", "prefix", "tuple_type"), [(page_form, "P_", page_form.PageConsts),
                                                                (page_form, "S_", page_form.SlotConsts),
                                                                (attention, "T_", attention.PagedTiles)])
def test_constants_name_the_tuples_fields(module, prefix, tuple_type):
    """The module's ``<prefix><FIELD>`` constants are exactly the tuple's fields (declared once, ``TupleFields``),
    each its field's place; the tuples the launchers build are filled by name."""
    names = {name: getattr(module, name).value for name in dir(module) if name.startswith(prefix)}
    assert names == {prefix + field.upper(): i for i, field in enumerate(tuple_type._fields)}
    fmt = page_format("4bit", 0, 64, torch.float16)
    assert page_form.PageConsts.of(fmt, 16)._asdict() == {
        "d": 64, "dp": 64, "bs": 16, "a": 4, "raw_row": fmt.raw_row_bytes, "slot": fmt.code_slot_bytes, "raw": False,
        "center": True}
    assert attention.PagedTiles.of(fmt, 16, 3, 40, True)._asdict() == {
        "g": 3, "gp": 4, "tq": 4, "bm": 16, "bn_raw": 16, "bn_code": 16, "bn_own": attention.OWN_KEYS, "sinks": True}


@pytest.mark.parametrize("case", STORE_CASES.values(), ids=STORE_CASES.keys())
def test_store_matches_the_reference_bytewise(case):
    """History and this call's tokens scattered over random pages of a cache of random bytes, padding slots skipped:
    the caches the Triton store and the reference store leave are equal byte for byte. (Raw rows are copies; the codes
    come from sums in another order than torch's, which could flip one code at an exact rounding tie: none of these
    cases has one. On a GPU, where the rotation is a tensor-core-free fp32 dot of another order, expect the same
    caveat, untested.)"""
    batch = make_batch(case)
    ours, ref = batch.filled_cache(case["seed"], triton_store), batch.filled_cache(case["seed"])
    if case["search"] == "fit":  # its least-squares sums, in another order, may round a scale one fp16 step apart
        assert_pages_close(batch, ours, ref)
        return
    assert torch.equal(ours, ref), f"{int((ours != ref).sum())} of {ours.numel()} bytes differ"


def assert_pages_close(batch, ours: torch.Tensor, ref: torch.Tensor) -> None:
    """At most 0.5% of the bytes differ, and every request's positions as the pages give them back within one level
    step (times the largest value) of the reference's: a scale one fp16 step apart, or a code one level apart, where
    an fp32 sum in another order crosses a rounding boundary."""
    assert (ours != ref).float().mean() <= 5e-3, f"{int((ours != ref).sum())} of {ours.numel()} bytes differ"
    fmt, bs = batch.fmt, batch.block_size
    pages = [page_view(c).reshape(c.shape[0], c.shape[1], -1) for c in (ours, ref)]
    gap = max(float((c.quantizer.level_rows()[:, 1:] - c.quantizer.level_rows()[:, :-1]).abs().max())
              for c in (fmt.key, fmt.value))
    starts = batch.query_start_loc.tolist()
    for r, length in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_table[r, : -(-length // bs)].long()
        ctx = length - (starts[r + 1] - starts[r])  # the history this call reads from the pages (attention_reference)
        got, want = (history(fmt, p, blocks, bs, ctx, length) for p in pages)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=(gap + 1e-2) * float(w.abs().amax()), rtol=0)


# Decode batches, prefill chunks (a chunk longer than a page, a request with no history, a chunk spread over two q
# tiles: G=4 gives 4 tokens per tile), GQA 1-4, fp32 and fp16.
ATTENTION_CASES = {
    "decode raw fp16": _case("raw", torch.float16, group=2),
    "decode 4bit fp32 G=4": _case("4bit", torch.float32, group=4, contexts=(20, 37, 3), queries=(1, 1, 1)),
    "decode int8 fp16 anchors=0": _case("int8", torch.float16, anchors=0, head_dim=32),
    "prefill 3bit fp32 G=3": _case("3bit", torch.float32, group=3, contexts=(0, 33), queries=(5, 18)),
    "prefill 2.5bit fp16 G=4 several tiles": _case("2.5bit", torch.float16, group=4, contexts=(17, 2), queries=(20, 1)),
    "prefill 3bit fp32 completing a ring page": _case("3bit", torch.float32, contexts=(29, 45), queries=(5, 2)),
    "mixed 4bit fp32 bs=32 anchors=1": _case("4bit", torch.float32, block_size=32, anchors=1, contexts=(40, 0, 9),
                                             queries=(1, 7, 2), heads=1, group=2, head_dim=64),
    "decode 4bit-tcq fp16 G=2": _case("4bit-tcq", torch.float16, group=2),
    "prefill 2.5bit-tcq fp32 G=3": _case("2.5bit-tcq", torch.float32, group=3, contexts=(0, 33), queries=(5, 18)),
}


def _plan(batch, s_aux, **thresholds) -> attention.AttentionPlan:
    """The launcher's plan of ``batch``'s call (``thresholds``: attention_plan's)."""
    n, hq, _ = batch.query.shape
    longest = int((batch.query_start_loc[1:] - batch.query_start_loc[:-1]).max())
    return attention.attention_plan(batch.fmt, batch.block_size, hq // batch.key.shape[1], longest,
                                    batch.block_table.shape[1], n * hq, s_aux is not None, **thresholds)


def _attend(batch, cache, scale, s_aux=None, plan=None) -> torch.Tensor:
    """The Triton attention of ``batch``'s call on ``DEVICE``, its output on the CPU."""
    args = on_device(*batch.attention_args(cache))
    out = torch.full_like(args[0], float("nan"))
    s_aux = None if s_aux is None else on_device(s_aux)[0]
    triton_paged_attention(batch.fmt, *args, scale, s_aux, out, plan=plan)
    return out.cpu()


@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_attention_matches_the_reference(case):
    """The launcher's own plan: decode batches in the single kernel, chunks longer than a query tile split."""
    batch = make_batch(case)
    cache = batch.filled_cache(case["seed"])
    scale = batch.query.shape[-1] ** -0.5
    assert _plan(batch, None).split == (max(case["queries"]) * pow2(case["group"]) > attention.MAX_ROWS)
    ref = attention_reference(batch.fmt, *batch.attention_args(cache), scale)
    torch.testing.assert_close(_attend(batch, cache, scale).float(), ref.float(), **TOLERANCE[batch.query.dtype])


# The split path (a chunk longer than a query tile, MAX_ROWS // pow2(G) tokens: own tokens and history apart, merged):
# (case, split_keys, sinks). split_keys: history keys per split at least (None: the launcher's plan, SPLIT_KEYS: one
# split on these histories; 16 / 32: splits of one / two 16-slot pages, several on these histories). Histories of
# several pages read through their rings with centered keys (4bit, 3bit), int8 (no raw rows), raw pages, a chunk
# without history, decodes beside a chunk, GQA 1 / 2 / 3, sink logits.
SPLIT_CASES = {
    "chunk 4bit G=1 no history": (_case("4bit", torch.float32, heads=1, contexts=(0,), queries=(40,)), None, False),
    "chunk 4bit G=3 3 splits": (_case("4bit", torch.float32, group=3, contexts=(70,), queries=(20,)), 32, False),
    "chunk 3bit G=1 3 splits sinks": (_case("3bit", torch.float32, heads=1, contexts=(75,), queries=(18,)), 32, True),
    "chunk int8 G=3 anchors=0 2 splits": (_case("int8", torch.float32, group=3, anchors=0, head_dim=32, contexts=(50,),
                                                queries=(9,)), 32, False),
    "chunk raw G=3 3 splits sinks": (_case("raw", torch.float32, group=3, contexts=(40,), queries=(9,)), 16, True),
    "mixed 3bit G=3 3 splits sinks": (_case("3bit", torch.float32, group=3, contexts=(37, 70, 0, 5),
                                            queries=(1, 24, 1, 2)), 32, True),
    "mixed 4bit fp16 G=2 bs=32": (_case("4bit", torch.float16, group=2, block_size=32, contexts=(80, 3),
                                        queries=(12, 1)), None, False),
    "chunk 2bit-tcq G=1 3 splits sinks": (_case("2bit-tcq", torch.float32, heads=1, contexts=(75,), queries=(18,)), 32,
                                          True),
}


@pytest.mark.parametrize(("case", "split_keys", "sinks"), SPLIT_CASES.values(), ids=SPLIT_CASES.keys())
def test_split_attention_matches_the_reference(case, split_keys, sinks):
    """The plan takes the split path (and, with ``split_keys``, more than one history split); the result matches the
    reference."""
    batch = make_batch(case)
    cache = batch.filled_cache(case["seed"])
    scale = batch.query.shape[-1] ** -0.5
    s_aux = torch.linspace(-2, 3, batch.query.shape[1]) if sinks else None
    plan = _plan(batch, s_aux) if split_keys is None else _plan(batch, s_aux, split_keys=split_keys)
    assert plan.split
    pages = -(-max(case["contexts"]) // case["block_size"])
    assert (attention.history_splits(plan, pages) > 1) == (split_keys is not None)
    ref = attention_reference(batch.fmt, *batch.attention_args(cache), scale, s_aux)
    out = _attend(batch, cache, scale, s_aux, None if split_keys is None else plan)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[batch.query.dtype])


def test_plan_paths_and_splits():
    """One query tile's tokens or fewer: the single kernel; more: split. History splits: enough for the block table's
    width, at most MAX_SPLITS and MAX_STATE_ROWS // rows, at least one; a short history takes fewer."""
    fmt = page_format("4bit", 0, 64, torch.float16)
    for group, tokens in ((1, 16), (3, 4), (8, 2), (32, 1)):
        assert not attention.attention_plan(fmt, 16, group, tokens, 100, 64, False).split
        assert attention.attention_plan(fmt, 16, group, tokens + 1, 100, 64, False).split
    plan = attention.attention_plan(fmt, 16, 1, 100, 10**6, 64, False)
    assert (plan.splits, plan.split_pages) == (attention.MAX_SPLITS, attention.SPLIT_KEYS // 16)
    assert attention.history_splits(plan, 10**6) == attention.MAX_SPLITS
    assert attention.history_splits(plan, 3 * plan.split_pages) == 3
    assert attention.history_splits(plan, 0) == 0
    assert attention.attention_plan(fmt, 16, 1, 100, 3 * plan.split_pages, 64, False).splits == 3
    assert attention.attention_plan(fmt, 16, 1, 100, 10**6, attention.MAX_STATE_ROWS // 2, False).splits == 2
    assert attention.attention_plan(fmt, 16, 1, 100, 10**6, 4 * attention.MAX_STATE_ROWS, False).splits == 1


@pytest.mark.parametrize("queries", [(3, 1), (20, 1)], ids=["single", "split"])
def test_attention_with_sinks_and_strided_rows(queries):
    """Sink logits; query / key / value as column slices of one qkv buffer (vLLM's), ``out`` a view of a larger
    buffer whose other rows stay untouched; ``max_query_len`` left for the launcher to compute."""
    batch = make_batch(_case("4bit", torch.float32, heads=2, group=2, contexts=(30, 4), queries=queries, padding=0))
    n, h, d = batch.key.shape
    (qkv,) = on_device(torch.cat([batch.query.reshape(n, -1), batch.key.reshape(n, -1), batch.value.reshape(n, -1)],
                                 dim=1))
    q, k, v = (x.view(n, -1, d) for x in qkv.split([2 * h * d, h * d, h * d], dim=1))
    assert not k.is_contiguous()
    cache = batch.filled_cache(3)
    s_aux = torch.linspace(-2, 3, 2 * h)
    assert _plan(batch, s_aux).split == (queries[0] == 20)
    ref = attention_reference(batch.fmt, *batch.attention_args(cache), 0.2, s_aux)
    buffer = torch.zeros(n + 2, 2 * h * d, device=DEVICE)
    out = buffer[:n].view(n, 2 * h, d)
    triton_paged_attention(batch.fmt, q, k, v, *on_device(cache, batch.block_table, batch.seq_lens,
                                                          batch.query_start_loc), 0.2, *on_device(s_aux), out)
    torch.testing.assert_close(out.cpu(), ref, **TOLERANCE[torch.float32])
    assert torch.equal(buffer[n:].cpu(), torch.zeros(2, 2 * h * d))


def test_limits_are_named():
    with pytest.raises(ValueError, match="head_dim <= 128"):
        check_paged_limits(page_format("4bit", 0, 256, torch.float16), 16)
    with pytest.raises(ValueError, match="block_size <= 128"):
        check_paged_limits(page_format("int8", 0, 64, torch.float16), 256)
    check_paged_limits(page_format("3bit", 0, 128, torch.float16), 16)  # within the limits: no error
