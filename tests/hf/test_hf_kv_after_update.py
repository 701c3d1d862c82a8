"""Attention modules that do more with the K/V ``cache.update`` returns than pass them to their attention call
(issue 40): JetMoE repeats them per expert, DiffLlama splits its values in halves, Doge builds its mask from every
value. The stored form cannot serve them (``attention.NOT_SERVED``): ``apply_flash_codec`` chooses the decoded view at
apply time and says so once; ``lossless`` gives the plain model's tokens in a padded batch. Without that list the
attention call's tensors and mask are checked, so such a model is never served silently a stored form it did not
receive: its layers fall back to the decoded view, warned."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import apply_saying, codec_greedy, flashcodec_warnings, greedy, padded_batch, same_logits  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.evaluate.architectures import build_model  # noqa: E402
from flashcodec_fx.hf import attention  # noqa: E402

MODELS = [m for m in ("jetmoe", "diffllama", "doge") if m in transformers.models.auto.configuration_auto.CONFIG_MAPPING]


@pytest.mark.parametrize("model_type", MODELS)
def test_the_view_is_chosen_at_apply_time_and_lossless_is_exact(model_type):
    model = build_model(model_type)
    ids, mask = padded_batch()
    reference = greedy(model, ids, mask)
    apply_saying(model, "MaterializationFreeFallback", "cache.update", preset="lossless")
    try:
        out, caught = flashcodec_warnings(lambda: greedy(model, ids, mask))
    finally:
        fx.remove_flash_codec(model)
    assert caught == [] and same_logits(out, reference)
    with pytest.raises(ValueError, match="strict=True"):
        fx.apply_flash_codec(model, preset="4bit", strict=True)


def test_unlisted_a_model_that_changes_its_values_falls_back_warned(monkeypatch):
    monkeypatch.setattr(attention, "NOT_SERVED", {})
    model = build_model("diffllama")
    ids, mask = padded_batch()
    with pytest.warns(fx.MaterializationFreeFallback, match="not use the 'kvcodec' attention"):
        stored = codec_greedy(model, ids, mask, preset="4bit")
    view = codec_greedy(model, ids, mask, preset="4bit", materialization_free=False)
    assert torch.equal(stored.sequences, view.sequences)
    torch.testing.assert_close(torch.stack(stored.logits), torch.stack(view.logits), rtol=1e-4, atol=1e-4)


def test_unlisted_a_mask_built_for_fewer_keys_is_not_served_silently(monkeypatch):
    """Doge builds its mask from the values the update returns: the step's token only, a mask over 1 key."""
    monkeypatch.setattr(attention, "NOT_SERVED", {})
    model = build_model("doge")
    ids, mask = padded_batch()
    with pytest.warns(fx.MaterializationFreeFallback, match="a mask over 1 keys"):
        codec_greedy(model, ids, mask, preset="4bit")
