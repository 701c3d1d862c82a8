"""Normalized streams (``normalize=True``, ``ops/reference/normalize.py``) through every op and kernel: raw rows read
back exactly, attention equals attention over the view, the kernels follow the reference, the memo follows the view,
and codes of the other channels keep their precision next to outlier channels."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from _cpu_cases import assert_matches

from flashcodec_fx.codecs import make_codec
from flashcodec_fx.ops import empty_state
from flashcodec_fx.ops.cpu.launch import cpu_append, cpu_codec_attention
from flashcodec_fx.ops.reference.append import append_reference
from flashcodec_fx.ops.reference.attention import codec_attention_reference
from flashcodec_fx.ops.reference.read import read_reference

OUTLIERS = {3: 16.0, 11: 64.0, 35: 16.0}  # channel -> factor (35 = 3 + D/2: a rotary partner)
CHUNKS = (3, 21, 1, 1, 9, 1)  # a first call inside the sinks, then the call that measures, then decode steps


def codec(normalize: bool = True, **options):
    recipe = dict(block_size=1, quant_bits=3, levels="lloyd", rotate=1, center=True, scale_search=True, sinks=4,
                  window=3)
    return make_codec("jpeg", **{**recipe, **options}, normalize=normalize)


def outlier_tokens(b: int, h: int, s: int, d: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, s, d, generator=gen)
    for channel, factor in OUTLIERS.items():
        x[..., channel % d] *= factor
    return x.to(dtype)


def run(c, x, chunks=CHUNKS, appender=append_reference, memo=False, device="cpu"):
    """``(state, memo)`` after appending ``x`` in ``chunks`` (room for 8 more tokens)."""
    b, h, s, d = x.shape
    state = list(empty_state(c, b, h, s + 8, d, x.dtype, device))
    view = torch.zeros(b, h, c.sinks + (s + 8) * c.group, d, dtype=x.dtype, device=device) if memo else None
    at = 0
    for n in chunks:
        appender(state, x[:, :, at: at + n].to(device), c.spec, view)
        at += n
    return state, view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_raw_rows_read_back_bitwise_and_the_sinks_stored_before_the_measure_are_rescaled(dtype):
    c = codec()
    x = outlier_tokens(2, 3, sum(CHUNKS), 64, dtype)
    state, _ = run(c, x)
    norm = state[-1]
    assert norm.dtype == torch.uint8 and norm[..., list(OUTLIERS)].min() >= 2 and norm.float().median() == 0
    view = read_reference(state, c.spec)
    n = sum(CHUNKS)
    assert torch.equal(view[:, :, : c.sinks], x[:, :, : c.sinks])  # three of them stored before the norm was set
    assert torch.equal(view[:, :, n - c.window: n], x[:, :, n - c.window:])
    new = x[:, :, -2:]
    assert torch.equal(read_reference(state, c.spec, new)[:, :, n - 2: n], new)


def test_without_outliers_a_normalized_stream_stores_what_the_plain_codec_stores():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, sum(CHUNKS), 64, generator=gen) * 0.1 + 1.0  # every channel about as wide
    got, _ = run(codec(True), x)
    want, _ = run(codec(False), x)
    assert not got[-1].any()
    assert all(torch.equal(a, b) for a, b in zip(got[:-1], want[:-1], strict=True))


def test_the_other_channels_keep_their_precision_next_to_outliers():
    """Without the exponents the outliers set every channel's step after the rotation."""
    x = outlier_tokens(1, 2, 120, 64)
    plain = torch.ones(64, dtype=torch.bool)
    plain[list(OUTLIERS)] = False
    archived = slice(4, 120 - 3)
    errors = {}
    for normalize in (False, True):
        c = codec(normalize)
        state, _ = run(c, x, chunks=(120,))
        err = (read_reference(state, c.spec)[:, :, archived] - x[:, :, archived]).pow(2).mean((0, 1, 2))
        errors[normalize] = float(err[plain].mean())
    assert errors[True] * 8 < errors[False], errors


@pytest.mark.parametrize("gqa", [1, 3])
def test_attention_equals_attention_over_the_view(gqa):
    ck, cv = codec(), codec(center=False, quant_bits=2, window=5)
    k, v = outlier_tokens(2, 2, sum(CHUNKS), 64, seed=1), outlier_tokens(2, 2, sum(CHUNKS), 64, seed=2)
    ks, _ = run(ck, k)
    vs, _ = run(cv, v)
    q = torch.randn(2, 2 * gqa, 2, 64, generator=torch.Generator().manual_seed(4)) / OUTLIERS[11]
    k_new, v_new = k[:, :, -2:], v[:, :, -2:]
    out = codec_attention_reference(q, ks, vs, ck.spec, cv.spec, k_new, v_new)
    n = sum(CHUNKS)
    kv = [read_reference(s, c.spec, new)[:, :, :n].repeat_interleave(gqa, 1)
          for s, c, new in ((ks, ck, k_new), (vs, cv, v_new))]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, *kv), atol=2e-4, rtol=1e-4)


def test_the_memo_is_the_view_after_every_append():
    c = codec()
    x = outlier_tokens(1, 2, sum(CHUNKS), 32)
    state = list(empty_state(c, 1, 2, 40, 32, x.dtype, "cpu"))
    memo = torch.zeros(1, 2, c.sinks + 40, 32)
    at = 0
    for n in CHUNKS:
        append_reference(state, x[:, :, at: at + n], c.spec, memo)
        at += n
        view = read_reference(state, c.spec)[:, :, :at]  # one decode of each group, in other shapes: fp32 rounding
        torch.testing.assert_close(memo[:, :, :at], view, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_follow_the_reference(cpu_kernels, dtype):
    torch.set_num_threads(1)  # the reference's products on one thread, as the kernel's (test_cpu_append.py)
    ck, cv = codec(), codec(center=False, quant_bits=2, window=5)
    k, v = outlier_tokens(2, 3, sum(CHUNKS), 64, dtype, 1), outlier_tokens(2, 3, sum(CHUNKS), 64, dtype, 2)
    states = {}
    for name, appender in (("reference", append_reference), ("cpu", cpu_append)):
        states[name] = [run(c, x, appender=appender, memo=True) for c, x in ((ck, k), (cv, v))]
    for (ref, ref_memo), (got, got_memo) in zip(states["reference"], states["cpu"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
        assert torch.equal(got_memo, ref_memo)
    (ks, _), (vs, _) = states["cpu"]
    q = torch.randn(2, 9, 2, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    args = (q, ks, vs, ck.spec, cv.spec, k[:, :, -2:], v[:, :, -2:])
    assert_matches(cpu_codec_attention(*args), codec_attention_reference(*args))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_triton_kernels_follow_the_reference():
    pytest.importorskip("triton")
    from flashcodec_fx.ops.triton.append import triton_append
    from flashcodec_fx.ops.triton.attention import triton_codec_attention
    from flashcodec_fx.ops.triton.read import triton_read

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ck, cv = codec(), codec(center=False, quant_bits=2, window=5)
    k, v = outlier_tokens(1, 2, sum(CHUNKS), 32, seed=1), outlier_tokens(1, 2, sum(CHUNKS), 32, seed=2)
    ref = [run(c, x, memo=True) for c, x in ((ck, k), (cv, v))]
    got = [run(c, x, appender=triton_append, memo=True, device=device) for c, x in ((ck, k), (cv, v))]
    for (r_state, r_memo), (g_state, g_memo), c in zip(ref, got, (ck, cv), strict=True):
        assert torch.equal(g_state[-1].cpu(), r_state[-1])  # the exponents: one reference computation
        torch.testing.assert_close(g_memo.cpu(), r_memo, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(triton_read(g_state, c.spec).cpu(), read_reference([t.cpu() for t in g_state],
                                                                                      c.spec), atol=1e-5, rtol=1e-5)
    q = torch.randn(1, 4, 2, 32, generator=torch.Generator().manual_seed(5))
    (ks, _), (vs, _) = got
    args = (q.to(device), ks, vs, ck.spec, cv.spec, k[:, :, -2:].to(device), v[:, :, -2:].to(device))
    want = codec_attention_reference(*(a.cpu() if isinstance(a, torch.Tensor) else
                                       [t.cpu() for t in a] if isinstance(a, list) else a for a in args))
    torch.testing.assert_close(triton_codec_attention(*args).cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("op", ["append", "codec_attention", "read"])
def test_opcheck(op):
    c = codec()
    x = outlier_tokens(1, 2, 20, 16)
    state, _ = run(c, x, chunks=(3, 15))
    ops = torch.ops.flashcodec
    if op == "append":
        memo = torch.zeros(1, 2, c.sinks + 28, 16)
        torch.library.opcheck(ops.append.default, (state, x[:, :, 18:], c.spec, memo))
    elif op == "read":
        torch.library.opcheck(ops.read.default, (state, c.spec, x[:, :, 16:18]))
    else:
        q = torch.randn(1, 4, 2, 16)
        torch.library.opcheck(ops.codec_attention.default, (q, state, state, c.spec, c.spec, x[:, :, 16:18],
                                                            x[:, :, 16:18]))
