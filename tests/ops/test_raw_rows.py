"""Raw rows narrower than the stream (``raw=bfloat16``): an fp32 stream stores its sinks and tail in bf16.

The spec (ops/reference): the tokens enter rounded to bf16, so everything stored is bitwise what a bf16 stream of the
rounded tokens stores; the view, the memo and attention stay fp32, the call's own tokens exact. The CPU kernels
match the reference (append bitwise, attention within its fp32 tolerance); opcheck covers the mixed dtypes.
"""

from __future__ import annotations

import math

import pytest
import torch
from _cpu_cases import TOLERANCE
from _op_states import chunks, fill, new_memo, new_state
from codec_tiers import kv_like, tier_table

from flashcodec_fx.ops import StreamState
from flashcodec_fx.ops.cpu import EXTENSION, cpu_append, cpu_codec_attention
from flashcodec_fx.ops.reference.append import append_reference
from flashcodec_fx.ops.reference.attention import codec_attention_reference
from flashcodec_fx.presets import preset_codecs

ops = torch.ops.flashcodec
R = 4
# quantized tiers with raw rows (sinks, windows, open groups): per token and DCT blocks, token and channel scales
NARROWED = {name: codec.with_raw_dtype("bfloat16") for name, codec in tier_table(R, low_keep=2).items()
            if name in ("jpeg-int8", "jpeg-table", "token-lloyd2", "channel-uniform4", "jpeg-midrise4")}
NARROWED["3bit-keys"] = preset_codecs("3bit")[0].resolved(torch.float32)
NARROWED["2bit-values"] = preset_codecs("2bit")[1].resolved(torch.float32)
PROMPT = 6
D = 16


def _bf16_stream(codec):
    """The same codec storing in the stream dtype (a bf16 stream's spec)."""
    return codec.with_raw_dtype("auto")


@pytest.mark.parametrize("name", list(NARROWED))
def test_an_fp32_stream_stores_what_a_bf16_stream_of_its_rounded_tokens_stores(name):
    codec = NARROWED[name]
    x = kv_like((2, 3, 41, D), torch.float32, seed=len(name))
    sizes = chunks(41, seed=3, first=PROMPT)
    got, _ = fill(codec, x, sizes, positions=48)
    want, _ = fill(_bf16_stream(codec), x.bfloat16(), sizes, positions=48)
    assert got.tail.dtype == got.sink.dtype == torch.bfloat16
    for field, a, b in zip(StreamState._fields, got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), field
    view = ops.read(got, codec.spec)
    assert view.dtype == torch.float32
    assert torch.equal(view.bfloat16(), ops.read(want, _bf16_stream(codec).spec))  # decoded in fp32, not rounded


@pytest.mark.parametrize("name", list(NARROWED))
def test_the_call_split_does_not_change_what_is_stored(name):
    codec = NARROWED[name]
    x = kv_like((1, 2, 37, D), torch.float32, seed=2)
    want, _ = fill(codec, x, [PROMPT, 37 - PROMPT], positions=45)
    for sizes in ([PROMPT] + [1] * (37 - PROMPT), chunks(37, seed=9, first=PROMPT)):
        got, _ = fill(codec, x, sizes, positions=45)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), sizes


@pytest.mark.parametrize("name", list(NARROWED))
def test_the_memo_is_the_fp32_view(name):
    codec = NARROWED[name]
    x = kv_like((1, 2, 29, D), torch.float32, seed=5)
    state, memo = fill(codec, x, chunks(29, seed=5, first=PROMPT), positions=29 + codec.group, memo=True)
    assert memo.dtype == torch.float32 and torch.equal(memo, ops.read(state, codec.spec))


def test_the_call_s_own_tokens_are_read_exactly():
    codec = NARROWED["token-lloyd2"]
    x = kv_like((1, 2, 20, D), torch.float32, seed=4)
    state, _ = fill(codec, x, [16, 4], positions=24)
    view = ops.read(state, codec.spec, x[:, :, 16:])
    assert torch.equal(view[:, :, 16:20], x[:, :, 16:])  # fp32 as given, not their bf16 rows
    assert not torch.equal(ops.read(state, codec.spec)[:, :, 16:20], x[:, :, 16:])


def _attention_on_view(q, k_view, v_view, length):
    """fp32 attention of ``q (B, Hq, T, D)`` over the first ``length`` positions of the views (GQA)."""
    g = q.shape[1] // k_view.shape[1]
    k = k_view[:, :, :length].repeat_interleave(g, 1)
    v = v_view[:, :, :length].repeat_interleave(g, 1)
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[3]), -1) @ v


@pytest.mark.parametrize(("key", "value"), [("3bit-keys", "2bit-values"), ("jpeg-table", "token-lloyd2"),
                                            ("channel-uniform4", "jpeg-midrise4")])
def test_attention_is_attention_over_the_fp32_view(key, value):
    """fp32 queries over bf16 raw rows: attention on the stored form equals fp32 attention over the read view, the
    call's own tokens exact; the output is fp32."""
    ck, cv = NARROWED[key], NARROWED[value]
    k, v = (kv_like((2, 2, 30, D), torch.float32, seed=s) for s in (1, 2))
    sizes = [PROMPT, 20, 4]
    ks, _ = fill(ck, k, sizes, positions=40)
    vs, _ = fill(cv, v, sizes, positions=40)
    q = torch.randn(2, 4, 4, D, generator=torch.Generator().manual_seed(0))
    out = ops.codec_attention(q, ks, vs, ck.spec, cv.spec, k[:, :, -4:], v[:, :, -4:])
    want = _attention_on_view(q, ops.read(ks, ck.spec, k[:, :, -4:]), ops.read(vs, cv.spec, v[:, :, -4:]), 30)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_mismatched_dtypes_are_refused_naming_the_argument():
    codec = NARROWED["token-lloyd2"]
    x = kv_like((1, 2, 10, D), torch.float32, seed=1)
    state, _ = fill(codec, x, [PROMPT, 4], positions=16)
    before = [t.clone() for t in state]
    with pytest.raises(ValueError, match="new must be .* in torch.float32"):
        ops.append(state, x[:, :, :2].bfloat16(), codec.spec, None)
    with pytest.raises(ValueError, match="memo must be torch.float32"):
        ops.append(state, x[:, :, :2], codec.spec, new_memo(codec, state).bfloat16())
    with pytest.raises(ValueError, match="q dtype must match the streams' dtype"):
        ops.codec_attention(torch.zeros(1, 2, 1, D, dtype=torch.bfloat16), state, state, codec.spec, codec.spec)
    wide = [t.float() if i in (5, 6) else t for i, t in enumerate(state)]  # fp32 raw rows under raw=bfloat16
    with pytest.raises(ValueError, match="tail must be bfloat16 under a raw=bfloat16 spec"):
        ops.read(wide, codec.spec)
    with pytest.raises(ValueError, match="float32 streams"):
        new_state(codec, x.bfloat16(), 16)
    assert all(torch.equal(a, b) for a, b in zip(before, state, strict=True))


def test_opcheck_on_a_narrowed_stream():
    ck, cv = NARROWED["3bit-keys"], NARROWED["jpeg-table"]
    k, v = (kv_like((2, 2, 11, D), torch.float32, seed=s) for s in (3, 4))
    ks, _ = fill(ck, k, [8, 3], positions=24)
    vs, _ = fill(cv, v, [8, 3], positions=24)
    torch.library.opcheck(ops.read.default, (ks, ck.spec, k[:, :, -3:]))
    torch.library.opcheck(ops.read.default, (vs, cv.spec, None))
    q = torch.randn(2, 4, 3, D)
    torch.library.opcheck(ops.codec_attention.default, (q, ks, vs, ck.spec, cv.spec, k[:, :, -3:], v[:, :, -3:]))
    state = new_state(ck, k, 24)
    torch.library.opcheck(ops.append.default, (list(state), k, ck.spec, new_memo(ck, state)))


needs_kernels = pytest.mark.skipif(EXTENSION.module() is None, reason="the CPU kernels could not be built")


@needs_kernels
@pytest.mark.parametrize("memo", [False, True])
@pytest.mark.parametrize("name", list(NARROWED))
def test_the_cpu_append_is_the_reference_bitwise(name, memo):
    codec = NARROWED[name]
    x = kv_like((2, 2, 33, D), torch.float32, seed=7)
    sizes = chunks(33, seed=11, first=PROMPT)
    states = [list(new_state(codec, x, 40)) for _ in range(2)]
    memos = [new_memo(codec, StreamState(*s)) if memo else None for s in states]
    at = 0
    for n in sizes:
        for append, state, buf in zip((append_reference, cpu_append), states, memos, strict=True):
            append(state, x[:, :, at: at + n], codec.spec, buf)
        at += n
    assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))
    if memo:
        assert torch.equal(memos[0], memos[1])


@needs_kernels
@pytest.mark.parametrize("new", [False, True])
@pytest.mark.parametrize(("key", "value"), [("3bit-keys", "2bit-values"), ("jpeg-table", "jpeg-midrise4")])
def test_the_cpu_attention_matches_the_reference(key, value, new):
    ck, cv = NARROWED[key], NARROWED[value]
    k, v = (kv_like((2, 2, 30, D), torch.float32, seed=s) for s in (5, 6))
    ks, _ = fill(ck, k, [PROMPT, 20, 4], positions=40)
    vs, _ = fill(cv, v, [PROMPT, 20, 4], positions=40)
    q = torch.randn(2, 4, 4, D, generator=torch.Generator().manual_seed(1))
    extra = (k[:, :, -4:], v[:, :, -4:]) if new else (None, None)
    got = cpu_codec_attention(q, ks, vs, ck.spec, cv.spec, *extra)
    want = codec_attention_reference(q, ks, vs, ck.spec, cv.spec, *extra)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
