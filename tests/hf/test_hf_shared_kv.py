"""Attention calls that read K/V handed out under another layer index (issue 40): KV sharing (Gemma 3n: the last
layers attend on an earlier layer's keys and values), looped and shared-block models that update the cache at an
offset (HRM, Dory, Zamba 2). They take the step whose very key tensor they receive, so they attend on the stored form
with no fallback: ``lossless`` gives the plain model's tokens in a padded batch; a lossy preset with ``strict=True``
equals the model's own attention over the same codes decoded."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import cache_of, codec_greedy, flashcodec_warnings, greedy, padded_batch, same_logits  # noqa: E402

from flashcodec_fx.evaluate.architectures import build_model  # noqa: E402

SAME_ROWS = {"raw_dtype": "stream"}  # rows kept as computed, so both routes read identical stored tokens
MODELS = [m for m in ("gemma3n_text", "hrm_text", "dory", "zamba2")
          if m in transformers.models.auto.configuration_auto.CONFIG_MAPPING]


@pytest.mark.parametrize("model_type", MODELS)
def test_lossless_padded_batch_is_exact(model_type):
    model = build_model(model_type)
    ids, mask = padded_batch()
    out, caught = flashcodec_warnings(lambda: codec_greedy(model, ids, mask, preset="lossless"))
    assert caught == [] and cache_of(out).codec_layers
    assert same_logits(out, greedy(model, ids, mask), atol=1e-5)


@pytest.mark.parametrize("model_type", MODELS)
def test_a_lossy_preset_attends_on_the_stored_form(model_type):
    model = build_model(model_type)
    ids, mask = padded_batch()
    stored = codec_greedy(model, ids, mask, preset="4bit", strict=True, **SAME_ROWS)
    view = codec_greedy(model, ids, mask, preset="4bit", materialization_free=False, memoize=False, **SAME_ROWS)
    assert torch.equal(stored.sequences, view.sequences)
    torch.testing.assert_close(torch.stack(stored.logits), torch.stack(view.logits), rtol=1e-4, atol=1e-4)

