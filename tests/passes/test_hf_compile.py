"""Compiled decode of tiny transformers models with a static, unmemoized FlashCodecCache: generate() with the
flashcodec backend reads the compressed cache directly (the pass rewrote every full-attention layer), tokens match
eager decoding, and the decode step compiles once."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from conftest import FAMILIES, cache_kwargs, tiny_model, tiny_prompt  # noqa: E402
from transformers import CompileConfig  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.hf import FlashCodecCache  # noqa: E402

NEW_TOKENS = 56  # prompt 12 -> positions 12..67: 7 block boundaries at r=8 (the Inductor run)
SHORT = 20  # pass-only runs execute the graph op by op: positions 12..31, 2 block boundaries
PNG = dict(mode="png", layout="static", max_cache_len=80, memoize=False)


def _generate(model, options, compile_backend=None, new_tokens=NEW_TOKENS, **kwargs):
    """Greedy tokens with a fresh cache: compiled with ``compile_backend``, else eager on the stored form (the
    ``"kvcodec"`` attention, which reads the call's own tokens exactly, as the compiled graph does)."""
    cache = FlashCodecCache.from_config(model.config, **options)
    gen = dict(max_new_tokens=new_tokens, do_sample=False, **cache_kwargs(cache), **kwargs)
    if compile_backend is None:
        gen["disable_compile"] = True
        fx.apply_codec_attention(model)
        try:
            with torch.no_grad():
                return model.generate(tiny_prompt(1, 12), **gen)
        finally:
            fx.remove_codec_attention(model)
    else:
        config = CompileConfig(backend=compile_backend, fullgraph=True)  # mode="reduce-overhead" (ignored on CPU)
        config._compile_all_devices = True  # transformers auto-compiles only on accelerators otherwise
        gen["compile_config"] = config
    with torch.no_grad():
        return model.generate(tiny_prompt(1, 12), **gen)


def _codec_layers(model) -> int:
    return len(FlashCodecCache.from_config(model.config, **PNG).codec_layers)


@pytest.fixture(scope="module")
def llama_inductor():
    """Full Inductor compile of tiny llama (once per module: about a minute on 2 CPU cores)."""
    torch._dynamo.reset()  # the shared tiny models may carry compiled code from other tests
    model = tiny_model("llama")
    be = fx.backend(strict=True, debug=True)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        tokens = _generate(model, PNG, be)
    return model, be, tokens, torch._dynamo.utils.counters["stats"]["unique_graphs"] - before


def test_llama_inductor_tokens_equal_eager(llama_inductor):
    model, _, tokens, _ = llama_inductor
    assert torch.equal(tokens, _generate(model, PNG))


def test_compiled_steps_after_an_eager_fill_compile_once():
    """Filled eagerly, then decoded by the compiled model with nothing eager in between (no host read of the length:
    what a serving loop does): one graph for every step. A compiled append leaves the host length mirror stale; a
    guard on that flag recompiled the second step (benchmarks/results/e2e_cpu_compiled.json: recompiles 1)."""
    torch._dynamo.reset()
    model = tiny_model("llama")
    cfg = model.config
    cache = FlashCodecCache.from_config(cfg, layout="static", max_cache_len=40, memoize=False)
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(0)
    step = torch.compile(model, fullgraph=True, backend=fx.backend(strict=True))
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for idx in range(cfg.num_hidden_layers):
            cache.update(*(torch.randn(1, heads, 16, dim, generator=gen) for _ in range(2)), idx)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for pos in range(16, 20):
                step(input_ids=torch.tensor([[42]]), position_ids=torch.tensor([[pos]]), past_key_values=cache,
                     use_cache=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    assert cache.get_seq_length() == 20


def test_llama_inductor_graph_reads_compressed_state(llama_inductor):
    model, be, _, graphs = llama_inductor
    assert graphs == 1  # one decode graph, no recompiles across NEW_TOKENS steps
    decode = [r for r in be.pass_.reports if r.rewritten]
    assert len(decode) == 1
    (report,) = decode
    assert report.rewritten == _codec_layers(model) == 2 and not report.skipped and not report.remaining_views
    assert report.graph_after.count("flashcodec.codec_attention") == 2
    assert "flashcodec.read" not in report.graph_after and "scaled_dot_product" not in report.graph_after
    assert "_local_scalar_dense" not in report.graph_after


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_rewritten_and_equal(family):
    """The pass on each family's real AOT graph (Inductor decompositions, executed without codegen)."""
    torch._dynamo.reset()
    model = tiny_model(family)
    be = fx.backend(strict=True, inductor=False)
    with torch._dynamo.config.patch(error_on_recompile=family != "gemma3"):
        tokens = _generate(model, PNG, be, SHORT)
    assert torch.equal(tokens, _generate(model, PNG, new_tokens=SHORT))
    codec_layers = _codec_layers(model)
    assert be.pass_.reports and all(r.rewritten == codec_layers and not r.skipped for r in be.pass_.reports)


def test_lossy_tier_within_logit_tolerance():
    """jpeg int8: the compiled graph reads the same int8 archive as eager; logits agree to 1e-4."""
    torch._dynamo.reset()
    model = tiny_model("qwen3")
    options = dict(PNG, mode="jpeg", quant_bits=8)
    be = fx.backend(strict=True, inductor=False)
    kwargs = dict(output_logits=True, return_dict_in_generate=True, new_tokens=SHORT)
    compiled, eager = _generate(model, options, be, **kwargs), _generate(model, options, **kwargs)
    for a, b in zip(compiled.logits, eager.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(compiled.sequences, eager.sequences)


def test_backend_by_name_with_options():
    """The registered name works from CompileConfig; this backend's own options ride in ``options``."""
    torch._dynamo.reset()
    model = tiny_model("mistral")
    cache = FlashCodecCache.from_config(model.config, **PNG)
    config = CompileConfig(backend="flashcodec", fullgraph=True, mode=None, options={"inductor": False, "strict": True})
    config._compile_all_devices = True
    with torch.no_grad():
        tokens = model.generate(tiny_prompt(1, 12), max_new_tokens=SHORT, do_sample=False, compile_config=config,
                                **cache_kwargs(cache))
    assert torch.equal(tokens, _generate(model, PNG, new_tokens=SHORT))


def test_apply_flash_codec_compile_option():
    """apply_flash_codec(compile=...) alone makes generate() decode through the flashcodec backend."""
    torch._dynamo.reset()
    from conftest import fresh_tiny_model

    model = fresh_tiny_model("llama")
    want = _generate(model, PNG, new_tokens=SHORT)
    fx.apply_flash_codec(model, mode="png", compile={"inductor": False, "strict": True})
    try:
        with torch.no_grad():
            tokens = model.generate(tiny_prompt(1, 12), max_new_tokens=SHORT, do_sample=False)
        backend = model._flashcodec_patch["compile"]["backend"]
        assert backend.pass_.reports and all(r.rewritten == 2 for r in backend.pass_.reports)
        assert torch.equal(tokens, want)
    finally:
        fx.remove_flash_codec(model)


def test_compress_kv_compile_option():
    torch._dynamo.reset()
    import transformers

    base = tiny_model("qwen3")
    cls = fx.compress_kv(mode="png", compile={"inductor": False})(type("CompiledQwen3", (transformers.Qwen3ForCausalLM,), {}))
    model = cls(base.config).eval()
    model.load_state_dict(base.state_dict())
    with torch.no_grad():
        tokens = model.generate(tiny_prompt(1, 12), max_new_tokens=SHORT, do_sample=False)
    assert torch.equal(tokens, _generate(base, PNG, new_tokens=SHORT))


@pytest.mark.parametrize("options,error", [
    (dict(compile=True, layout="dynamic"), "layout='static'"),
    (dict(compile=True, memoize=True), "memoize=False"),
    (dict(compile="yes"), "compile must be"),
    (dict(compile={"fullgraph": False}), "unknown option"),
])
def test_compile_option_errors(options, error):
    with pytest.raises((ValueError, TypeError), match=error):
        fx.compress_kv(mode="png", **options)
