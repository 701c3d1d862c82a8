"""GPU-only checks of the Triton kernels: dispatch through torch.ops on CUDA, bf16, opcheck, CUDA-graph replay.

Skipped without CUDA (the CPU interpreter tests in test_triton_{append,attention,register,long}.py cover the math).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from _triton_cases import form, groups_for, preset_codecs, same_archive, smooth, stored_state  # noqa: E402
from test_triton_attention import CASES, TOL, _ids, _inputs  # noqa: E402

import flashcodec_fx  # noqa: E402
import flashcodec_fx.ops  # noqa: E402,F401  (defines the ops and registers their CUDA kernels)
from flashcodec_fx import PRESETS  # noqa: E402
from flashcodec_fx.ops import empty_state  # noqa: E402
from flashcodec_fx.ops.triton.gate import KERNELS  # noqa: E402

ops = torch.ops.flashcodec
BF16 = torch.bfloat16


def _cuda(args):
    return [a.cuda() if isinstance(a, torch.Tensor) else [x.cuda() for x in a] if isinstance(a, list) else a
            for a in args]


@pytest.mark.parametrize("op", ["encode", "decode", "read", "append", "codec_attention", "append_attention"])
def test_cuda_kernels_are_registered(op):
    """Triton serves every op on CUDA (encode, decode, read, append, codec_attention, append_attention)."""
    name = f"flashcodec::{op}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA") == (name in KERNELS)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_attention_bf16_through_the_op(case):
    k_form, v_form, _, *rest = case
    args = _inputs(form(k_form), form(v_form), BF16, *rest)
    want = ops.codec_attention(*args)  # CPU: the reference
    got = ops.codec_attention(*_cuda(args)).cpu()  # CUDA: the Triton kernel
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[BF16], rtol=TOL[BF16])


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_opcheck_cuda(preset):
    ck, cv = preset_codecs(preset)
    length = ck.sinks + 2 * max(ck.group, cv.group) + 5
    x = smooth(2, 2, length + 3, 64, BF16, "cuda", seed=0)
    for codec in (ck, cv):
        groups = -(-(length + 3 - codec.sinks) // codec.group) + 1
        state = [t.cuda() for t in stored_state(codec, x[:, :, :length].cpu(), groups)]
        memo = torch.zeros(2, 2, codec.sinks + groups * codec.group, 64, dtype=BF16, device="cuda")
        torch.library.opcheck(ops.append.default, (state, x[:, :, length:].contiguous(), codec.spec, memo))
        torch.library.opcheck(ops.read.default, (state, codec.spec))
    args = _cuda(_inputs(ck, cv, BF16, 4, length, 1, 1, 64, "bool", 1))
    torch.library.opcheck(ops.codec_attention.default, tuple(args))


@pytest.mark.parametrize("name", ["jpeg_k8", "png_pruned", "int8", "dct_channel", "lloyd_rot"])
def test_encode_decode_read_bf16_through_the_op(name):
    """encode / decode / read dispatched to Triton on CUDA (bf16) agree with the CPU reference at the interpreter
    tests' tolerances (test_triton_blocks.py, test_triton_read.py); opcheck with the CUDA kernels."""
    codec = form(name)
    x = smooth(2, 2, 2 * codec.group, 64, BF16, "cpu", seed=3)
    mean = x.float().mean(2) if codec.center else None
    want = ops.encode(x, codec.spec, mean)
    args = _cuda([x, codec.spec, mean])
    same_archive(codec, [t.cpu() for t in ops.encode(*args)], want, 64, BF16)
    dec = _cuda([*want, codec.spec, BF16, mean])
    torch.testing.assert_close(ops.decode(*dec).cpu().float(), ops.decode(*want, codec.spec, BF16, mean).float(),
                               atol=1e-5, rtol=8e-3)
    torch.library.opcheck(ops.encode.default, tuple(args))
    torch.library.opcheck(ops.decode.default, tuple(dec))
    length = codec.sinks + codec.window + 2 * codec.group + 5
    y = smooth(2, 2, length, 64, BF16, "cpu", seed=4)
    state = stored_state(codec, y, groups_for(codec, length))
    got = ops.read(_cuda([state])[0], codec.spec, y[:, :, -1:].cuda()).cpu()
    torch.testing.assert_close(got.float(), ops.read(state, codec.spec, y[:, :, -1:]).float(), atol=1e-5, rtol=8e-3)


@pytest.mark.parametrize("preset", ["int8", "3bit"])
def test_cuda_graph_replay_matches_eager(preset):
    """One decode step (append K, append V, codec_attention on the call's own token) captured once and replayed
    across group boundaries: bit-equal to eager steps, and the last one matches the CPU reference."""
    ck, cv = preset_codecs(preset)
    b, hkv, g, d, steps = 2, 2, 4, 64, 40
    prompt = ck.sinks + max(ck.group, cv.group, 30) - 17  # the steps cross a group boundary of both streams
    k = smooth(b, hkv, prompt + steps, d, BF16, "cpu", 1).cuda()
    v = smooth(b, hkv, prompt + steps, d, BF16, "cpu", 2).cuda()
    qs = torch.randn(steps, b, hkv * g, 1, d, device="cuda").to(BF16)

    def fresh():
        ks = list(empty_state(ck, b, hkv, groups_for(ck, prompt + steps), d, BF16, "cuda"))
        vs = list(empty_state(cv, b, hkv, groups_for(cv, prompt + steps), d, BF16, "cuda"))
        flashcodec_fx.ops.warm(ck, d, "cuda")
        flashcodec_fx.ops.warm(cv, d, "cuda")
        ops.append(ks, k[:, :, :prompt], ck.spec, None)
        ops.append(vs, v[:, :, :prompt], cv.spec, None)
        return ks, vs

    def step(state, new_k, new_v, q):
        ks, vs = state
        ops.append(ks, new_k, ck.spec, None)
        ops.append(vs, new_v, cv.spec, None)
        return ops.codec_attention(q, ks, vs, ck.spec, cv.spec, new_k, new_v)

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
    assert int(graphed[0][7]) == int(eager[0][7]) == prompt + steps
    for a, e in zip([*graphed[0], *graphed[1]], [*eager[0], *eager[1]], strict=True):
        assert torch.equal(a, e)
    cpu = [[t.cpu() for t in st] for st in graphed]
    last = (k[:, :, -1:].cpu(), v[:, :, -1:].cpu())
    want = ops.codec_attention(qs[-1].cpu(), *cpu, ck.spec, cv.spec, *last)
    torch.testing.assert_close(static_out.cpu().float(), want.float(), atol=TOL[BF16], rtol=TOL[BF16])


def test_capture_finds_the_tables_made_by_the_stream():
    """The first kernel call of a fresh codec inside a capture must not copy the kernels' tables (or the codec's
    matrices) from the host. Kernels are compiled by a warm-up stream, the table cache is then emptied, and a new
    stream (which makes its tables when it allocates) is captured from its first decode step."""
    from flashcodec_fx import CodecStream
    from flashcodec_fx.ops.triton.common import _tables

    codec = preset_codecs("3bit")[1]
    x = smooth(1, 2, 24, 64, BF16, "cpu", 3).cuda()
    warm = CodecStream(codec, "static", max_length=64, memoize=False)
    warm.append(x[:, :, :17])
    warm.append(x[:, :, 17:18])
    torch.cuda.synchronize()
    _tables.cache_clear()
    stream = CodecStream(codec, "static", max_length=64, memoize=False)
    stream.append(x[:, :, :17])  # allocates: makes the tables on the device now
    static_x = x[:, :, 17:18].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream.append(static_x)
    assert int(stream.length) == 17  # capture records, it does not run
    graph.replay()
    assert int(stream.length) == 18
    for got, want in zip(stream.state, warm.state, strict=True):
        assert torch.equal(got, want)  # the replayed step stored what the eager one did


@pytest.mark.parametrize("preset", ["lossless", "3bit"])
def test_tiny_llama_decode_under_cuda_graphs_with_the_pass(preset):
    """A whole decode step of a tiny Llama compiled with mode="reduce-overhead" (CUDA graphs) and the flashcodec
    pass (strict: attention on the stored state through the Triton kernels): captured once, replayed for every
    token, no cudagraph skip. Lossless: the same greedy tokens as eager decoding. 3bit: the first token (the prompt
    attends its exact states in both) and the shape; later tokens may part at a near-tie of two logits (eager and
    compiled round in other places)."""
    pytest.importorskip("transformers")
    from conftest import cache_kwargs, fresh_tiny_model, tiny_prompt
    from transformers import CompileConfig

    from flashcodec_fx.hf import FlashCodecCache

    torch._dynamo.reset()
    model = fresh_tiny_model("llama").cuda()
    prompt = tiny_prompt(1, 12).cuda()
    options = dict(preset=preset, layout="static", max_cache_len=80, memoize=False)

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
    # torch.compile takes a mode or options, not both: the backend is configured instead of options={"strict": True}
    compiled = generate(CompileConfig(backend=flashcodec_fx.backend(strict=True), fullgraph=True, mode="reduce-overhead"))
    assert counters["inductor"]["cudagraph_skips"] == skips, "a decode step fell back from CUDA graphs"
    assert counters["stats"]["unique_graphs"] - graphs >= 1
    assert compiled.shape == eager.shape
    if preset == "lossless":
        assert torch.equal(compiled, eager)
    else:
        assert torch.equal(compiled[:, : prompt.shape[1] + 1], eager[:, : prompt.shape[1] + 1])
