"""Arguments of the attention call beyond the mask (issue 40): Inkling's relative position bias (``position_bias=``,
``(B, Hq, T, L)``) is folded into the mask the stored form attends with, as transformers' sdpa integration folds it,
so Inkling decodes on the stored form (``strict=True``: no fallback) and equals its own attention over the same codes
decoded. Inkling 2's per-token sink logits (``sinks=``) have no form in ``codec_attention`` (one sink logit per
head): the decoded view is chosen at apply time, and without that choice a call with them falls back, warned."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
MAPPING = transformers.models.auto.configuration_auto.CONFIG_MAPPING
if "inkling_text" not in MAPPING:
    pytest.skip("this transformers has no Inkling", allow_module_level=True)

from tiny_models import apply_saying, codec_greedy, flashcodec_warnings, greedy, padded_batch, same_logits  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.evaluate.architectures import build_model  # noqa: E402
from flashcodec_fx.hf import attention  # noqa: E402

SAME_ROWS = {"raw_dtype": "stream"}  # rows kept as computed, so both routes read identical stored tokens


def test_a_position_bias_is_served_on_the_stored_form():
    model = build_model("inkling_text")
    ids, mask = padded_batch(length=24, pad=10)
    assert same_logits(codec_greedy(model, ids, mask, 4, preset="lossless"), greedy(model, ids, mask, 4), atol=1e-5)
    stored = codec_greedy(model, ids, mask, 4, preset="4bit", strict=True, **SAME_ROWS)
    view = codec_greedy(model, ids, mask, 4, preset="4bit", materialization_free=False, memoize=False, **SAME_ROWS)
    assert torch.equal(stored.sequences, view.sequences)
    torch.testing.assert_close(torch.stack(stored.logits), torch.stack(view.logits), rtol=1e-4, atol=1e-4)


def test_the_biased_mask_is_sdpas():
    from transformers.integrations.sdpa_attention import create_position_bias_mask

    bias = torch.randn(2, 4, 1, 6)
    q, k = torch.zeros(2, 4, 1, 8), torch.zeros(2, 2, 6, 8)
    for mask in (torch.rand(2, 1, 1, 6) > 0.3, torch.randn(2, 1, 1, 6)):
        want = create_position_bias_mask(bias, mask, False, q, k)
        assert torch.equal(attention._biased(mask, {"position_bias": bias}, torch.float32), want)
    assert attention._biased(None, {"position_bias": bias}, torch.float32) is bias


@pytest.mark.skipif("inkling2_text" not in MAPPING, reason="this transformers has no Inkling 2")
def test_per_token_sinks_get_the_view_at_apply_time(monkeypatch):
    model = build_model("inkling2_text")
    ids, mask = padded_batch(length=24, pad=10)
    reference = greedy(model, ids, mask, new_tokens=4)
    apply_saying(model, "MaterializationFreeFallback", "per-token sink logits", preset="lossless")
    try:
        out, caught = flashcodec_warnings(lambda: greedy(model, ids, mask, new_tokens=4))
    finally:
        fx.remove_flash_codec(model)
    assert caught == [] and same_logits(out, reference, atol=1e-5)
    monkeypatch.setattr(attention, "NOT_SERVED", {})
    with pytest.warns(fx.MaterializationFreeFallback, match="per-token sink logits"):
        codec_greedy(model, ids, mask, 2, preset="4bit")
