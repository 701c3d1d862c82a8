"""Compiled decode of a toy decoder over codec caches: the pass removes the decoded view, tokens match eager,
no recompiles or host syncs across block boundaries, strict mode errors, and no-op without a codec cache."""

from __future__ import annotations

import pytest
import torch
from passes_toy import PROMPT, Compiled, ToyDecoder, greedy, prefill, twin

import flashcodec_fx as fc
from flashcodec_fx.passes import MaterializationError, backend

STEPS = 60  # PROMPT has 11 tokens: positions 11..70 cross 8 block boundaries of r=8


@pytest.fixture(scope="module")
def compiled_png_repeat(tmp_path_factory) -> Compiled:
    """png lossless, repeat_kv, bool mask, strict, graphs dumped (compiled once: Inductor on CPU is slow)."""
    return Compiled(tmp_path_factory.mktemp("png_repeat"))


@pytest.fixture(scope="module")
def compiled_jpeg_gqa(tmp_path_factory) -> Compiled:
    """jpeg int8 (lossy), enable_gqa, additive float mask, strict."""
    return Compiled(tmp_path_factory.mktemp("jpeg_gqa"), codec=fc.make_codec("jpeg", block_size=8, quant_bits=8),
                    gqa="enable", mask="float")


def _decode_both(fx, steps=STEPS):
    first = prefill(fx.eager)
    assert torch.equal(prefill(fx.model), first)
    with torch.no_grad():
        eager = greedy(fx.eager, first, PROMPT.shape[1], steps)
        before = dict(torch._dynamo.utils.counters["stats"])
        compiled = greedy(fx.step, first, PROMPT.shape[1], 1)  # compiles once
        with torch._dynamo.config.patch(error_on_recompile=True):
            more = greedy(fx.step, torch.tensor([compiled[0]]), PROMPT.shape[1] + 1, steps - 1)
        after = dict(torch._dynamo.utils.counters["stats"])
    return eager, (compiled[0] + more[0], compiled[1] + more[1]), before, after


@pytest.fixture(scope="module")
def png_run(compiled_png_repeat):
    with torch.no_grad():
        return compiled_png_repeat, *_decode_both(compiled_png_repeat)


@pytest.fixture(scope="module")
def jpeg_run(compiled_jpeg_gqa):
    with torch.no_grad():
        return compiled_jpeg_gqa, *_decode_both(compiled_jpeg_gqa)


def _decode_graph(fx):
    reports = [r for r in fx.backend.pass_.reports if r.rewritten]
    assert len(reports) == 1, [(r.rewritten, r.skipped) for r in fx.backend.pass_.reports]
    return reports[0]


def test_png_compiled_tokens_equal_eager(png_run):
    fx, eager, compiled, _, _ = png_run
    assert compiled[0] == eager[0]
    for a, b in zip(compiled[1], eager[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_jpeg_int8_compiled_within_tolerance(jpeg_run):
    """Lossy tier: both paths read the same int8 archive, so they agree up to fp32 summation order (1e-4)."""
    fx, eager, compiled, _, _ = jpeg_run
    for a, b in zip(compiled[1], eager[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert compiled[0] == eager[0]


@pytest.mark.parametrize("run", ["png_run", "jpeg_run"])
def test_post_pass_graph_has_codec_attention_only(run, request):
    fx = request.getfixturevalue(run)[0]
    report = _decode_graph(fx)
    assert report.rewritten == 2  # one per layer
    assert report.graph_before.count("flashcodec.read") == 4
    after = report.graph_after
    assert after.count("flashcodec.codec_attention") == 2
    assert "flashcodec.read" not in after and "flashcodec.decode" not in after
    assert "scaled_dot_product" not in after and "expand" not in after
    assert "_local_scalar_dense" not in after  # no host sync in the step
    dumped = sorted(p.name for p in fx.debug_dir.iterdir())
    assert any(name.endswith("_after.txt") for name in dumped) and any(name.endswith("_before.txt") for name in dumped)


@pytest.mark.parametrize("run", ["png_run", "jpeg_run"])
def test_no_recompile_across_block_boundaries(run, request):
    _, _, compiled, before, after = request.getfixturevalue(run)
    assert len(compiled[0]) == STEPS
    assert after.get("unique_graphs", 0) == before.get("unique_graphs", 0) + 1


def test_pass_is_noop_without_codec_cache(tmp_path):
    model = ToyDecoder(cache="raw", layers=1)
    eager = twin(model, cache="raw", layers=1)
    be = backend(debug=str(tmp_path))
    step = torch.compile(model, backend=be, fullgraph=True)
    with torch.no_grad():
        first = prefill(eager)
        prefill(model)
        ids, pos = first, torch.tensor([PROMPT.shape[1]])
        torch.testing.assert_close(step(ids, pos), eager(ids, pos), rtol=1e-5, atol=1e-5)
    (report,) = be.pass_.reports
    assert report.rewritten == 0 and report.not_codec == 1 and not report.skipped
    assert report.graph_before == report.graph_after
    assert "scaled_dot_product" in report.graph_after


def test_strict_raises_when_pattern_not_found():
    """is_causal=True over a cache read is not the same attention: left alone, and strict mode says so."""
    model = ToyDecoder(layers=1, is_causal=True)
    step = torch.compile(model, backend=backend(strict=True), fullgraph=True)
    with torch.no_grad(), pytest.raises(Exception, match="is_causal=True") as info:
        step(PROMPT, torch.arange(PROMPT.shape[1]))
    assert isinstance(info.value, MaterializationError) or isinstance(info.value.__cause__, MaterializationError) \
        or "MaterializationError" in str(info.value)


def test_strict_raises_on_memoized_view():
    model = ToyDecoder(layers=1, cache="memo")
    with torch.no_grad():
        first = prefill(model)
        step = torch.compile(model, backend="flashcodec", fullgraph=True, options={"strict": True})
        with pytest.raises(Exception, match="memoized view"):
            step(first, torch.tensor([PROMPT.shape[1]]))


def test_non_strict_leaves_unmatched_site_and_stays_correct(tmp_path):
    model = ToyDecoder(layers=1, is_causal=True)
    eager = twin(model, layers=1, is_causal=True)
    be = backend(debug=str(tmp_path))  # debug bypasses the FX graph cache: the pass runs and reports every time
    step = torch.compile(model, backend=be, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(step(PROMPT, torch.arange(11)), eager(PROMPT, torch.arange(11)), rtol=1e-5, atol=1e-5)
    (report,) = be.pass_.reports
    assert report.rewritten == 0 and "is_causal=True" in report.skipped[0]
    assert report.remaining_views


def test_memo_model_unaffected_by_codec_choice():
    """Sanity for the fixtures: the unmemoized toy equals a memoized one in eager mode."""
    codec = fc.make_codec("png", block_size=8)
    a, b = ToyDecoder(codec=codec, layers=1), ToyDecoder(codec=codec, layers=1, cache="memo")
    with torch.no_grad():
        assert torch.equal(prefill(a), prefill(b))
