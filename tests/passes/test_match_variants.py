"""The pass on hand-traced graphs of every SDPA variant (CPU and CUDA ops alike, traced with fake tensors): the
rewritten graph runs on CPU and equals SDPA over the materialized view; non-equivalent sites are left alone."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import flashcodec_fx as fc
from flashcodec_fx.passes import SDPAOverCachePass

aten = torch.ops.aten
B, HQ, HKV, D, R, CAP = 2, 4, 2, 16, 8, 32


KEY_CODEC = fc.make_codec("jpeg", block_size=R, quant_bits=8)
VALUE_CODEC = fc.make_codec("jpeg", block_size=1, quant_bits=2, levels="lloyd", rotate=1, center=True, window=4)
N_STATE = len(fc.ops.StreamState._fields)


def _streams(length: int):
    """Flat ``[*key_state, *value_state]`` of a static cache holding ``length`` tokens, and the two specs the streams
    store with (``CodecStream.spec``: the value codec's fp32 stream keeps its raw rows in bf16, ``raw=bfloat16``)."""
    torch.manual_seed(0)
    cache = fc.CodecKVCache(KEY_CODEC, VALUE_CODEC, layout="static", max_length=CAP)
    cache.append(torch.randn(B, HKV, length, D), torch.randn(B, HKV, length, D))
    return [*cache.keys.state, *cache.values.state], (cache.keys.spec, cache.values.spec)


def _read(state, spec):
    k = torch.ops.flashcodec.read(list(state[:N_STATE]), spec[0])
    v = torch.ops.flashcodec.read(list(state[N_STATE:]), spec[1])
    return k, v


def _repeat(x, n=HQ // HKV):
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def _mask(length: int, rank: int = 4, dtype=torch.float32):
    allowed = torch.arange(CAP) < length
    if dtype == torch.bool:
        return allowed.expand(*[1] * (rank - 1), CAP).clone()
    return torch.zeros(*[1] * (rank - 1), CAP).masked_fill(~allowed, float("-inf"))


def _first(out):
    return out[0] if isinstance(out, tuple) else out


VARIANTS = {
    # name: (fn(q, k, v, mask) -> attention, uses mask, repeats kv itself)
    "composite_gqa": (lambda q, k, v, m: aten.scaled_dot_product_attention(q, k, v, m, enable_gqa=True), True),
    "composite_repeat_scale": (lambda q, k, v, m: aten.scaled_dot_product_attention(q, _repeat(k), _repeat(v), m,
                                                                                     scale=0.3), True),
    "cpu_flash_gqa": (lambda q, k, v, m: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=m), True),
    "cuda_flash_repeat": (lambda q, k, v, m: aten._scaled_dot_product_flash_attention(q, _repeat(k), _repeat(v)), False),
    "cuda_efficient_repeat": (lambda q, k, v, m: aten._scaled_dot_product_efficient_attention(
        q, _repeat(k), _repeat(v), m, False), True),
    "cuda_cudnn_repeat": (lambda q, k, v, m: aten._scaled_dot_product_cudnn_attention(
        q, _repeat(k), _repeat(v), m, False), True),
    "fused_overrideable_repeat": (lambda q, k, v, m: aten._scaled_dot_product_fused_attention_overrideable(
        q, _repeat(k), _repeat(v), m), True),
    "repeat_interleave": (lambda q, k, v, m: aten.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), m), True),
}


def _trace(attend, state, spec, q, mask):
    def fn(q, mask, *state):
        k, v = _read(state, spec)
        return _first(attend(q, k, v, mask))

    return make_fx(fn, tracing_mode="fake", pre_dispatch=True)(q, mask, *state)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("queries", [1, 3])
def test_variant_rewritten_and_equal(variant, queries):
    attend, masked = VARIANTS[variant]
    length = 21 if masked else CAP  # without a mask, attention over read() covers the whole capacity
    state, spec = _streams(length)
    q = torch.randn(B, HQ, queries, D)
    mask = _mask(length) if masked else None
    gm = _trace(attend, state, spec, q, mask)
    graph_pass = SDPAOverCachePass(strict=True)
    graph_pass(gm.graph)
    gm.recompile()
    (report,) = graph_pass.reports
    assert report.rewritten == 1, report.skipped
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.flashcodec.codec_attention.default in targets
    assert torch.ops.flashcodec.read.default not in targets
    assert not any("scaled_dot_product" in str(t) for t in targets)
    k, v = _read(state, spec)
    scale = 0.3 if "scale" in variant else None
    want = F.scaled_dot_product_attention(q, _repeat(k), _repeat(v), attn_mask=mask, scale=scale)
    torch.testing.assert_close(gm(q, mask, *state), want, rtol=1e-5, atol=1e-5)


def test_new_tokens_read_exactly_after_the_rewrite():
    """``read(state, spec, new)`` (what a compiled cache layer returns) becomes codec_attention with k_new / v_new."""
    length, t = 21, 3
    state, spec = _streams(length)
    q, k_new, v_new = torch.randn(B, HQ, t, D), torch.randn(B, HKV, t, D), torch.randn(B, HKV, t, D)
    mask = _mask(length)

    def fn(q, mask, k_new, v_new, *state):
        k = torch.ops.flashcodec.read(list(state[:N_STATE]), spec[0], k_new)
        v = torch.ops.flashcodec.read(list(state[N_STATE:]), spec[1], v_new)
        return aten.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)

    gm = make_fx(fn, tracing_mode="fake", pre_dispatch=True)(q, mask, k_new, v_new, *state)
    SDPAOverCachePass(strict=True)(gm.graph)
    gm.recompile()
    (node,) = [n for n in gm.graph.nodes if n.target == torch.ops.flashcodec.codec_attention.default]
    assert node.args[5] is not None and node.args[6] is not None
    want = fn(q, mask, k_new, v_new, *state)
    torch.testing.assert_close(gm(q, mask, k_new, v_new, *state), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank,dtype", [(2, torch.float32), (3, torch.bool), (4, torch.bool)])
def test_mask_ranks_and_dtypes(rank, dtype):
    state, spec = _streams(13)
    q = torch.randn(B, HQ, 1, D)
    mask = _mask(13, rank, dtype)
    gm = _trace(VARIANTS["composite_gqa"][0], state, spec, q, mask)
    SDPAOverCachePass(strict=True)(gm.graph)
    gm.recompile()
    k, v = _read(state, spec)
    want = F.scaled_dot_product_attention(q, _repeat(k), _repeat(v), attn_mask=mask)
    torch.testing.assert_close(gm(q, mask, *state), want, rtol=1e-5, atol=1e-5)


def _wrong_grouping(x, n=HQ // HKV):
    b, h, s, d = x.shape
    return x[:, None].expand(b, n, h, s, d).reshape(b, n * h, s, d)


def _both_outputs(out):
    return out[0] + out[1].sum()


LEFT_ALONE = {
    "is_causal": (lambda q, k, v, m: aten.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                  "is_causal=True"),
    "dropout": (lambda q, k, v, m: aten.scaled_dot_product_attention(q, k, v, m, 0.1, enable_gqa=True), "dropout_p"),
    "head_tiling": (lambda q, k, v, m: aten.scaled_dot_product_attention(q, _wrong_grouping(k), _wrong_grouping(v), m),
                    "singleton dim 2"),
    "scaled_view": (lambda q, k, v, m: aten.scaled_dot_product_attention(q, k * 2, v, m, enable_gqa=True),
                    "not a known GQA/view op"),
    "logsumexp_used": (lambda q, k, v, m: _both_outputs(aten._scaled_dot_product_flash_attention_for_cpu(
        q, _repeat(k), _repeat(v), attn_mask=m)), "outputs other than"),
}


@pytest.mark.parametrize("case", sorted(LEFT_ALONE))
def test_non_equivalent_sites_left_alone(case):
    attend, reason = LEFT_ALONE[case]
    state, spec = _streams(21)
    q = torch.randn(B, HQ, 3, D)
    mask = _mask(21)
    gm = _trace(attend, state, spec, q, mask)
    before = str(gm.graph)
    graph_pass = SDPAOverCachePass()
    graph_pass(gm.graph)
    (report,) = graph_pass.reports
    assert report.rewritten == 0 and str(gm.graph) == before
    assert reason in report.skipped[0] and report.remaining_views
    with pytest.raises(Exception, match="strict mode"):
        SDPAOverCachePass(strict=True)(gm.graph)


def test_uuid_is_stable_and_keyed_by_options():
    assert SDPAOverCachePass().uuid() == SDPAOverCachePass().uuid()
    assert SDPAOverCachePass(strict=True).uuid() != SDPAOverCachePass().uuid()
    assert SDPAOverCachePass(debug=True).uuid() is None  # debugging bypasses the FX graph cache
    assert math.isfinite(len(SDPAOverCachePass().uuid()))


def test_bad_options():
    with pytest.raises(TypeError, match="strict"):
        SDPAOverCachePass(strict="yes")
    with pytest.raises(TypeError, match="debug"):
        SDPAOverCachePass(debug=3)
