"""`torch.library.opcheck` on every flashcodec op, and fake kernels that match the real outputs."""

from __future__ import annotations

import pytest
import torch
from _op_states import fill, new_memo, new_state
from codec_tiers import kv_like, tier_table
from torch._subclasses.fake_tensor import FakeTensorMode

from flashcodec_fx.codecs import PNGCodec

ops = torch.ops.flashcodec
R = 4
TIERS = tier_table(R, low_keep=2)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
D = 8


def stream_state(codec, dtype, length=11, positions=24, seed=0):
    """A state of ``length`` tokens (two appends) with capacity for ``positions``."""
    x = kv_like((2, 2, length, D), dtype, seed=seed)
    state, _ = fill(codec, x, [length - 3, 3], positions=positions)
    return state, x


def mean_of(codec, x):
    return x.float().mean(2) if codec.center else None


# opcheck costs about half a second per call (it traces with AOTAutograd), so the cases cover the seed tiers' layouts
# and every quantization-stage tier, each dtype several times, without the full product (jpeg-k2, png and png-window
# share layouts checked here; they run in the attention cases and the fake-kernel test).
ROTATION = [("jpeg", torch.float32), ("jpeg-int8", torch.bfloat16), ("png-half", torch.float16),
            ("jpeg-table", torch.float32), ("token-lloyd2", torch.bfloat16), ("channel-uniform4", torch.float16),
            ("jpeg-midrise4", torch.bfloat16)]
@pytest.mark.parametrize(("tier", "dtype"), ROTATION)
def test_opcheck_encode(tier, dtype):
    codec = TIERS[tier]
    x = kv_like((2, 3, 2 * codec.group, D), dtype, seed=1)
    torch.library.opcheck(ops.encode.default, (x, codec.spec, mean_of(codec, x)))


@pytest.mark.parametrize(("tier", "dtype"), ROTATION)
def test_opcheck_decode_and_read(tier, dtype):
    codec = TIERS[tier]
    x = kv_like((2, 3, 2 * codec.group, D), dtype, seed=1)
    mean = mean_of(codec, x)
    enc = tuple(t.contiguous().clone() for t in codec.encode(x, mean))
    torch.library.opcheck(ops.decode.default, (*enc, codec.spec, dtype, mean))
    state, x = stream_state(codec, dtype)
    new = x[:, :, -3:] if ROTATION.index((tier, dtype)) % 2 else None  # the current call's tokens, read exactly
    torch.library.opcheck(ops.read.default, (state, codec.spec, new))


@pytest.mark.parametrize(("tier", "dtype"), ROTATION)
def test_opcheck_append(tier, dtype):
    """``memo`` on every other tier; the new tokens complete groups and leave part of one open."""
    codec = TIERS[tier]
    state, _ = stream_state(codec, dtype, length=5, positions=40)
    memo = new_memo(codec, state) if ROTATION.index((tier, dtype)) % 2 else None
    new = kv_like((2, 2, 2 * codec.group + 3, D), dtype, seed=2)
    torch.library.opcheck(ops.append.default, (state, new, codec.spec, memo))


@pytest.mark.parametrize(("k_tier", "v_tier", "dtype", "groups", "mask", "new", "scale"), [
    ("jpeg-int8", "png", torch.float32, 1, None, False, None),
    ("jpeg-table", "token-lloyd2", torch.float16, 2, "bool", True, None),
    ("channel-uniform4", "jpeg-midrise4", torch.bfloat16, 4, "additive", True, 0.25),
    ("png-window", "jpeg-k2", torch.bfloat16, 2, None, True, None),
    ("jpeg", "png-half", torch.float32, 4, "bool", False, 0.5),
    ("token-lloyd2", "jpeg-table", torch.float32, 2, "additive", False, None),
    ("jpeg-midrise4", "channel-uniform4", torch.float16, 1, None, True, None),
])
def test_opcheck_codec_attention(k_tier, v_tier, dtype, groups, mask, new, scale):
    ck, cv = TIERS[k_tier], TIERS[v_tier]
    ks, k = stream_state(ck, dtype, seed=1)
    vs, v = stream_state(cv, dtype, seed=2)
    t, width = 3, 24
    q = torch.randn(2, 2 * groups, t, D).to(dtype)
    if mask == "bool":
        m = torch.rand(2, 1, t, width) > 0.3
        m[..., 0] = True
    elif mask == "additive":
        m = (torch.rand(1, 2 * groups, t, width) - 0.5).to(dtype)
    else:
        m = None
    k_new, v_new = (k[:, :, -3:], v[:, :, -3:]) if new else (None, None)
    torch.library.opcheck(ops.codec_attention.default, (q, ks, vs, ck.spec, cv.spec, k_new, v_new, m, scale))


@pytest.mark.parametrize(("k_tier", "v_tier", "dtype", "groups", "mask", "variants"), [
    ("jpeg-int8", "png", torch.float32, 1, None, ("softcap",)),
    ("jpeg-table", "token-lloyd2", torch.bfloat16, 2, "bool", ("sinks",)),
    ("channel-uniform4", "jpeg-midrise4", torch.float16, 4, "additive", ("alibi",)),
    ("token-lloyd2", "jpeg-table", torch.float32, 2, "bool", ("softcap", "sinks", "alibi")),
])
def test_opcheck_codec_attention_variants(k_tier, v_tier, dtype, groups, mask, variants):
    """Each variant (sinks in the stream dtype, slopes fp32) and all three together, with the call's tokens."""
    ck, cv = TIERS[k_tier], TIERS[v_tier]
    ks, k = stream_state(ck, dtype, seed=1)
    vs, v = stream_state(cv, dtype, seed=2)
    t, width, hq = 3, 24, 2 * groups
    q = torch.randn(2, hq, t, D).to(dtype)
    m = None if mask is None else torch.rand(2, 1, t, width) > 0.3 if mask == "bool" else torch.rand(1, hq, t, width)
    kwargs = {"softcap": 1.5 if "softcap" in variants else None,
              "sinks": torch.randn(hq).to(dtype) if "sinks" in variants else None,
              "alibi": torch.rand(hq) if "alibi" in variants else None}
    torch.library.opcheck(ops.codec_attention.default, (q, ks, vs, ck.spec, cv.spec, k[:, :, -3:], v[:, :, -3:], m),
                          kwargs)


def test_fake_kernel_of_the_variants():
    """The fake kernel gives the real output's layout with every variant, and checks them as the real kernels do."""
    codec = TIERS["jpeg-table"]
    state, tokens = stream_state(codec, torch.bfloat16)
    q = torch.randn(2, 4, 3, D).to(torch.bfloat16)
    kwargs = {"softcap": 30.0, "sinks": torch.randn(4).to(torch.bfloat16), "alibi": torch.rand(4)}
    real = ops.codec_attention(q, state, state, codec.spec, codec.spec, tokens[:, :, -3:], tokens[:, :, -3:], **kwargs)
    mode = FakeTensorMode()
    with mode:
        fake_in = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, (q, state, tokens, kwargs))
        fq, fstate, ftokens, fkw = fake_in
        fake = ops.codec_attention(fq, fstate, fstate, codec.spec, codec.spec, ftokens[:, :, -3:], ftokens[:, :, -3:],
                                   **fkw)
        with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\)"):
            ops.codec_attention(fq, fstate, fstate, codec.spec, codec.spec, sinks=fkw["sinks"][:2])
    assert_like(fake, real)


def assert_like(fake, real):
    assert fake.shape == real.shape and fake.dtype == real.dtype and fake.stride() == real.stride(), (fake, real)


def every_op(codec, dtype, x, enc, state, q, new, mean) -> dict:
    """The outputs of every functional op on these inputs (real or fake tensors alike)."""
    out = {"decode": ops.decode(*enc, codec.spec, dtype, mean), "read": ops.read(state, codec.spec, new),
           "attention": ops.codec_attention(q, state, state, codec.spec, codec.spec, new, new)}
    if not isinstance(codec, PNGCodec):  # png: see the encode aliasing bug in test_reference_blocks.py
        out["encode"] = ops.encode(x, codec.spec, mean)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tier", list(TIERS))
def test_fake_kernels_match_real_outputs(tier, dtype):
    codec = TIERS[tier]
    x = kv_like((1, 2, 2 * codec.group, D), dtype, seed=3)
    mean = mean_of(codec, x)
    enc = tuple(t.contiguous().clone() for t in codec.encode(x, mean))
    state, tokens = stream_state(codec, dtype)
    inputs = (x, enc, state, torch.randn(2, 4, 3, D).to(dtype), tokens[:, :, -3:], mean)
    real = every_op(codec, dtype, *inputs)
    mode = FakeTensorMode()
    with mode:
        fake = every_op(codec, dtype, *torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, inputs))
    assert set(fake) == set(real) and ("encode" in real) == (not tier.startswith("png"))
    for name, want in real.items():
        got = fake[name]
        for g, w in zip(*((got, want) if isinstance(want, tuple) else ((got,), (want,))), strict=True):
            assert_like(g, w)
    assert real["decode"].dtype == real["read"].dtype == real["attention"].dtype == dtype


def test_fake_append_leaves_the_state_alone():
    codec = TIERS["jpeg-table"]
    state = new_state(codec, torch.zeros(1, 2, 1, D), 40)
    mode = FakeTensorMode()
    with mode:
        fstate = [mode.from_tensor(t) for t in state]
        assert ops.append(fstate, mode.from_tensor(torch.randn(1, 2, 9, D)), codec.spec, None) is None


def test_mutating_ops_take_every_argument_explicitly():
    """torch 2.11 bumps the version of each mutated argument by its index in the call's own arguments, from which
    the dispatcher drops a trailing argument equal to its default: a defaulted ``memo`` made every ``append`` without
    a memo raise IndexError there (found on the GPU image). Ops that mutate declare no defaults."""
    schema = torch.ops.flashcodec.append.default._schema
    assert any(arg.alias_info is not None and arg.alias_info.is_write for arg in schema.arguments)
    assert not [arg.name for arg in schema.arguments if arg.has_default_value()]
