"""Triton codec_attention (split-K + combine) against the plain-torch reference, on every stored form."""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICES, form, groups_for, preset_codecs, smooth, stored_state, to

from flashcodec_fx import PRESETS
from flashcodec_fx.codecs import Encoded, make_codec
from flashcodec_fx.ops.reference.attention import codec_attention_reference
from flashcodec_fx.ops.reference.read import read_reference
from flashcodec_fx.ops.state import StreamState
from flashcodec_fx.ops.triton.attention import attention_plan, split_partials, tile_plan, triton_codec_attention

F32, F16 = torch.float32, torch.float16
# fp32: sums in another order (split partials, dot tiles, the rotations as dots); 16-bit: both round the fp32
# result once to the output dtype (one ulp apart at most), the kernel also rounds the probabilities for its
# 16-bit dots (as flash attention does).
TOL = {F32: 2e-5, F16: 3e-3, torch.bfloat16: 2.5e-2}
# (k form, v form, dtype, GQA group, length, query tokens T, new tokens, head_dim, mask kind, spare groups)
CASES = [
    ("jpeg_k8", "jpeg_k8", F32, 1, 37, 1, 0, 16, None, 1),
    ("jpeg_k3", "png_pruned", F16, 2, 32, 1, 0, 16, "bool", 1),  # on a group boundary
    ("int8", "int8", F32, 4, 29, 1, 0, 16, "additive", 2),
    ("png", "int8", F16, 8, 21, 1, 0, 16, None, 1),
    ("png_pruned", "jpeg_k3", F32, 2, 27, 3, 3, 24, "additive", 1),
    ("uniform4", "lloyd_rot", F16, 4, 45, 1, 0, 16, "bool", 1),
    ("mixed_bits", "lloyd_uniform", F32, 1, 42, 2, 2, 16, "bool", 2),
    ("dct_channel", "lloyd_rot", F16, 4, 4 + 128, 1, 1, 16, "additive", 1),  # keys: rotation + channel-scale fold
    ("dct_channel", "channel_v", F32, 2, 150, 2, 0, 16, None, 1),  # values: channel-scale fold on the output
    ("token_channel", "lloyd_rot", F32, 8, 70, 1, 0, 64, "bool", 1),  # four rotation chunks of 16 channels
    ("channel_unfolded", "midrise_offset", F16, 1, 50, 1, 0, 16, "bool", 1),  # dequantized in registers; offset
    ("jpeg_r6", "token_r4", F32, 2, 50, 1, 0, 16, None, 1),  # tiles of lcm(6, 4) * 4 = 48 positions
    ("int8", "jpeg_k8", F32, 8, 30, 9, 0, 16, None, 1),  # 72 query rows: two row chunks
]

# Trellis codes (levels="tcq"): each value's alphabet index from its code and the low bits of the three codes before
# it in its row, built in the tile from shifted loads; same tolerance (1..4 bits, fp32 and fp16, keys and values; a
# DCT table of trellis rows with every slice width; beside scalar codes, head_dim 64)
TRELLIS_CASES = [(f"tcq{b}", f"tcq{b}", dtype, 2, 45, 1, 0, 16, "bool", 1) for b in (1, 2, 3, 4) for dtype in (F32, F16)]
TRELLIS_CASES += [("tcq_table", "tcq2", F32, 4, 42, 2, 2, 16, "additive", 2),
                  ("int8", "tcq3", F16, 1, 70, 1, 0, 64, None, 1), ("tcq4", "lloyd_rot", F32, 8, 37, 3, 3, 16, None, 1)]


def _ids(cases):
    return [f"{c[0]}-{c[1]}-{str(c[2])[6:]}-g{c[3]}-L{c[4]}-T{c[5]}-new{c[6]}-D{c[7]}-{c[8]}" for c in cases]


def _mask(kind, b, hq, t, width, gen):
    if kind == "bool":
        m = torch.rand(b, 1, t, width, generator=gen) > 0.3
        m[0, 0, 0, :] = False  # a query that sees nothing: the output row is zero in both
        return m
    if kind == "additive":
        m = torch.randn(1, hq, t, width, generator=gen)
        return m.masked_fill(torch.rand(1, hq, t, width, generator=gen) > 0.7, float("-inf"))
    return None


def _inputs(ck, cv, dtype, group, length, t, new, d, mask_kind, spare, seed=0):
    """q, the reference states of K and V (a prefill then single tokens, the call's ``new`` tokens last), the new
    tokens, the mask (over the capacity, 3 columns more)."""
    b, hkv = 2, 2
    gen = torch.Generator().manual_seed(seed)
    k = smooth(b, hkv, length, d, dtype, "cpu", seed + 1)
    v = smooth(b, hkv, length, d, dtype, "cpu", seed + 2)
    chunks = [1, 1] + ([new] if new else [1])
    ks = stored_state(ck, k, groups_for(ck, length, spare), chunks)
    vs = stored_state(cv, v, groups_for(cv, length, spare), chunks)
    q = torch.randn(b, hkv * group, t, d, generator=gen).to(dtype)
    width = max(ck.sinks + ks[0].shape[2] * ck.group, cv.sinks + vs[0].shape[2] * cv.group) + 3
    news = (k[:, :, length - new:], v[:, :, length - new:]) if new else (None, None)
    return q, ks, vs, ck.spec, cv.spec, *news, _mask(mask_kind, b, hkv * group, t, width, gen)


def _run(device, args, **kw):
    moved = [a.to(device) if isinstance(a, torch.Tensor) else [x.to(device) for x in a] if isinstance(a, list) else a
             for a in args]
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    return triton_codec_attention(*moved, **kw).cpu()


def _check(device, args, **kw):
    want = codec_attention_reference(*args, **{k: v for k, v in kw.items() if k != "num_splits"})
    got = _run(device, args, **kw)
    q = args[0]
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[q.dtype], rtol=TOL[q.dtype])
    return got, want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES + TRELLIS_CASES, ids=_ids(CASES + TRELLIS_CASES))
def test_attention_matches_reference(device, case):
    k_form, v_form, *rest = case
    args = _inputs(form(k_form), form(v_form), *rest)
    got, _ = _check(device, args, num_splits=2)
    if case[8] == "bool":
        assert got[0, :, 0].abs().max() == 0  # fully masked rows are zero


@pytest.mark.parametrize("device", DEVICES)
def test_trellis_codes_are_not_read_as_levels(monkeypatch, device):
    """The trellis decode matters: the same codes read as plain table indices (no window of low bits) are far from
    the reference, so the tolerance above tells the two apart."""
    from flashcodec_fx.ops.triton.common import StreamForm

    args = _inputs(form("tcq3"), form("tcq3"), F32, 2, 45, 1, 0, 16, None, 1)
    want = codec_attention_reference(*args)
    of = StreamForm.of.__func__
    monkeypatch.setattr(StreamForm, "of", classmethod(
        lambda cls, plan, fold=False, offset=0: of(cls, plan, fold, offset)._replace(tcq=False)))
    assert (_run(device, args, num_splits=2) - want).abs().max() > 100 * TOL[F32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_match_reference(device, preset):
    """Every named preset's (key, value) codecs, as a chunked prefill reads them: 4 new tokens, a causal mask."""
    ck, cv = preset_codecs(preset)
    length, t = 4 + 128 + 21, 4
    args = list(_inputs(ck, cv, F16, 3, length, t, t, 16, None, 1, seed=7))
    width = args[-1] if args[-1] is not None else max(ck.sinks + args[1][0].shape[2] * ck.group,
                                                       cv.sinks + args[2][0].shape[2] * cv.group)
    causal = torch.arange(width)[None] <= (length - t + torch.arange(t))[:, None]
    args[-1] = causal[None, None]
    _check(device, tuple(args), num_splits=3)


def _variants(kind: str, hq: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """The variant keywords of ``kind`` (``all``: the three): a softcap bending unit-scale logits, sink logits in the
    stream dtype near the rows' log-sum-exp, ALiBi's geometric slopes."""
    gen = torch.Generator().manual_seed(seed + 50)
    out = {}
    if kind in ("softcap", "all"):
        out["softcap"] = 1.5
    if kind in ("sinks", "all"):
        out["sinks"] = (2 + 1.5 * torch.randn(hq, generator=gen)).to(dtype)
    if kind in ("alibi", "all"):
        out["alibi"] = 2.0 ** (-8.0 * torch.arange(1, hq + 1) / hq)
    return out


# archived forms of every kind (codes per token / block / channel fold / in registers, float rows, png), GQA 1..8,
# masks, new tokens, sinks and offsets, two row chunks
VARIANT_CASES = [CASES[i] for i in (0, 2, 4, 5, 7, 10, 12)] + [TRELLIS_CASES[4]]  # + 3-bit trellis codes, fp32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["softcap", "sinks", "alibi", "all"])
@pytest.mark.parametrize("case", VARIANT_CASES, ids=_ids(VARIANT_CASES))
def test_variants_match_reference(device, case, kind):
    """Softcap, sinks and ALiBi (alone, together) within the plain kernel's tolerance; rows a bool mask leaves
    empty are zeros with sinks too."""
    k_form, v_form, dtype, group, *rest = case
    args = _inputs(form(k_form), form(v_form), dtype, group, *rest)
    kw = _variants(kind, args[0].shape[1], dtype)
    got, _ = _check(device, args, num_splits=2, **kw)
    if case[8] == "bool":
        assert got[0, :, 0].abs().max() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_with_variants(device, preset):
    """Every preset as test_presets_match_reference reads it (a chunked prefill, causal), the three variants on."""
    ck, cv = preset_codecs(preset)
    length, t = 4 + 128 + 21, 4
    args = list(_inputs(ck, cv, F16, 3, length, t, t, 16, None, 1, seed=7))
    width = max(ck.sinks + args[1][0].shape[2] * ck.group, cv.sinks + args[2][0].shape[2] * cv.group)
    args[-1] = (torch.arange(width)[None] <= (length - t + torch.arange(t))[:, None])[None, None]
    _check(device, tuple(args), num_splits=3, **_variants("all", args[0].shape[1], F16))


@pytest.mark.parametrize("device", DEVICES)
def test_variants_validate_and_keep_positional_calls(device):
    """Bad variants raise as the reference does, naming the parameter; the launcher takes the schema's order
    (``scale, softcap, sinks, alibi``) positionally, ``num_splits`` after them."""
    q, ks, vs, sk, sv, kn, vn, _ = _inputs(form("int8"), form("lloyd_rot"), F32, 2, 27, 2, 2, 16, None, 1)
    base = (q, ks, vs, sk, sv, kn, vn, None)
    with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\)"):
        _run(device, base, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="alibi must be a float32 tensor"):
        _run(device, base, alibi=torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="softcap must be a positive"):
        _run(device, base, softcap=0.0)
    kw = _variants("all", 4, F32)
    named = _run(device, base, scale=0.3, num_splits=2, **kw)
    positional = _run(device, (*base, 0.3, kw["softcap"], kw["sinks"], kw["alibi"]), num_splits=2)
    assert torch.equal(named, positional)


@pytest.mark.parametrize("device", DEVICES)
def test_split_counts_agree(device):
    args = _inputs(form("dct_channel"), form("lloyd_rot"), F32, 2, 4 + 3 * 64 + 5, 1, 0, 16, "additive", 2)
    want = codec_attention_reference(*args)
    for splits in (1, 3, None):
        torch.testing.assert_close(_run(device, args, num_splits=splits), want, atol=TOL[F32], rtol=TOL[F32])


@pytest.mark.parametrize("device", DEVICES)
def test_scale_strides_and_validation(device):
    """Any strides of q, k_new, v_new and the mask (broadcast dims by stride 0); an explicit scale; bad inputs raise
    like the reference, a non-contiguous state names the tensor."""
    q, ks, vs, sk, sv, kn, vn, _ = _inputs(form("int8"), form("lloyd_rot"), F32, 2, 27, 2, 2, 16, None, 1)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    kn_wide, vn_wide = torch.stack([kn, -kn], -1).flatten(-2)[..., ::2], torch.cat([vn, -vn], 2)[:, :, :2]
    mask = torch.ones(1, 1, 1, 80, dtype=torch.bool).expand(2, 4, 2, 80)
    assert torch.equal(kn_wide, kn) and torch.equal(vn_wide, vn) and torch.equal(q_t, q)
    assert not q_t.is_contiguous() and kn_wide.stride(3) == 2 and mask.stride(1) == 0
    want = codec_attention_reference(q, ks, vs, sk, sv, kn, vn, None, 0.3)
    got = _run(device, (q_t, ks, vs, sk, sv, kn_wide, vn_wide, mask), scale=0.3)
    torch.testing.assert_close(got, want, atol=TOL[F32], rtol=TOL[F32])
    with pytest.raises(ValueError, match="query heads"):
        _run(device, (q[:, :3], ks, vs, sk, sv, kn, vn, None))
    with pytest.raises(ValueError, match="mask must be"):
        _run(device, (q, ks, vs, sk, sv, kn, vn, torch.ones(2, 1, 2, 40, dtype=torch.int32)))
    with pytest.raises(ValueError, match="num_splits"):
        _run(device, (q, ks, vs, sk, sv, kn, vn, None), num_splits=0)
    strided = [x.to(device) for x in ks]  # made on the device: moving a strided tensor there would pack it
    tail = StreamState._fields.index("tail")
    strided[tail] = torch.cat([strided[tail], strided[tail]], 3)[..., :16]
    with pytest.raises(ValueError, match="k_state.tail must be contiguous"):
        _run(device, (q, strided, vs, sk, sv, kn, vn, None))


def test_plan_heuristic():
    cpu = torch.device("cpu")
    # DCT keys with one scale per channel over 128-token groups, 2-bit rotated per-token values
    k3 = make_codec("jpeg", block_size=8, quant_bits=(5, 3, 3, 2, 2, 2, 2, 2), levels=("uniform", "midrise"),
                    scale_axis="channel", group=128, scale_search=True, rotate=1, sinks=4)
    v3 = make_codec("jpeg", block_size=1, quant_bits=2, levels="lloyd", rotate=1, center=True, scale_search=True,
                    sinks=4, window=32)
    plan = attention_plan(1, 8, 4, k3, v3, 512, 128, cpu)
    tiles = plan["tiles"]
    assert plan["BLOCK_M"] == 16 and tiles.positions == 64  # 4 query rows padded to 16; 64 positions per tile
    assert plan["tile_plan"].fold_k and not plan["tile_plan"].fold_v  # keys' scale group of 128 holds 2 tiles
    assert tiles.key_blocks == 8 and tiles.value_blocks == 64 and plan["num_warps"] == 8
    assert 1 <= plan["num_splits"] <= 512 * 128 // 64  # never more splits than tiles
    long = attention_plan(1, 8, 4, k3, v3, 4096, 128, cpu)
    assert long["num_splits"] >= plan["num_splits"]
    unfolded = tile_plan(form("channel_unfolded"), form("midrise_offset"))
    assert not unfolded.fold_k and not unfolded.fold_v and unfolded.value_offset == (3 - 1) % 4
    assert tile_plan(form("jpeg_r6"), form("token_r4")).positions == 48
    wide = attention_plan(2, 2, 8 * 17, form("int8"), form("int8"), 10, 64, cpu)
    assert wide["BLOCK_M"] == 64 and wide["n_mchunk"] == 3  # 136 query rows: three 64-row programs
    tiny = attention_plan(1, 1, 1, form("jpeg_k3"), form("jpeg_k3"), 3, 16, cpu, num_splits=64)
    assert tiny["num_splits"] == 1 and tiny["num_warps"] == 4  # never more splits than tiles


@pytest.mark.parametrize("device", DEVICES)
def test_split_ranges_follow_the_device_length(device):
    """A short fill of a large static cache (40 blocks + 3 tokens stored of 256): the stored tiles are dealt over
    the splits from the device length (5 tiles of 64 positions over 4 splits: 2, 2, 1, 0), not from the capacity
    (which would put all 40 blocks in split 0), and the result still matches the reference."""
    ck, cv = form("int8"), form("jpeg_k8")
    args = _inputs(ck, cv, F32, 2, 40 * 8 + 3, 1, 0, 16, None, 256 - 40)
    moved = [a.to(device) if isinstance(a, torch.Tensor) else [x.to(device) for x in a] if isinstance(a, list) else a
             for a in args]
    _, lse, plan = split_partials(*moved[:7], None, None, 4)
    assert plan["num_splits"] == 4 and plan["tiles"].positions == 64
    saw = torch.isfinite(lse.cpu()).all(-1)  # (programs, splits + 1): every query row of the part saw something
    assert saw[:, :4].tolist() == [[True, True, True, False]] * saw.shape[0] and saw[:, 4].all()  # + the edge
    want = codec_attention_reference(*args)
    torch.testing.assert_close(_run(device, args, num_splits=4), want, atol=TOL[F32], rtol=TOL[F32])


@pytest.mark.parametrize("device", [d for d in DEVICES if d == "cpu"])  # the interpreter: 3 GiB on a GPU is not worth it
def test_long_mask_offsets_are_int64(device):
    """A (1, 1, 3, 2**30 + 64) bool mask (3 GiB of address space, only three pages touched): the offset of query
    row 2, ``2 * (2**30 + 64)``, passes 2**31; int32 offsets would wrap and read outside the mask."""
    q, ks, vs, sk, sv, kn, vn, _ = _inputs(form("int8"), form("png"), F32, 1, 21, 3, 0, 16, None, 1)
    width = 2**30 + 64
    mask = torch.empty(1, 1, 3, width, dtype=torch.bool)  # lazily backed: the untouched pages cost nothing
    gen = torch.Generator().manual_seed(3)
    for row in range(3):
        mask[0, 0, row, :32] = torch.rand(32, generator=gen) > 0.4
    args = (q, ks, vs, sk, sv, kn, vn, mask)
    want = codec_attention_reference(*args)
    torch.testing.assert_close(_run(device, args, num_splits=1), want, atol=TOL[F32], rtol=TOL[F32])


def _stored_positions(codec, state):
    """(B, H, n, D) fp32 of what a stream holds at its valid positions: below the archive's end (capped by the
    capacity) from the decoded view, from ``start`` on the raw tail: an overflowed stream lost the positions between."""
    length, start = int(state[7]), int(state[8])
    capacity = codec.sinks + state[0].shape[2] * codec.group
    view = read_reference(state, codec.spec).float()
    return torch.cat([view[:, :, : min(start, capacity, length)], state[6][:, :, : length - start].float()], dim=2)


@pytest.mark.parametrize("device", DEVICES)
def test_overflowed_stream_attends_what_it_holds(device):
    """An overflowed static stream (45 tokens appended to 4 blocks of 8: the 8 tokens past the capacity were dropped,
    the tail holds 40..44): the kernel attends the 32 archived positions and the 5 tail rows, exactly SDPA over them.
    (The reference op clamps slot positions to its slot count, so there it folds the tail rows past the capacity onto
    one position; this test uses SDPA over the stored tokens instead.)"""
    c = form("int8")
    ks = stored_state(c, smooth(2, 2, 45, 16, F32, "cpu", 1), 4, [3])
    vs = stored_state(c, smooth(2, 2, 45, 16, F32, "cpu", 2), 4, [3])
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(0))
    assert int(ks[7]) == 45 and int(ks[8]) == 40 and ks[0].shape[2] == 4
    k, v = _stored_positions(c, ks), _stored_positions(c, vs)
    assert k.shape[2] == 32 + 5
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    got = _run(device, (q, ks, vs, c.spec, c.spec, None, None, None), num_splits=2)
    torch.testing.assert_close(got, want, atol=TOL[F32], rtol=TOL[F32])


def test_attention_names_the_triton_limits():
    from flashcodec_fx.ops.triton.common import MAX_BLOCK_SIZE, MAX_HEAD_DIM, MAX_PRUNED_BLOCK_SIZE

    def call(ck, cv, d=16):
        ks = stored_state(ck, torch.zeros(1, 1, 70, d), 2)
        vs = stored_state(cv, torch.zeros(1, 1, 70, d), 2)
        triton_codec_attention(torch.zeros(1, 1, 1, d), ks, vs, ck.spec, cv.spec)

    pruned = make_codec("png", block_size=2 * MAX_PRUNED_BLOCK_SIZE, keep_ratio=0.5)
    plain = make_codec("jpeg", block_size=8)
    with pytest.raises(ValueError, match=f"spec_k: .* block_size <= {MAX_PRUNED_BLOCK_SIZE}"):
        call(pruned, plain)
    with pytest.raises(ValueError, match=f"spec_v: .* block_size <= {MAX_BLOCK_SIZE}"):
        call(plain, make_codec("jpeg", block_size=2 * MAX_BLOCK_SIZE, keep_freqs=2))
    with pytest.raises(ValueError, match=f"head_dim <= {MAX_HEAD_DIM}"):
        call(plain, plain, d=2 * MAX_HEAD_DIM)
    with pytest.raises(ValueError, match=r"lcm\(block_size of k, block_size of v\) <= 256, got lcm\(63, 64\)"):
        call(make_codec("jpeg", block_size=63, keep_freqs=2), make_codec("jpeg", block_size=64, keep_freqs=2))


@pytest.mark.parametrize("device", DEVICES)
def test_codes_enter_the_dot_exactly(device):
    """fp16 I/O, int8 V (jpeg r=4, DC only: A[:, 0] = 0.5), q = 0: every probability is exactly 1 and each block's
    folded probability times its scale (2 * s, s = 2**-3 * (1 + 2**-10) * 2**e) is exact in fp16, while most
    ``level * s`` are not: the kernel must fold V's scales into the probabilities and feed the codes to the dot as
    they are. Its fp32 partial output then matches the fp32 reference to fp32 rounding; rounding the dequantized
    rows to fp16 first (what a dequantize-then-dot kernel does) is off by ~1e-4 relative."""
    ck, cv = make_codec("jpeg", block_size=4), make_codec("jpeg", block_size=4, keep_freqs=1, quant_bits=8)
    b, hkv, nb, d = 2, 2, 12, 64
    gen = torch.Generator().manual_seed(5)
    ks = stored_state(ck, torch.zeros(b, hkv, nb * 4, d, dtype=F16), nb)
    vs = stored_state(cv, torch.zeros(b, hkv, nb * 4, d, dtype=F16), nb)
    vs[0].copy_(torch.randint(1, 256, vs[0].shape, generator=gen, dtype=torch.uint8))
    scale = 2.0 ** -3 * (1 + 2.0 ** -10) * 2.0 ** torch.randint(-4, 4, vs[1].shape, generator=gen).float()
    vs[1].copy_(scale.half())
    assert torch.equal(vs[1].float(), scale)  # the scales are fp16 values
    q = torch.zeros(b, 4 * hkv, 1, d, dtype=F16)
    o_part, lse, plan = split_partials(*to(device, q), [t.to(device) for t in ks], [t.to(device) for t in vs],
                                       ck.spec, cv.spec, None, None, None, None, 1)
    assert torch.isinf(lse[:, 1].cpu()).all()  # every token archived: the edge part saw nothing
    got = o_part[:, 0, :4, :d].cpu().reshape(b, 4 * hkv, 1, d)
    to32 = [[t.float() if i in (0, 5, 6) and t.dtype == F16 else t for i, t in enumerate(st)] for st in (ks, vs)]
    want = codec_attention_reference(q.float(), *to32, ck.spec, cv.spec)
    tol = dict(atol=1e-6 * float(want.abs().max()), rtol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    # what a kernel that rounds the dequantized rows to fp16 before its dot would give (same fp32 sums otherwise)
    rows16 = cv.stored_rows(Encoded(*vs[:4]), d).half().float()  # (B, H, NB, 1, D)
    rounded = (rows16[:, :, :, 0] * 0.5).sum(2, keepdim=True) * 4 / (nb * 4)
    rounded = rounded.repeat_interleave(4, dim=1)
    assert not torch.allclose(rounded, want, **tol)
