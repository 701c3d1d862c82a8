"""`flashcodec::codec_attention` (reference) equals SDPA over the decoded view, and never builds that view."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashcodec_fx import CodecKVCache, codec_decode_attention, make_codec
from flashcodec_fx.codecs import JPEGCodec, PNGCodec

ops = torch.ops.flashcodec
R = 8
TIERS = {
    "jpeg": make_codec("jpeg", block_size=R),
    "jpeg-int8": make_codec("jpeg", block_size=R, quant_bits=8),
    "png": make_codec("png", block_size=R),
    "jpeg-k3": make_codec("jpeg", block_size=R, keep_freqs=3),
    "png-half": make_codec("png", block_size=R, keep_ratio=0.5),
}
# Tolerance against fp32 SDPA over the decoded view: fp32 1e-6 (accumulation order only); fp16/bf16 outputs are
# rounded once to the stream dtype, |out| <= max|v| < 5, so one ulp at 4..8 is 2**-8 (fp16) and 2**-5 (bf16).
ATOL = {torch.float32: 1e-6, torch.float16: 2.0**-8, torch.bfloat16: 2.0**-5}


def make_cache(k_tier, v_tier, layout, b, hkv, length, d, dtype, seed, max_length=None):
    gen = torch.Generator().manual_seed(seed)
    cache = CodecKVCache(TIERS[k_tier], TIERS[v_tier], layout=layout, max_length=max_length)
    k = torch.randn(b, hkv, length, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, length, d, generator=gen).to(dtype)
    first = max(1, length - 4)  # a prefill, then a few single-token steps
    cache.append(k[:, :, :first], v[:, :, :first])
    for i in range(first, length):
        cache.append(k[:, :, i: i + 1], v[:, :, i: i + 1])
    return cache


def sdpa_over_view(cache, q, mask=None, scale=None):
    """fp32 SDPA over the materialized views (trimmed to the length), kv heads expanded for GQA."""
    length = cache.get_seq_length()
    k, v = (t[:, :, :length].float() for t in cache.read())
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if mask is not None:
        mask = mask[..., :length]
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=scale)


def causal_bool(t, length, width):
    """(1, 1, T, width) True = attend: query i sits at absolute position length - T + i."""
    pos = torch.arange(width)
    return (pos[None] <= (length - t + torch.arange(t))[:, None])[None, None]


@pytest.mark.parametrize("groups", [1, 2, 4, 8])
@pytest.mark.parametrize(("k_tier", "v_tier"), [("jpeg", "jpeg"), ("jpeg-int8", "jpeg-int8"), ("png", "png"),
                                                ("jpeg-k3", "png-half"), ("jpeg-int8", "png")])
def test_matches_sdpa_fp32_no_mask(k_tier, v_tier, groups):
    cache = make_cache(k_tier, v_tier, "dynamic", 2, 2, 43, 16, torch.float32, seed=groups)
    q = torch.randn(2, 2 * groups, 1, 16)
    out = cache.attention(q)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, sdpa_over_view(cache, q), atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("layout", ["dynamic", "static"])
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("tier", ["jpeg", "jpeg-int8", "png"])
def test_matches_sdpa_fp32_with_masks_and_several_queries(tier, groups, mask_kind, layout):
    b, hkv, length, d, t = 2, 2, 37, 16, 3
    cache = make_cache(tier, tier, layout, b, hkv, length, d, torch.float32, seed=11, max_length=60)
    if layout == "static":
        assert cache.read()[0].shape[2] == 64 > length  # capacity past the length, masked by the op itself
    width = 64 if layout == "static" else length
    causal = causal_bool(t, length, width)
    if mask_kind == "bool":
        mask = causal.expand(b, 1, t, width).clone()
        mask[1, 0, :, 5] = False  # some batch-specific holes
    else:
        bias = torch.rand(1, hkv * groups, t, width) - 0.5
        mask = bias.masked_fill(~causal, float("-inf"))
    q = torch.randn(b, hkv * groups, t, d)
    out = cache.attention(q, mask)
    torch.testing.assert_close(out, sdpa_over_view(cache, q, mask), atol=ATOL[torch.float32], rtol=0)
    scaled = cache.attention(q, mask, scale=0.3)
    torch.testing.assert_close(scaled, sdpa_over_view(cache, q, mask, scale=0.3), atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tier", ["jpeg", "jpeg-int8", "png"])
def test_matches_sdpa_half_precision(tier, dtype, groups):
    cache = make_cache(tier, tier, "dynamic", 1, 2, 29, 16, dtype, seed=3)
    q = torch.randn(1, 2 * groups, 2, 16).to(dtype)
    mask = causal_bool(2, 29, 29)
    out = cache.attention(q, mask)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), sdpa_over_view(cache, q, mask), atol=ATOL[dtype], rtol=0)


def test_tail_only_and_block_aligned_lengths():
    for length in (1, 5, 8, 16):
        cache = make_cache("jpeg-int8", "png", "dynamic", 1, 1, length, 8, torch.float32, seed=length)
        q = torch.randn(1, 2, 1, 8)
        torch.testing.assert_close(cache.attention(q), sdpa_over_view(cache, q), atol=1e-6, rtol=0)


def largest_operand(fn) -> int:
    """Run ``fn`` under the profiler; the largest number of elements of any tensor an op (nested ones included) read."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    sizes = [math.prod(shape) for event in prof.events() for shape in event.input_shapes if shape]
    return max(sizes)


def test_never_builds_the_view(monkeypatch):
    """Every decode path raises during the call, and no intermediate is as large as one (S, D) view."""
    cache = make_cache("jpeg-k3", "jpeg-k3", "dynamic", 1, 2, 100, 32, torch.float32, seed=0)
    q = torch.randn(1, 4, 1, 32)
    expected = sdpa_over_view(cache, q)
    state_size = cache.keys.state.data.numel()
    view_size = cache.keys.capacity_blocks * R * 2 * 32

    def boom(*args, **kwargs):
        raise AssertionError("codec_attention materialized the view")

    cache.release_memo()  # reads now go through flashcodec::read, so the patch below is observable
    monkeypatch.setattr(JPEGCodec, "decode", boom)
    monkeypatch.setattr(PNGCodec, "decode", boom)
    monkeypatch.setattr(torch.ops.flashcodec, "decode", boom)
    monkeypatch.setattr(torch.ops.flashcodec, "read", boom)
    with pytest.raises(AssertionError, match="materialized"):
        cache.read()  # the patch is live: the memo-free path would decode
    torch.testing.assert_close(cache.attention(q), expected, atol=1e-6, rtol=0)
    largest = largest_operand(lambda: cache.attention(q))
    assert state_size <= largest < view_size, (largest, view_size)


def attention_args(**changes):
    """Valid codec_attention arguments for B=2, H_kv=2, Hq=4, T=1, D=8 with jpeg-int8 keys and png values."""
    ck, cv = TIERS["jpeg-int8"], TIERS["png"]
    k = ck.empty_state((2, 2), 3, 8, torch.float32, "cpu")
    v = cv.empty_state((2, 2), 3, 8, torch.float32, "cpu")
    args = {"q": torch.randn(2, 4, 1, 8), "k_data": k.data, "k_scale": k.scale, "k_index": k.index,
            "k_tail": torch.zeros(2, 2, R, 8), "v_data": v.data, "v_scale": v.scale, "v_index": v.index,
            "v_tail": torch.zeros(2, 2, R, 8), "length": torch.tensor(5), "spec_k": ck.spec, "spec_v": cv.spec,
            "mask": None}
    args.update(changes)
    return args


BAD_ATTENTION = {
    "q head_dim": ({"q": torch.randn(2, 4, 1, 6)}, "q must be"),
    "q batch": ({"q": torch.randn(3, 4, 1, 8)}, "q must be"),
    "q rank": ({"q": torch.randn(4, 1, 8)}, "q must be"),
    "q dtype": ({"q": torch.randn(2, 4, 1, 8, dtype=torch.float16)}, "dtype"),
    "query heads": ({"q": torch.randn(2, 3, 1, 8)}, "query heads"),
    "v head_dim": ({"v_data": torch.zeros(2, 2, 3, R, 4), "v_index": torch.zeros(2, 2, 3, 0, 4, dtype=torch.uint8),
                    "v_tail": torch.zeros(2, 2, R, 4)}, "head_dim"),
    "v heads": ({"v_data": torch.zeros(2, 1, 3, R, 8), "v_scale": torch.zeros(2, 1, 3, 0),
                 "v_index": torch.zeros(2, 1, 3, 0, 8, dtype=torch.uint8), "v_tail": torch.zeros(2, 1, R, 8)},
                "same"),
    "k state of another codec": ({"spec_k": TIERS["jpeg"].spec}, "spec_k|k_"),
    "v scale dtype": ({"v_scale": torch.zeros(2, 2, 3, 0, dtype=torch.float16)}, "v_scale"),
    "k tail shape": ({"k_tail": torch.zeros(2, 2, R + 1, 8)}, "k_tail"),
    "block sizes": ({"spec_v": make_codec("png", block_size=4).spec, "v_data": torch.zeros(2, 2, 3, 4, 8),
                     "v_tail": torch.zeros(2, 2, 4, 8)}, "block_size"),
    "bad spec": ({"spec_v": [7, 8, 8, 0]}, "spec_v"),
    "length dtype": ({"length": torch.tensor(5, dtype=torch.int32)}, "length"),
    "length rank": ({"length": torch.tensor([5])}, "length"),
    "mask queries": ({"mask": torch.ones(1, 1, 2, 24, dtype=torch.bool)}, "mask"),
    "mask batch": ({"mask": torch.ones(3, 1, 1, 24, dtype=torch.bool)}, "mask"),
    "mask heads": ({"mask": torch.ones(1, 2, 1, 24, dtype=torch.bool)}, "mask"),
    "mask rank": ({"mask": torch.ones(1, 24, dtype=torch.bool)}, "mask"),
    "mask dtype": ({"mask": torch.ones(1, 1, 1, 24, dtype=torch.int64)}, "mask"),
}


@pytest.mark.parametrize("case", list(BAD_ATTENTION))
def test_codec_attention_rejects_mismatched_inputs(case):
    changes, match = BAD_ATTENTION[case]
    with pytest.raises(ValueError, match=match):
        ops.codec_attention(**attention_args(**changes))


def test_codec_attention_accepts_the_valid_baseline_and_broadcast_masks():
    for mask in (None, torch.ones(2, 4, 1, 24, dtype=torch.bool), torch.zeros(1, 1, 1, 24)):
        assert ops.codec_attention(**attention_args(mask=mask)).shape == (2, 4, 1, 8)


def test_streams_of_different_lengths_are_rejected():
    cache = CodecKVCache(TIERS["jpeg"])
    other = CodecKVCache(TIERS["jpeg"])
    cache.append(torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8))
    other.append(torch.randn(1, 1, 7, 8), torch.randn(1, 1, 7, 8))
    with pytest.raises(ValueError, match="length"):
        codec_decode_attention(torch.randn(1, 1, 1, 8), cache.keys, other.values)
