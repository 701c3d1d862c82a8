"""Triton codec_attention (split-K + combine) against the plain-torch reference."""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICES, codec, smooth, stored_state

from flashcodec_fx.ops.triton_attention import attention_plan, triton_codec_attention

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
        assert plan["num_splits"] * plan["blocks_per_split"] >= blocks > (plan["num_splits"] - 1) * plan["blocks_per_split"]
        assert plan["num_warps"] == 8  # 8 blocks x 8 rows x D=128 per stored tile
    assert long["blocks_per_split"] > short["blocks_per_split"]  # longer contexts stream longer ranges per split
    tiny = attention_plan(1, 1, 1, 3, 8, 2, 2, 16, cpu, num_splits=64)
    assert tiny["num_splits"] == 1 and tiny["BLOCK_N"] * 2 >= 16  # never more splits than tiles; dot needs 16 rows
    assert tiny["num_warps"] == 4
    wide = attention_plan(2, 2, 8 * 17, 10, 8, 8, 8, 64, cpu)
    assert wide["BLOCK_M"] == 64 and wide["n_mchunk"] == 3  # 136 query rows: three 64-row programs
