"""Triton kernels on fp32 streams with bf16 raw rows (``raw=bfloat16``) against the reference (tests/ops/
test_raw_rows.py has the spec): the same stored tensors, the fp32 view, attention within the fp32 tolerance."""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICES, form, preset_codecs, same_archive, smooth, stored_state

from flashcodec_fx.ops.reference.append import append_reference
from flashcodec_fx.ops.reference.attention import codec_attention_reference
from flashcodec_fx.ops.reference.read import read_reference
from flashcodec_fx.ops.state import empty_state
from flashcodec_fx.ops.triton.append import triton_append
from flashcodec_fx.ops.triton.attention import triton_codec_attention
from flashcodec_fx.ops.triton.read import triton_read

F32 = torch.float32
NARROWED = {"3bit-keys": preset_codecs("3bit")[0].resolved(F32), "4bit-values": preset_codecs("4bit")[1].resolved(F32),
            "dct_channel": form("dct_channel").with_raw_dtype("bfloat16"),
            "token_r4": form("token_r4").with_raw_dtype("bfloat16")}
D = 16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "memo"), [("3bit-keys", True), ("4bit-values", False), ("dct_channel", False),
                                            ("token_r4", True)])
def test_append_and_read_match_the_reference(device, name, memo):
    codec = NARROWED[name]
    chunks = (131, 1, 1, 17) if codec.group > 4 else (29, 1, 1, 17)  # (per-token groups: few, the interpreter is slow)
    length = sum(chunks)
    x = smooth(1, 2, length, D, F32, "cpu", seed=3)
    groups = (length - codec.sinks) // codec.group + 2
    want = list(empty_state(codec, 1, 2, groups, D, F32, "cpu"))
    got = [t.clone().to(device) for t in want]  # (not aliases of the reference's state on the CPU)
    memos = [torch.zeros(1, 2, codec.sinks + groups * codec.group, D) if memo else None for _ in range(2)]
    memos[1] = None if memos[1] is None else memos[1].to(device)  # (a new tensor: zeros(...) per item)
    at = 0
    for n in chunks:  # a prefill, single tokens, a chunk that completes groups
        append_reference(want, x[:, :, at: at + n].contiguous(), codec.spec, memos[0])
        triton_append(got, x[:, :, at: at + n].to(device), codec.spec, memos[1])
        at += n
    got = [t.cpu() for t in got]
    assert got[6].dtype == got[5].dtype == torch.bfloat16
    for i in (5, 6, 7, 8):  # sink, tail, length, start: bitwise
        assert torch.equal(got[i], want[i]), i
    torch.testing.assert_close(got[4], want[4], atol=1e-6, rtol=1e-6)  # the mean: fp32 sums in another order
    same_archive(codec, got, want, D, F32)
    view = triton_read([t.to(device) for t in got], codec.spec)
    assert view.dtype == F32
    torch.testing.assert_close(view.cpu(), read_reference(got, codec.spec), atol=1e-5, rtol=1e-5)
    if memo:
        torch.testing.assert_close(memos[1].cpu(), read_reference(got, codec.spec), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("key", "value", "new"), [("3bit-keys", "4bit-values", 0), ("dct_channel", "token_r4", 2)])
def test_attention_matches_the_reference(device, key, value, new):
    ck, cv = NARROWED[key], NARROWED[value]
    k, v = (smooth(2, 2, 140, D, F32, "cpu", seed=s) for s in (1, 2))
    chunks = [1, 1] + ([new] if new else [1])
    ks = stored_state(ck, k, (140 - ck.sinks) // ck.group + 1, chunks)
    vs = stored_state(cv, v, (140 - cv.sinks) // cv.group + 1, chunks)
    q = torch.randn(2, 4, max(1, new), D, generator=torch.Generator().manual_seed(0))
    extra = (k[:, :, -new:], v[:, :, -new:]) if new else (None, None)
    want = codec_attention_reference(q, ks, vs, ck.spec, cv.spec, *extra)
    got = triton_codec_attention(q.to(device), [t.to(device) for t in ks], [t.to(device) for t in vs], ck.spec,
                                 cv.spec, *(None if t is None else t.to(device) for t in extra))
    assert got.dtype == F32
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
