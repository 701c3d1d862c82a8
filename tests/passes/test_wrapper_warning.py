"""`CompiledGenerateWarning`: torch.compile(hf_model, backend="flashcodec") would leave generate() uncompiled."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from conftest import fresh_tiny_model, tiny_prompt  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx._compat import GENERATE_CACHE_KWARG  # noqa: E402
from flashcodec_fx.passes import CompiledGenerateWarning  # noqa: E402


def caught(fn) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        fn()
    return [w for w in found if issubclass(w.category, CompiledGenerateWarning)]


@pytest.mark.parametrize("backend", ["flashcodec", fx.backend(strict=True), fx.backend(inductor=False)])
def test_wrapping_a_generative_model_warns_once_per_model(backend):
    model = fresh_tiny_model("llama")
    first = caught(lambda: torch.compile(model, backend=backend))
    assert len(first) == 1
    message = str(first[0].message)
    assert "apply_flash_codec(model, ..., compile=True)" in message and "model.forward = torch.compile" in message
    assert first[0].filename == __file__  # points at the torch.compile call
    assert caught(lambda: torch.compile(model, backend=backend)) == []  # once per model
    assert len(caught(lambda: torch.compile(fresh_tiny_model("llama"), backend=backend))) == 1


@pytest.mark.parametrize("backend", ["inductor", "eager"])
def test_other_backends_do_not_warn(backend):
    assert caught(lambda: torch.compile(fresh_tiny_model("llama"), backend=backend)) == []


def test_modules_without_generate_do_not_warn():
    assert caught(lambda: torch.compile(torch.nn.Linear(4, 4), backend="flashcodec")) == []


def test_the_compiled_forward_recipe_decodes_with_the_pass(tmp_path):
    """docs/compile.md recipe 2: generate() calls the compiled forward; its last graph (decode) attends on the archive."""
    torch._dynamo.reset()
    model, ids = fresh_tiny_model("llama"), tiny_prompt()

    def static_cache():
        return fx.FlashCodecCache.from_config(model.config, mode="png", layout="static", max_cache_len=64, memoize=False)

    eager = model.generate(ids, max_new_tokens=12, do_sample=False, **{GENERATE_CACHE_KWARG: static_cache()})
    # Inductor, as the recipe (the pass-only mode, inductor=False, breaks on a rewritten prefill site with transformers
    # 5.17: its graph views the attention output with SDPA's strides); debug bypasses the FX graph cache, so the pass
    # runs and reports every time.
    backend = fx.backend(debug=str(tmp_path))
    model.forward = torch.compile(model.forward, backend=backend, fullgraph=True)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, **{GENERATE_CACHE_KWARG: static_cache()})
    assert torch.equal(out, eager)
    assert [report.rewritten for report in backend.pass_.reports][-1] == model.config.num_hidden_layers
