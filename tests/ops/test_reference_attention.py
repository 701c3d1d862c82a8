"""`flashcodec::codec_attention` (reference) equals SDPA over the `flashcodec::read` views of the same state: keys and
values with their own codecs, groups, windows and sinks; GQA; masks; the current call's tokens read exactly."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from _op_states import chunks, expand_kv, fill, new_state
from codec_tiers import kv_like, tier_table

from flashcodec_fx.codecs import JPEGCodec, PNGCodec
from flashcodec_fx.ops.reference.attention import codec_attention_reference

ops = torch.ops.flashcodec
R = 8
TIERS = tier_table(R, low_keep=3)
LENGTH, T_NEW, D, B, H_KV = 41, 9, 16, 2, 2  # the last append (the current call) is T_NEW tokens: it completes groups
# (key tier, value tier): shared and different codecs, groups (1, 8, 16), windows and sinks on either side
PAIRS = [("jpeg", "jpeg"), ("jpeg-int8", "png"), ("jpeg-table", "token-lloyd2"), ("channel-uniform4", "jpeg-midrise4"),
         ("png-window", "jpeg-k3"), ("png-half", "jpeg-table")]
# Against fp32 SDPA over the read views: fp32 1e-5 (accumulation order only); fp16/bf16 outputs are rounded once to the
# stream dtype, |out| < 8, so one ulp there is 2**-8 (fp16) and 2**-5 (bf16).
ATOL = {torch.float32: 1e-5, torch.float16: 2.0**-8, torch.bfloat16: 2.0**-5}


@functools.cache
def streams(k_tier: str, v_tier: str, dtype: torch.dtype = torch.float32, spare: int = 0):
    """K and V states of LENGTH tokens (a prompt, random chunks, then the current call's T_NEW tokens), each with
    ``spare`` positions of capacity past the length; returns (k, v, k_state, v_state)."""
    k = kv_like((B, H_KV, LENGTH, D), dtype, seed=1)
    v = kv_like((B, H_KV, LENGTH, D), dtype, seed=2)
    sizes = chunks(LENGTH - T_NEW, seed=3, largest=7, first=6) + [T_NEW]
    ks, _ = fill(TIERS[k_tier], k, sizes, positions=LENGTH + spare)
    vs, _ = fill(TIERS[v_tier], v, sizes, positions=LENGTH + spare + 3)  # V capacity differs from K's
    return k, v, ks, vs


def sdpa_over_views(q, k_state, v_state, k_tier, v_tier, length, new=None, mask=None, scale=None):
    """fp32 SDPA over ``read`` views trimmed to the length (``new``: read with the current call's tokens)."""
    k_new, v_new = (None, None) if new is None else new
    k = ops.read(k_state, TIERS[k_tier].spec, k_new)[:, :, :length].float()
    v = ops.read(v_state, TIERS[v_tier].spec, v_new)[:, :, :length].float()
    g = q.shape[1] // k.shape[1]
    mask = None if mask is None else mask[..., :length]
    return F.scaled_dot_product_attention(q.float(), expand_kv(k, g), expand_kv(v, g), attn_mask=mask, scale=scale)


def causal(t: int, length: int, width: int) -> torch.Tensor:
    """(1, 1, T, width) bool, True = attend: query i sits at absolute position length - T + i."""
    return (torch.arange(width)[None] <= (length - t + torch.arange(t))[:, None])[None, None]


def make_mask(kind: str, hq: int, t: int, width: int, seed: int = 0):
    if kind == "none":
        return None
    gen = torch.Generator().manual_seed(seed)
    if kind == "bool":
        mask = causal(t, LENGTH, width).expand(B, 1, t, width).clone()
        mask[1, 0, :, 5] = False  # batch-specific holes
        return mask
    bias = torch.rand(1, hq, t, width, generator=gen) - 0.5
    return bias.masked_fill(~causal(t, LENGTH, width), float("-inf"))


# Every pair with GQA 1 / 2 / 4 each under one mask kind, and the preset-like pair under every combination.
GQA_MASKS = [(1, "none"), (2, "bool"), (4, "additive")]
FP32_CASES = [(*pair, g, m) for pair in PAIRS for g, m in GQA_MASKS] + [
    (*PAIRS[2], g, m) for g in (1, 2, 4) for m in ("none", "bool", "additive") if (g, m) not in GQA_MASKS]


@pytest.mark.parametrize("new", [False, True], ids=["stored", "new"])
@pytest.mark.parametrize(("k_tier", "v_tier", "groups", "mask_kind"), FP32_CASES)
def test_matches_sdpa_over_the_read_views_fp32(k_tier, v_tier, groups, mask_kind, new):
    k, v, ks, vs = streams(k_tier, v_tier)
    t = 3
    q = torch.randn(B, H_KV * groups, t, D, generator=torch.Generator().manual_seed(groups))
    mask = make_mask(mask_kind, H_KV * groups, t, LENGTH)
    call = (k[:, :, -T_NEW:], v[:, :, -T_NEW:]) if new else None
    out = ops.codec_attention(q, ks, vs, TIERS[k_tier].spec, TIERS[v_tier].spec, *(call or (None, None)), mask)
    assert out.shape == q.shape and out.dtype == torch.float32
    want = sdpa_over_views(q, ks, vs, k_tier, v_tier, LENGTH, call, mask)
    torch.testing.assert_close(out, want, atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("prompt", [1, 3, 20])
@pytest.mark.parametrize(("k_tier", "v_tier"), PAIRS)
def test_prefill_attends_on_the_exact_prompt(k_tier, v_tier, prompt):
    """The first call (the whole prompt appended, then passed as k_new / v_new) attends on the exact tokens, whatever
    the codecs archived; prompts shorter than the sinks included."""
    kc, vc = TIERS[k_tier], TIERS[v_tier]
    k, v = kv_like((1, 2, prompt, D), seed=10), kv_like((1, 2, prompt, D), seed=11)
    ks, _ = fill(kc, k, [prompt], positions=32)
    vs, _ = fill(vc, v, [prompt], positions=32)
    q = torch.randn(1, 4, prompt, D, generator=torch.Generator().manual_seed(prompt))
    mask = causal(prompt, prompt, 32)
    out = ops.codec_attention(q, ks, vs, kc.spec, vc.spec, k, v, mask)
    want = F.scaled_dot_product_attention(q, expand_kv(k, 2), expand_kv(v, 2), attn_mask=mask[..., :prompt])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("k_tier", "v_tier"), PAIRS[1:4])
def test_new_tokens_change_what_is_read(k_tier, v_tier):
    """Lossy archives: reading the current call's tokens exactly is a different (and real) result."""
    k, v, ks, vs = streams(k_tier, v_tier)
    q = torch.randn(B, H_KV, 2, D, generator=torch.Generator().manual_seed(0))
    spec_k, spec_v = TIERS[k_tier].spec, TIERS[v_tier].spec
    stored = ops.codec_attention(q, ks, vs, spec_k, spec_v)
    exact = ops.codec_attention(q, ks, vs, spec_k, spec_v, k[:, :, -T_NEW:], v[:, :, -T_NEW:])
    assert (stored - exact).abs().max() > 1e-4


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("k_tier", "v_tier"), PAIRS[:4])
def test_matches_sdpa_half_precision(k_tier, v_tier, dtype, groups):
    k, v, ks, vs = streams(k_tier, v_tier, dtype)
    q = torch.randn(B, H_KV * groups, 2, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    mask = causal(2, LENGTH, LENGTH)
    call = (k[:, :, -T_NEW:], v[:, :, -T_NEW:])
    out = ops.codec_attention(q, ks, vs, TIERS[k_tier].spec, TIERS[v_tier].spec, *call, mask)
    assert out.dtype == dtype
    want = sdpa_over_views(q, ks, vs, k_tier, v_tier, LENGTH, call, mask)
    torch.testing.assert_close(out.float(), want, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize(("k_tier", "v_tier"), [PAIRS[2], PAIRS[4]])
def test_scale_argument(k_tier, v_tier):
    _, _, ks, vs = streams(k_tier, v_tier)
    q = torch.randn(B, H_KV * 2, 1, D, generator=torch.Generator().manual_seed(4))
    out = ops.codec_attention(q, ks, vs, TIERS[k_tier].spec, TIERS[v_tier].spec, scale=0.3)
    torch.testing.assert_close(out, sdpa_over_views(q, ks, vs, k_tier, v_tier, LENGTH, scale=0.3), atol=1e-5, rtol=0)
    default = ops.codec_attention(q, ks, vs, TIERS[k_tier].spec, TIERS[v_tier].spec, scale=1 / math.sqrt(D))
    assert torch.equal(default, ops.codec_attention(q, ks, vs, TIERS[k_tier].spec, TIERS[v_tier].spec))


@pytest.mark.parametrize(("k_tier", "v_tier"), PAIRS[1:4])
def test_static_capacity_contract(k_tier, v_tier):
    """Capacity past the length (a static layout): positions past the length are never attended, with no mask or a
    mask as wide as the capacity; the output equals the exact-capacity one and SDPA over the views."""
    k, v, ks, vs = streams(k_tier, v_tier)
    _, _, ks_big, vs_big = streams(k_tier, v_tier, spare=3 * 16)
    view_k = ops.read(ks_big, TIERS[k_tier].spec)
    assert view_k.shape[2] > LENGTH and not view_k[:, :, LENGTH:].any()  # zeros past the length, to be masked
    q = torch.randn(B, H_KV * 2, 3, D, generator=torch.Generator().manual_seed(5))
    spec_k, spec_v = TIERS[k_tier].spec, TIERS[v_tier].spec
    want = sdpa_over_views(q, ks, vs, k_tier, v_tier, LENGTH)
    for kstate, vstate in ((ks, vs), (ks_big, vs_big), (ks, vs_big), (ks_big, vs)):
        torch.testing.assert_close(ops.codec_attention(q, kstate, vstate, spec_k, spec_v), want, atol=1e-5, rtol=0)
    wide = torch.ones(1, 1, 3, view_k.shape[2], dtype=torch.bool)  # True past the length too: the op masks itself
    torch.testing.assert_close(ops.codec_attention(q, ks_big, vs_big, spec_k, spec_v, mask=wide), want, atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize(("k_tier", "v_tier"), PAIRS[2:5])
def test_rolled_back_streams(k_tier, v_tier):
    """After a cut inside the raw tails (length moved back, rows past it zeroed, archive ends kept: a short tail),
    attention reads exactly the first ``keep`` positions, as SDPA over the views does."""
    _, _, ks, vs = streams(k_tier, v_tier)
    keep = max(int(ks.start), int(vs.start))
    assert keep < LENGTH
    cut = []
    for st in (ks, vs):
        st = type(st)(*(t.clone() for t in st))
        st.tail[:, :, keep - int(st.start):].zero_()
        st.length.fill_(keep)
        cut.append(st)
    q = torch.randn(B, H_KV * 2, 2, D, generator=torch.Generator().manual_seed(9))
    out = ops.codec_attention(q, *cut, TIERS[k_tier].spec, TIERS[v_tier].spec)
    torch.testing.assert_close(out, sdpa_over_views(q, *cut, k_tier, v_tier, keep), atol=1e-5, rtol=0)
    full = sdpa_over_views(q, ks, vs, k_tier, v_tier, LENGTH)
    assert (out - full).abs().max() > 1e-4  # the cut tokens are really gone


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_row_that_sees_nothing_gives_zeros(kind):
    _, _, ks, vs = streams(*PAIRS[2])
    spec_k, spec_v = (TIERS[t].spec for t in PAIRS[2])
    q = torch.randn(B, H_KV, 2, D, generator=torch.Generator().manual_seed(6))
    mask = causal(2, LENGTH, LENGTH).expand(B, H_KV, 2, LENGTH).clone()
    mask[0, 1, 0] = False  # batch 0, head 1, query 0 sees nothing
    if kind == "additive":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    out = ops.codec_attention(q, ks, vs, spec_k, spec_v, mask=mask)
    assert bool(torch.isfinite(out).all()) and not out[0, 1, 0].any()
    keep = torch.ones(B, H_KV, 2, dtype=torch.bool)
    keep[0, 1, 0] = False
    want = sdpa_over_views(q, ks, vs, *PAIRS[2], LENGTH, mask=mask)
    torch.testing.assert_close(out[keep], want[keep], atol=1e-5, rtol=0)


def test_empty_streams_give_zeros():
    kc, vc = TIERS["jpeg-table"], TIERS["token-lloyd2"]
    like = torch.zeros(1, 2, 1, 8)
    out = ops.codec_attention(torch.randn(1, 4, 1, 8), new_state(kc, like, 40), new_state(vc, like, 40), kc.spec,
                              vc.spec)
    assert out.shape == (1, 4, 1, 8) and not out.any()


def test_custom_op_serves_the_reference_math():
    """The registered op (the fused CPU kernel where it builds, else the reference itself) computes the reference's
    result, within the CPU kernel's stated fp32 tolerance (tests/ops/test_cpu_attention.py)."""
    k, v, ks, vs = streams(*PAIRS[2])
    spec_k, spec_v = (TIERS[t].spec for t in PAIRS[2])
    q = torch.randn(B, H_KV * 2, 3, D, generator=torch.Generator().manual_seed(7))
    mask = make_mask("additive", H_KV * 2, 3, LENGTH)
    args = (q, ks, vs, spec_k, spec_v, k[:, :, -T_NEW:], v[:, :, -T_NEW:], mask, 0.2)
    torch.testing.assert_close(ops.codec_attention(*args), codec_attention_reference(*args), atol=2e-5, rtol=1e-5)


def largest_operand(fn) -> int:
    """Run ``fn`` under the profiler; the largest number of elements of any tensor an op (nested ones included) read."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    sizes = [math.prod(shape) for event in prof.events() for shape in event.input_shapes if shape]
    return max(sizes)


@pytest.mark.parametrize("tier", ["jpeg-k3", "jpeg-table", "token-lloyd2"])
def test_never_decodes_or_reads_the_view(tier, monkeypatch):
    """Attention runs on the stored rows: decode and read raise during the call, and the result is unchanged. For a
    truncated codec (K < r) no intermediate is as large as the (S, D) view."""
    codec = TIERS[tier]
    x = kv_like((1, 2, 100, 32), torch.float32, seed=8)
    state, _ = fill(codec, x, [100])
    q = torch.randn(1, 4, 1, 32, generator=torch.Generator().manual_seed(8))
    expected = codec_attention_reference(q, state, state, codec.spec, codec.spec)
    view_size = ops.read(state, codec.spec).numel()

    def boom(*args, **kwargs):
        raise AssertionError("codec_attention materialized the view")

    for target in (JPEGCodec, PNGCodec):
        monkeypatch.setattr(target, "decode", boom)
    monkeypatch.setattr(torch.ops.flashcodec, "decode", boom)
    monkeypatch.setattr(torch.ops.flashcodec, "read", boom)
    with pytest.raises(AssertionError, match="materialized"):
        codec.decode(None, torch.float32)  # the patch is live
    assert torch.equal(codec_attention_reference(q, state, state, codec.spec, codec.spec), expected)
    if codec.rows < codec.block_size:
        largest = largest_operand(lambda: codec_attention_reference(q, state, state, codec.spec, codec.spec))
        assert state.data.numel() <= largest < view_size, (largest, view_size)


def attention_args(**changes):
    """Valid codec_attention arguments: B=2, H_kv=2, Hq=4, T=1, D=8, jpeg-table keys and token-lloyd2 values."""
    kc, vc = TIERS["jpeg-table"], TIERS["token-lloyd2"]
    x = kv_like((2, 2, 21, 8), torch.float32, seed=9)
    ks, _ = fill(kc, x, [21], positions=40)
    vs, _ = fill(vc, x, [21], positions=40)
    args = {"q": torch.randn(2, 4, 1, 8), "k_state": ks, "v_state": vs, "spec_k": kc.spec, "spec_v": vc.spec,
            "k_new": None, "v_new": None, "mask": None}
    args.update(changes)
    return args


BAD_ATTENTION = {
    "q head_dim": ({"q": torch.randn(2, 4, 1, 16)}, "q must be"),
    "q batch": ({"q": torch.randn(3, 4, 1, 8)}, "q must be"),
    "q rank": ({"q": torch.randn(4, 1, 8)}, "q must be"),
    "q dtype": ({"q": torch.randn(2, 4, 1, 8, dtype=torch.float16)}, "dtype"),
    "query heads": ({"q": torch.randn(2, 3, 1, 8)}, "query heads"),
    "k state of another codec": ({"spec_k": TIERS["jpeg-int8"].spec}, "k_state"),
    "bad spec_v": ({"spec_v": "gif;r=8;sinks=0;window=0"}, "spec_v"),
    "k_new alone": ({"k_new": torch.randn(2, 2, 1, 8)}, "together"),
    "k_new shape": ({"k_new": torch.randn(2, 3, 1, 8), "v_new": torch.randn(2, 2, 1, 8)}, "k_new must be"),
    "v_new dtype": ({"k_new": torch.randn(2, 2, 1, 8), "v_new": torch.randn(2, 2, 1, 8).half()}, "v_new must be"),
    "new lengths": ({"k_new": torch.randn(2, 2, 2, 8), "v_new": torch.randn(2, 2, 1, 8)}, "same tokens"),
    "mask queries": ({"mask": torch.ones(1, 1, 2, 40, dtype=torch.bool)}, "mask"),
    "mask batch": ({"mask": torch.ones(3, 1, 1, 40, dtype=torch.bool)}, "mask"),
    "mask heads": ({"mask": torch.ones(1, 2, 1, 40, dtype=torch.bool)}, "mask"),
    "mask rank": ({"mask": torch.ones(1, 40, dtype=torch.bool)}, "mask"),
    "mask dtype": ({"mask": torch.ones(1, 1, 1, 40, dtype=torch.int64)}, "mask"),
}


@pytest.mark.parametrize("case", list(BAD_ATTENTION))
def test_rejects_mismatched_inputs(case):
    changes, match = BAD_ATTENTION[case]
    with pytest.raises(ValueError, match=match):
        ops.codec_attention(**attention_args(**changes))


def test_rejects_k_and_v_states_of_different_shapes():
    x = torch.randn(2, 1, 21, 8)
    one_head, _ = fill(TIERS["token-lloyd2"], x, [21], positions=40)
    with pytest.raises(ValueError, match="share"):
        ops.codec_attention(**attention_args(v_state=one_head))
    wide, _ = fill(TIERS["token-lloyd2"], torch.randn(2, 2, 21, 16), [21], positions=40)
    with pytest.raises(ValueError, match="share|head_dim"):
        ops.codec_attention(**attention_args(v_state=wide))


def test_accepts_the_valid_baseline_and_broadcast_masks():
    for mask in (None, torch.ones(2, 4, 1, 40, dtype=torch.bool), torch.zeros(1, 1, 1, 40), torch.zeros(1, 1, 1, 21)):
        assert ops.codec_attention(**attention_args(mask=mask)).shape == (2, 4, 1, 8)
