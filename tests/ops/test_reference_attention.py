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
from flashcodec_fx.presets import PRESETS, preset_codecs

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


# --- variants: softcap, sinks, ALiBi -----------------------------------------------------------------------------

V_LENGTH, V_NEW = 72, 3  # long enough for every preset to archive past its sinks and window


def variant_codecs(name: str):
    """(key, value) codecs: a preset's, else a tier on both sides (``tier/tier``)."""
    if name in PRESETS:
        return preset_codecs(name)
    k_tier, v_tier = name.split("/")
    return TIERS[k_tier], TIERS[v_tier]


# every lossy preset family and lossless, the jpeg block codecs (raw, int8, bit tables, truncated), png exact / pruned
VARIANT_CODECS = ["int8", "4bit", "3bit", "lossless", "jpeg-int8/jpeg", "jpeg-table/jpeg-midrise4", "png/png-half",
                  "png-window/jpeg-k3"]
VARIANTS = ["softcap", "sinks", "alibi", "all"]


@functools.cache
def variant_streams(name: str, dtype: torch.dtype = torch.float32):
    """K and V (B, H_KV, V_LENGTH, D) and their states: a prompt, random chunks, then the call's V_NEW tokens."""
    ck, cv = variant_codecs(name)
    k = kv_like((B, H_KV, V_LENGTH, D), dtype, seed=21)
    v = kv_like((B, H_KV, V_LENGTH, D), dtype, seed=22)
    sizes = chunks(V_LENGTH - V_NEW, seed=23, largest=9, first=20) + [V_NEW]
    ks, _ = fill(ck, k, sizes, positions=V_LENGTH + 5)
    vs, _ = fill(cv, v, sizes, positions=V_LENGTH + 9)
    return k, v, ks, vs


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's geometric slopes ``2 ** (-8 i / heads)``, i = 1..heads (BLOOM's and MPT's for a power of two)."""
    return 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)


def variant_kwargs(kind: str, hq: int, seed: int, sink_dtype: torch.dtype = torch.float32) -> dict:
    """The op's keyword arguments of one variant kind (``all``: the three together). Sink logits near the rows'
    log-sum-exp (about 3 here), so the sink takes a real share of the mass."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    if kind in ("softcap", "all"):
        out["softcap"] = 2.0  # logits of a few units: tanh far from linear
    if kind in ("sinks", "all"):
        out["sinks"] = (3 + torch.randn(hq, generator=gen)).to(sink_dtype)
    if kind in ("alibi", "all"):
        out["alibi"] = alibi_slopes(hq)
    return out


def dense_variants(q, k_state, v_state, spec_k, spec_v, length, new=None, mask=None, scale=None, softcap=None,
                   sinks=None, alibi=None, positions=None):
    """The variants computed densely in fp32 over every stored position, decoded (``flashcodec.read``) and trimmed to
    the length, step by step as transformers' eager attention functions do: the logits scaled; soft-capped (gemma2:
    divided by the cap, tanh, times the cap); the ALiBi bias ``slope * position`` added (``positions``: the positions
    it counts, default ``0..length-1``; BLOOM and MPT count from elsewhere, which softmax does not see); the mask
    added; with sinks the sink column concatenated, the row max subtracted, softmax, the column dropped (gpt_oss),
    else softmax; times the values."""
    k_new, v_new = (None, None) if new is None else new
    k = ops.read(k_state, spec_k, k_new)[:, :, :length].float()
    v = ops.read(v_state, spec_v, v_new)[:, :, :length].float()
    b, hq, t, d = q.shape
    g = hq // k.shape[1]
    logits = q.float() @ expand_kv(k, g).transpose(-1, -2) * (1 / math.sqrt(d) if scale is None else scale)
    if softcap is not None:
        logits = logits / softcap
        logits = torch.tanh(logits)
        logits = logits * softcap
    if alibi is not None:
        pos = torch.arange(length) if positions is None else positions
        logits = logits + alibi.view(1, hq, 1, 1) * pos.float()
    if mask is not None:
        mask = mask[..., :length]
        bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else mask
        logits = logits + bias.float()
    if sinks is None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        column = sinks.float().reshape(1, -1, 1, 1).expand(b, -1, t, -1)
        combined = torch.cat([logits, column], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1]
    return probs @ expand_kv(v, g)


def variant_case(name, kind, groups, mask_kind, new, dtype=torch.float32, seed=0):
    """One call's arguments: (q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask) and the variant keywords."""
    ck, cv = variant_codecs(name)
    k, v, ks, vs = variant_streams(name, dtype)
    t = V_NEW if new else 1
    hq = H_KV * groups
    q = torch.randn(B, hq, t, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
    mask = None
    if mask_kind == "bool":
        mask = causal(t, V_LENGTH, V_LENGTH + 2).expand(B, 1, t, -1).clone()
        mask[1, 0, :, 4] = False  # batch-specific holes
    elif mask_kind == "additive":
        mask = (torch.rand(1, hq, t, V_LENGTH + 2, generator=torch.Generator().manual_seed(seed + 1)) - 0.5).masked_fill(
            ~causal(t, V_LENGTH, V_LENGTH + 2), float("-inf"))
    call = (k[:, :, -t:], v[:, :, -t:]) if new else (None, None)
    sink_dtype = torch.float32 if dtype == torch.float32 else dtype  # GPT-OSS keeps its sinks in the model dtype
    return (q, ks, vs, ck.spec, cv.spec, *call, mask), variant_kwargs(kind, hq, seed, sink_dtype)


GQA_CYCLE = [(1, "none"), (2, "bool"), (3, "additive")]
HALF_RTOL = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # one ulp
VARIANT_CASES = [(name, kind, *GQA_CYCLE[(i + j) % 3], new) for i, name in enumerate(VARIANT_CODECS)
                 for j, kind in enumerate(VARIANTS) for new in (False, True)]


@pytest.mark.parametrize(("name", "kind", "groups", "mask_kind", "new"), VARIANT_CASES)
def test_variants_match_a_dense_computation_fp32(name, kind, groups, mask_kind, new):
    """Softcap, sinks, ALiBi and all three: the op equals the dense fp32 computation over the decoded view, for
    presets and block codecs, GQA groups 1 / 2 / 3, no / bool / additive masks, a decode step (T=1, stored tokens
    only) and a chunk of T=3 read exactly from k_new / v_new; and the variant changes the result."""
    args, kw = variant_case(name, kind, groups, mask_kind, new, seed=groups)
    new_tokens = args[5:7] if new else None
    want = dense_variants(args[0], args[1], args[2], args[3], args[4], V_LENGTH, new_tokens, args[7], **kw)
    for attention in (codec_attention_reference, ops.codec_attention):  # the spec; the op (its CPU kernel)
        out = attention(*args, **kw)
        assert out.shape == args[0].shape and out.dtype == torch.float32
        torch.testing.assert_close(out, want, atol=ATOL[torch.float32], rtol=0)
        assert (out - attention(*args)).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", VARIANT_CODECS)
def test_variants_match_a_dense_computation_half_precision(name, dtype):
    """All three variants on fp16 / bf16 streams (the sinks in the stream dtype, as GPT-OSS keeps them), GQA 2, a
    causal mask, T=3 with the call's tokens. As the plain op against SDPA (ATOL: the view, rounded to the stream dtype,
    against the op's fp32 reads of the stored form), plus one ulp of the output (|out| passes 8 here)."""
    args, kw = variant_case(name, "all", 2, "bool", True, dtype, seed=5)
    assert kw["sinks"].dtype == dtype
    want = dense_variants(args[0], *args[1:5], V_LENGTH, args[5:7], args[7], **kw)
    for attention in (codec_attention_reference, ops.codec_attention):
        out = attention(*args, **kw)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), want, atol=ATOL[dtype], rtol=HALF_RTOL[dtype])


def test_sinks_match_gpt_oss_eager_attention():
    """transformers' own gpt_oss ``eager_attention_forward`` over the decoded view (fp32) is the sinks' spec."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    args, kw = variant_case("4bit", "sinks", 3, "additive", True, seed=11)
    q, ks, vs, spec_k, spec_v, k_new, v_new, mask = args
    k = ops.read(ks, spec_k, k_new)[:, :, :V_LENGTH]
    v = ops.read(vs, spec_v, v_new)[:, :, :V_LENGTH]
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = kw["sinks"], 3, False
    want, _ = gpt_oss.eager_attention_forward(module, q, k, v, mask[..., :V_LENGTH], scaling=0.125)
    out = ops.codec_attention(*args, scale=0.125, **kw)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-5, rtol=0)


def test_softcap_matches_gemma2_eager_attention():
    """transformers' gemma2 ``eager_attention_forward`` (softcap 50, as Gemma 2's attention logits; q scaled up so
    that the cap bends them) over the decoded view."""
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    args, _ = variant_case("jpeg-table/jpeg-midrise4", "softcap", 2, "bool", True, seed=12)
    q, ks, vs, spec_k, spec_v, k_new, v_new, mask = args
    q = q * 60
    k = ops.read(ks, spec_k, k_new)[:, :, :V_LENGTH]
    v = ops.read(vs, spec_v, v_new)[:, :, :V_LENGTH]
    module = torch.nn.Module()
    module.num_key_value_groups, module.training, module.head_dim = 2, False, D
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[..., :V_LENGTH]
    want, _ = gemma2.eager_attention_forward(module, q, k, v, additive, softcap=50.0)
    out = ops.codec_attention(q, *args[1:], softcap=50.0)
    assert (out - ops.codec_attention(q, *args[1:])).abs().max() > 1e-2  # the cap bends logits of this size
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-5, rtol=0)


def test_alibi_matches_bloom_and_mpt_biases():
    """``alibi[h] * pos`` (the op's positions) equals BLOOM's bias ``slope * (pos - first non-pad position)`` under
    left padding (transformers' ``build_alibi_tensor``) and MPT's ``slope * (pos - (S - 1))``
    (``build_mpt_alibi_tensor``), the row shifts softmax does not see."""
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    mpt = pytest.importorskip("transformers.models.mpt.modeling_mpt")
    hq = 2 * H_KV
    args, _ = variant_case("int8", "alibi", 2, "none", True, seed=13)
    q, ks, vs, spec_k, spec_v, k_new, v_new, _ = args
    pad = torch.tensor([0, 7])  # row 1 left-padded by 7 tokens
    keep = torch.arange(V_LENGTH)[None] >= pad[:, None]  # (B, S): the attention mask BLOOM builds its bias from
    mask = keep[:, None, None, :] & causal(V_NEW, V_LENGTH, V_LENGTH)
    k = ops.read(ks, spec_k, k_new)[:, :, :V_LENGTH].float()
    v = ops.read(vs, spec_v, v_new)[:, :, :V_LENGTH].float()
    logits = q @ expand_kv(k, 2).transpose(-1, -2) / math.sqrt(D)
    masked = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    bloom_bias = bloom.build_alibi_tensor(keep.long(), hq, torch.float32).view(B, hq, 1, V_LENGTH)
    slopes = bloom_bias[0, :, 0, 1].contiguous()  # row 0 is unpadded: the bias at position 1 is the slope
    want = torch.softmax(logits + bloom_bias + masked, -1) @ expand_kv(v, 2)
    out = ops.codec_attention(q, ks, vs, spec_k, spec_v, k_new, v_new, mask, alibi=slopes)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    mpt_bias = mpt.build_mpt_alibi_tensor(hq, V_LENGTH)  # (Hq, 1, S)
    mpt_slopes = (mpt_bias[:, 0, -1] - mpt_bias[:, 0, -2]).contiguous()
    want = torch.softmax(logits + mpt_bias[None] + masked, -1) @ expand_kv(v, 2)
    out = ops.codec_attention(q, ks, vs, spec_k, spec_v, k_new, v_new, mask, alibi=mpt_slopes)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


def test_sinks_take_the_mass_of_a_row_that_sees_nothing():
    """With sinks, a row whose keys are all masked puts its whole mass on the sink: zeros, not NaN; the other rows
    match the dense computation."""
    args, kw = variant_case("jpeg-table/jpeg-midrise4", "sinks", 2, "bool", False, seed=14)
    mask = args[7].expand(B, 2 * H_KV, 1, -1).clone()
    mask[0, 3] = False
    args = (*args[:7], mask)
    out = ops.codec_attention(*args, **kw)
    assert bool(torch.isfinite(out).all()) and not out[0, 3].any()
    want = dense_variants(args[0], *args[1:5], V_LENGTH, None, mask, **kw)
    keep = torch.ones(B, 2 * H_KV, dtype=torch.bool)
    keep[0, 3] = False
    torch.testing.assert_close(out[keep], want[keep], atol=1e-5, rtol=0)


def test_neutral_variants_change_nothing():
    """A sink of -inf (no mass) and slopes of 0 (no bias) give the plain op's result bitwise; a cap far above the
    logits almost nothing."""
    args, _ = variant_case("3bit", "all", 2, "additive", True, seed=15)
    plain = ops.codec_attention(*args)
    assert torch.equal(ops.codec_attention(*args, sinks=torch.full((4,), float("-inf"))), plain)
    assert torch.equal(ops.codec_attention(*args, alibi=torch.zeros(4)), plain)
    torch.testing.assert_close(ops.codec_attention(*args, softcap=1e4), plain, atol=1e-5, rtol=0)


BAD_VARIANTS = {
    "softcap zero": ({"softcap": 0.0}, ValueError, "softcap must be a positive finite float"),
    "softcap negative": ({"softcap": -30.0}, ValueError, "softcap must be a positive finite float"),
    "softcap inf": ({"softcap": float("inf")}, ValueError, "softcap must be a positive finite float"),
    "softcap nan": ({"softcap": float("nan")}, ValueError, "softcap must be a positive finite float"),
    "sinks per kv head": ({"sinks": torch.zeros(2)}, ValueError, r"sinks must have shape \(Hq,\) = \(4,\)"),
    "sinks 2-d": ({"sinks": torch.zeros(1, 4)}, ValueError, r"sinks must have shape \(Hq,\)"),
    "sinks int": ({"sinks": torch.zeros(4, dtype=torch.int64)}, TypeError, "sinks must be a float tensor"),
    "sinks device": ({"sinks": torch.zeros(4, device="meta")}, ValueError, "sinks must be on q's device"),
    "alibi shape": ({"alibi": torch.zeros(8)}, ValueError, r"alibi must have shape \(Hq,\) = \(4,\)"),
    "alibi fp16": ({"alibi": torch.zeros(4, dtype=torch.float16)}, TypeError, "alibi must be a float32 tensor"),
    "alibi bf16": ({"alibi": torch.zeros(4, dtype=torch.bfloat16)}, TypeError, "alibi must be a float32 tensor"),
    "alibi device": ({"alibi": torch.zeros(4, device="meta")}, ValueError, "alibi must be on q's device"),
}


@pytest.mark.parametrize("case", list(BAD_VARIANTS))
def test_rejects_bad_variants_naming_the_parameter(case):
    """Through the op (its CPU kernel checks as the reference does) and through the reference itself."""
    changes, error, match = BAD_VARIANTS[case]
    with pytest.raises(error, match=match):
        ops.codec_attention(**attention_args(**changes))
    with pytest.raises(error, match=match):
        codec_attention_reference(**attention_args(**changes))


@pytest.mark.parametrize(("changes", "match"), [({"softcap": "30"}, "softcap must be a float or None, got str"),
                                                ({"softcap": True}, "softcap must be a float or None, got bool"),
                                                ({"sinks": [0.0] * 4}, "sinks must be a tensor"),
                                                ({"alibi": 0.5}, "alibi must be a tensor")])
def test_rejects_variants_of_the_wrong_type(changes, match):
    """Types the op's schema turns away before any kernel (a str softcap, a list) raise TypeError in the reference."""
    with pytest.raises(TypeError, match=match):
        codec_attention_reference(**attention_args(**changes))


def test_positional_calls_keep_their_meaning():
    """The schema grew at its end only: the nine positional arguments mean what they meant, and the variants follow
    ``scale`` in the order softcap, sinks, alibi."""
    names = [a.name for a in ops.codec_attention.default._schema.arguments]
    assert names == ["q", "k_state", "v_state", "spec_k", "spec_v", "k_new", "v_new", "mask", "scale", "softcap",
                     "sinks", "alibi"]
    args, kw = variant_case("int8", "all", 2, "bool", True, seed=16)
    assert torch.equal(ops.codec_attention(*args, 0.3, kw["softcap"], kw["sinks"], kw["alibi"]),
                       ops.codec_attention(*args, scale=0.3, **kw))
