"""Triton codec_attention (split-K + combine) against the plain-torch reference."""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICES, codec, smooth, stored_state, to

from flashcodec_fx.ops.triton_attention import attention_plan, split_partials, triton_codec_attention

F32, F16 = torch.float32, torch.float16
# (k tier, v tier, dtype, GQA group, kv length, query tokens T, head_dim, mask kind, capacity blocks)
CASES = [
    ("jpeg_k8", "jpeg_k8", F32, 1, 37, 1, 32, None, 6),
    ("jpeg_k2_int8", "png", F16, 2, 32, 1, 16, "bool", 4),
    ("jpeg_k8_int8", "jpeg_k8_int8", F32, 4, 29, 1, 16, "additive", 5),
    ("png", "png_pruned", F16, 8, 21, 1, 16, None, 4),
    ("png_pruned", "jpeg_k3", F32, 2, 27, 3, 24, "additive", 6),
    ("jpeg_r4_int8", "png_r4", F16, 4, 18, 1, 16, "bool", 6),
    ("jpeg_k3", "jpeg_k2_int8", F32, 1, 5, 2, 16, "bool", 2),
    ("jpeg_k8", "jpeg_k8_int8", F16, 1, 40, 1, 16, "additive", 5),
    # an overflowed static cache (45 tokens appended, 4 blocks = 32 of capacity): 4 blocks + the tail, as the reference
    ("jpeg_k8_int8", "png", F32, 2, 45, 1, 16, "bool", 4),
]
# fp32: sums in another order (split partials, dot tiles); fp16: the kernel rounds dequantized rows and
# probabilities to fp16 for its dots (like flash attention), the reference rounds only its output.
TOL = {F32: 2e-5, F16: 3e-3, torch.bfloat16: 2.5e-2}


def _mask(kind, b, hq, t, length, gen):
    width = length + 3
    if kind == "bool":
        m = torch.rand(b, 1, t, width, generator=gen) > 0.3
        m[0, 0, 0, :] = False  # a query that sees nothing: the output row is zero in both
        return m
    if kind == "additive":
        m = torch.randn(1, hq, t, width, generator=gen)
        return m.masked_fill(torch.rand(1, hq, t, width, generator=gen) > 0.7, float("-inf"))
    return None


def _inputs(k_tier, v_tier, dtype, group, length, t, d, mask_kind, blocks, seed=0):
    ck, cv = codec(k_tier), codec(v_tier)
    b, hkv = 2, 2
    gen = torch.Generator().manual_seed(seed)
    ks = stored_state(ck, smooth(b, hkv, length, d, dtype, "cpu", seed + 1), blocks)
    vs = stored_state(cv, smooth(b, hkv, length, d, dtype, "cpu", seed + 2), blocks)
    q = torch.randn(b, hkv * group, t, d, generator=gen).to(dtype)
    mask = _mask(mask_kind, b, hkv * group, t, length, gen)
    return q, (*ks[:4], *vs[:4], ks[4], ck.spec, cv.spec, mask)


def _run(device, q, args, **kw):
    tensors = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    return triton_codec_attention(q.to(device), *tensors, **kw).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{str(c[2])[6:]}-g{c[3]}-L{c[4]}-T{c[5]}-{c[7]}" for c in CASES])
def test_attention_matches_reference(device, case):
    q, args = _inputs(*case)
    want = torch.ops.flashcodec.codec_attention(q, *args)
    got = _run(device, q, args, num_splits=2)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[q.dtype], rtol=TOL[q.dtype])
    if case[7] == "bool":
        assert got[0, :, 0].abs().max() == 0  # fully masked rows are zero


@pytest.mark.parametrize("device", DEVICES)
def test_split_counts_agree(device):
    q, args = _inputs("jpeg_k8_int8", "png", F32, 2, 70, 1, 16, "additive", 12)
    want = torch.ops.flashcodec.codec_attention(q, *args)
    for splits in (1, 3, None):
        torch.testing.assert_close(_run(device, q, args, num_splits=splits), want, atol=TOL[F32], rtol=TOL[F32])


@pytest.mark.parametrize("device", DEVICES)
def test_scale_and_validation(device):
    q, args = _inputs("jpeg_k8", "png", F32, 2, 19, 1, 16, None, 3)
    want = torch.ops.flashcodec.codec_attention(q, *args, scale=0.3)
    torch.testing.assert_close(_run(device, q, args, scale=0.3), want, atol=TOL[F32], rtol=TOL[F32])
    with pytest.raises(ValueError, match="query heads"):
        _run(device, q[:, :3], args)
    with pytest.raises(ValueError, match="mask must be"):
        _run(device, q, (*args[:-1], torch.ones(2, 1, 1, 19, dtype=torch.int32)))
    with pytest.raises(ValueError, match="num_splits"):
        _run(device, q, args, num_splits=0)


def test_plan_heuristic():
    cpu = torch.device("cpu")
    short = attention_plan(1, 8, 4, 512, 8, 8, 8, 128, cpu)
    long = attention_plan(1, 8, 4, 16384, 8, 8, 8, 128, cpu)
    for plan, blocks in ((short, 512), (long, 16384)):
        assert plan["BLOCK_M"] == 16 and plan["BLOCK_N"] * 8 == 64  # 4 query rows padded to 16; 64 positions per tile
        assert 1 <= plan["num_splits"] <= -(-blocks // plan["BLOCK_N"])  # never more splits than tiles
        assert plan["num_warps"] == 8  # 8 blocks x 8 rows x D=128 per stored tile
    assert long["num_splits"] >= short["num_splits"]
    tiny = attention_plan(1, 1, 1, 3, 8, 2, 2, 16, cpu, num_splits=64)
    assert tiny["num_splits"] == 1 and tiny["BLOCK_N"] * 2 >= 16  # never more splits than tiles; dot needs 16 rows
    assert tiny["num_warps"] == 4
    wide = attention_plan(2, 2, 8 * 17, 10, 8, 8, 8, 64, cpu)
    assert wide["BLOCK_M"] == 64 and wide["n_mchunk"] == 3  # 136 query rows: three 64-row programs


@pytest.mark.parametrize("device", DEVICES)
def test_split_ranges_follow_the_device_length(device):
    """A short fill of a large static cache (40 blocks + 3 tokens stored of 256): the stored tiles are dealt over
    the splits from the device length (5 tiles of 8 blocks over 4 splits: 2, 2, 1, 0), not from the capacity
    (which would put all 40 blocks in split 0), and the result still matches the reference."""
    q, args = _inputs("jpeg_k8_int8", "jpeg_k8", F32, 2, 40 * 8 + 3, 1, 16, None, 256)
    tensors = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    _, lse, plan = split_partials(q.to(device), tuple(tensors[:4]), tuple(tensors[4:8]), tensors[8], *tensors[9:11],
                                  None, None, 4)
    assert plan["num_splits"] == 4 and plan["BLOCK_N"] == 8
    saw = torch.isfinite(lse.cpu()).all(-1)  # (programs, splits + 1): every query row of the part saw something
    assert saw[:, :4].tolist() == [[True, True, True, False]] * saw.shape[0] and saw[:, 4].all()  # + the raw tail
    want = torch.ops.flashcodec.codec_attention(q, *args)
    torch.testing.assert_close(_run(device, q, args, num_splits=4), want, atol=TOL[F32], rtol=TOL[F32])


@pytest.mark.parametrize("device", DEVICES)
def test_long_mask_offsets_are_int64(device):
    """A (1, 1, 3, 2**30 + 64) bool mask (3 GiB of address space, only three pages touched): the offset of query
    row 2, ``2 * (2**30 + 64)``, passes 2**31; int32 offsets would wrap and read outside the mask."""
    if device == "cuda":
        pytest.skip("the interpreter case is enough; 3 GiB on the GPU is not worth it")
    q, args = _inputs("jpeg_k8_int8", "png", F32, 1, 21, 3, 16, None, 4)
    width = 2**30 + 64
    mask = torch.empty(1, 1, 3, width, dtype=torch.bool)  # lazily backed: the untouched pages cost nothing
    gen = torch.Generator().manual_seed(3)
    for row in range(3):
        mask[0, 0, row, :32] = torch.rand(32, generator=gen) > 0.4
    args = (*args[:-1], mask)
    want = torch.ops.flashcodec.codec_attention(q, *args)
    torch.testing.assert_close(_run(device, q, args, num_splits=1), want, atol=TOL[F32], rtol=TOL[F32])


def test_attention_names_the_triton_limits():
    from flashcodec_fx.codecs import make_codec

    pruned = make_codec("png", block_size=32, keep_ratio=0.5)
    plain = make_codec("jpeg", block_size=32, keep_freqs=4)
    ks = stored_state(pruned, torch.zeros(1, 1, 40, 16), 2)
    vs = stored_state(plain, torch.zeros(1, 1, 40, 16), 2)
    with pytest.raises(ValueError, match="spec_k: .* block_size <= 16"):
        triton_codec_attention(torch.zeros(1, 1, 1, 16), *ks[:4], *vs[:4], ks[4], pruned.spec, plain.spec)


@pytest.mark.parametrize("device", DEVICES)
def test_int8_values_enter_the_dot_exactly(device):
    """fp16 I/O, int8 V (jpeg r=4, DC only: A[:, 0] = 0.5). With q = 0 every probability is exactly 1 and each
    block's folded probability times its scale (2 * s, s = 2**-3 * (1 + 2**-10) * 2**e) is exact in fp16, while
    most ``code * s`` are not: the kernel must fold V's scales into the probabilities and feed the codes to the
    dot as they are. Its fp32 partial output then matches the fp32 reference to fp32 rounding; rounding the
    dequantized rows to fp16 first (the old way) is off by ~1e-4 relative."""
    from flashcodec_fx.codecs import make_codec

    ck, cv = make_codec("jpeg", block_size=4), make_codec("jpeg", block_size=4, keep_freqs=1, quant_bits=8)
    b, hkv, nb, d = 2, 2, 12, 64
    gen = torch.Generator().manual_seed(5)
    k = list(ck.empty_state((b, hkv), nb, d, F16, "cpu")) + [torch.zeros(b, hkv, 4, d, dtype=F16)]
    v_codes = torch.randint(-127, 128, (b, hkv, nb, 1, d), generator=gen, dtype=torch.int8)
    v_scale = 2.0 ** -3 * (1 + 2.0 ** -10) * 2.0 ** torch.randint(-4, 4, (b, hkv, nb, 1), generator=gen).float()
    v = [v_codes, v_scale, torch.zeros(b, hkv, nb, 0, d, dtype=torch.uint8), torch.zeros(b, hkv, 4, d, dtype=F16)]
    length = torch.tensor(nb * 4)  # every token archived: the tail split sees nothing
    q = torch.zeros(b, 4 * hkv, 1, d, dtype=F16)
    args = [*k, *v, length, ck.spec, cv.spec]
    o_part, lse, plan = split_partials(*to(device, q), tuple(to(device, *k)), tuple(to(device, *v)),
                                       *to(device, length), ck.spec, cv.spec, None, None, 1)
    assert torch.isinf(lse[:, 1]).all()  # (the tail part)
    got = o_part[:, 0, : 4, :].cpu().reshape(b, hkv, 4, d).reshape(b, 4 * hkv, 1, d)
    want = torch.ops.flashcodec.codec_attention(q.float(), *[a.float() if a.dtype == F16 else a for a in args[:9]],
                                                *args[9:])
    torch.testing.assert_close(got, want, atol=1e-6 * float(want.abs().max()), rtol=1e-5)
