"""GPU-only checks of the Triton kernels: dispatch through torch.ops on CUDA, bf16, opcheck, CUDA-graph replay.

Skipped without CUDA (the CPU interpreter tests in test_triton_{blocks,append,attention}.py cover the math).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from _triton_cases import codec, smooth, stored_state  # noqa: E402
from test_triton_attention import CASES, TOL, _inputs  # noqa: E402

import flashcodec_fx  # noqa: E402,F401  (registers the ops and their CUDA kernels)

ops = torch.ops.flashcodec
BF16 = torch.bfloat16


def _cuda(args):
    return [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("op", ["encode", "decode", "read", "append", "codec_attention"])
def test_cuda_kernels_are_registered(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"flashcodec::{op}", "CUDA")


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-g{c[3]}-L{c[4]}-{c[7]}" for c in CASES])
def test_attention_bf16_through_the_op(case):
    q, args = _inputs(case[0], case[1], BF16, *case[3:])
    want = ops.codec_attention(q, *args)  # CPU: the reference
    got = ops.codec_attention(q.cuda(), *_cuda(args)).cpu()  # CUDA: the Triton kernel
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[BF16], rtol=TOL[BF16])


@pytest.mark.parametrize("tier", ["jpeg_k8", "jpeg_k2_int8", "png", "png_pruned"])
def test_opcheck_cuda(tier):
    c = codec(tier)
    r = c.block_size
    x = smooth(2, 2, 3 * r, 64, BF16, "cuda", seed=0)
    torch.library.opcheck(ops.encode.default, (x, c.spec))
    data, scale, index = ops.encode(x, c.spec)
    torch.library.opcheck(ops.decode.default, (data, scale, index, c.spec, BF16))
    state = [t.cuda() for t in stored_state(c, x[:, :, : 2 * r + 3].cpu(), 4)]
    torch.library.opcheck(ops.read.default, (*state, c.spec))
    memo = torch.zeros(2, 2, 4 * r, 64, dtype=BF16, device="cuda")
    torch.library.opcheck(ops.append.default, (*state, x[:, :, :5].contiguous(), c.spec, memo))
    q, args = _inputs(tier, "jpeg_k8_int8", BF16, 4, 21, 1, 64, "bool", 4)
    torch.library.opcheck(ops.codec_attention.default, (q.cuda(), *_cuda(args)))


def test_cuda_graph_replay_matches_eager():
    """One decode step (append K, append V, codec_attention) captured once and replayed across block boundaries."""
    ck, cv = codec("jpeg_k8_int8"), codec("png")
    b, hkv, g, d, blocks, steps = 2, 2, 4, 64, 8, 40
    prompt = 13
    k = smooth(b, hkv, prompt + steps, d, BF16, "cpu", 1).cuda()
    v = smooth(b, hkv, prompt + steps, d, BF16, "cpu", 2).cuda()
    qs = torch.randn(steps, b, hkv * g, 1, d, device="cuda").to(BF16)

    def fresh():
        ks = list(ck.empty_state((b, hkv), blocks, d, BF16, "cuda")) + [torch.zeros(b, hkv, 8, d, dtype=BF16, device="cuda")]
        vs = list(cv.empty_state((b, hkv), blocks, d, BF16, "cuda")) + [torch.zeros(b, hkv, 8, d, dtype=BF16, device="cuda")]
        lk, lv = (torch.zeros((), dtype=torch.int64, device="cuda") for _ in range(2))
        ops.append(*ks, lk, k[:, :, :prompt], ck.spec)
        ops.append(*vs, lv, v[:, :, :prompt], cv.spec)
        return ks, vs, lk, lv

    def step(state, new_k, new_v, q):
        ks, vs, lk, lv = state
        ops.append(*ks, lk, new_k, ck.spec)
        ops.append(*vs, lv, new_v, cv.spec)
        return ops.codec_attention(q, *ks, *vs, lk, ck.spec, cv.spec)

    static_k, static_v, static_q = (torch.zeros_like(t) for t in (k[:, :, :1], v[:, :, :1], qs[0]))
    graphed, eager, warm = fresh(), fresh(), fresh()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(warm, static_k, static_v, static_q)  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(graphed, static_k, static_v, static_q)
    for i in range(steps):
        pos = prompt + i
        static_k.copy_(k[:, :, pos: pos + 1])
        static_v.copy_(v[:, :, pos: pos + 1])
        static_q.copy_(qs[i])
        graph.replay()
        want = step(eager, k[:, :, pos: pos + 1], v[:, :, pos: pos + 1], qs[i])
        assert torch.equal(static_out, want), f"step {i}: graph replay differs from eager"
    assert int(graphed[2]) == int(eager[2]) == prompt + steps
    for a, e in zip([*graphed[0], *graphed[1]], [*eager[0], *eager[1]], strict=True):
        assert torch.equal(a, e)
    # and the final step agrees with the CPU reference on the same stored state
    cpu = [t.cpu() for t in (*graphed[0], *graphed[1], graphed[2])]
    want = ops.codec_attention(qs[-1].cpu(), *cpu, ck.spec, cv.spec)
    torch.testing.assert_close(static_out.cpu().float(), want.float(), atol=TOL[BF16], rtol=TOL[BF16])


def test_capture_finds_the_codec_matrices_made_by_the_stream():
    """Item 6: the first kernel call of a fresh codec inside a capture must not copy the codec matrices from the host.
    Kernels are compiled by a warm-up stream, the matrix cache is then emptied, and a new stream (which makes its
    matrices when it allocates) is captured from its first decode step."""
    from flashcodec_fx import CodecStream
    from flashcodec_fx.ops.triton_common import _matrices

    c = codec("jpeg_k2_int8")
    x = smooth(1, 2, 24, 64, BF16, "cpu", 3).cuda()
    warm = CodecStream(c, "static", max_length=64, memoize=False)
    warm.append(x[:, :, :17])
    warm.append(x[:, :, 17:18])
    torch.cuda.synchronize()
    _matrices.cache_clear()
    stream = CodecStream(c, "static", max_length=64, memoize=False)
    stream.append(x[:, :, :17])  # allocates: makes the matrices on the device now
    static_x = x[:, :, 17:18].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream.append(static_x)
    assert int(stream.length) == 17  # capture records, it does not run
    graph.replay()
    assert int(stream.length) == 18
    for got, want in zip((*stream.state, stream.tail), (*warm.state, warm.tail), strict=True):
        assert torch.equal(got, want)  # the replayed step stored what the eager one did


def test_tiny_llama_decode_under_cuda_graphs_with_the_pass():
    """A whole decode step of a tiny Llama compiled with mode="reduce-overhead" (CUDA graphs) and the flashcodec
    pass (strict: attention on the stored state through the Triton kernels): captured once, replayed for every
    token, no cudagraph skip, and the same greedy tokens as eager decoding (png: lossless)."""
    pytest.importorskip("transformers")
    from conftest import cache_kwargs, fresh_tiny_model, tiny_prompt
    from transformers import CompileConfig

    from flashcodec_fx.hf import FlashCodecCache

    torch._dynamo.reset()
    model = fresh_tiny_model("llama").cuda()
    prompt = tiny_prompt(1, 12).cuda()
    options = dict(mode="png", layout="static", max_cache_len=80, memoize=False)

    def generate(config):
        cache = FlashCodecCache.from_config(model.config, **options)
        gen = dict(max_new_tokens=40, do_sample=False, **cache_kwargs(cache))
        gen.update({"disable_compile": True} if config is None else {"compile_config": config})
        with torch.no_grad():
            return model.generate(prompt, **gen)

    eager = generate(None)
    counters = torch._dynamo.utils.counters
    skips = counters["inductor"]["cudagraph_skips"]
    graphs = counters["stats"]["unique_graphs"]
    compiled = generate(CompileConfig(backend="flashcodec", fullgraph=True, mode="reduce-overhead",
                                      options={"strict": True}))
    assert counters["inductor"]["cudagraph_skips"] == skips, "a decode step fell back from CUDA graphs"
    assert counters["stats"]["unique_graphs"] - graphs >= 1
    assert torch.equal(compiled, eager)
