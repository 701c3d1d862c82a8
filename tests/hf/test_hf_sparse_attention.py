"""Sparse attention with an indexer (DeepSeek-V3.2 and kin, issue 40): under any implementation name but ``"sdpa"`` /
``"eager"`` their attention modules pass the selected keys as ``indices=`` instead of masking the rest themselves; the
``"kvcodec"`` attention folds them into the mask exactly as the modules do, so delegating changes no token. Their
``indexed_attention`` layers carry no codec: ``apply_flash_codec`` says so (``NoCodecLayers``) and leaves the model's
attention as it was."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import apply_saying, cache_of, greedy, padded_batch, same_logits  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.evaluate.architectures import build_model  # noqa: E402
from flashcodec_fx.hf.attention import index_mask  # noqa: E402

MODELS = [m for m in ("deepseek_v32", "glm_moe_dsa") if m in transformers.models.auto.configuration_auto.CONFIG_MAPPING]


def test_the_index_mask_hides_the_keys_not_selected():
    indices = torch.tensor([[[0, 2], [1, 3]]])  # (B=1, T=2, k=2) of 4 keys
    causal = torch.tensor([[True, True, True, False], [True, True, True, True]])[None, None]
    want = torch.tensor([[True, False, True, False], [False, True, False, True]])[None, None]
    assert torch.equal(index_mask(causal, indices, 4, torch.float32), want)
    assert torch.equal(index_mask(None, indices, 4, torch.float32), torch.tensor(
        [[True, False, True, False], [False, True, False, True]])[None, None])
    additive = torch.zeros(1, 1, 2, 4)
    got = index_mask(additive, indices, 4, torch.float32)
    assert torch.equal(got == 0, want) and (got[~want] == torch.finfo(torch.float32).min).all()


@pytest.mark.parametrize("model_type", MODELS)
def test_the_kvcodec_delegate_is_exact_on_the_native_cache(model_type):
    model = build_model(model_type)
    ids, mask = padded_batch()
    reference = greedy(model, ids, mask)
    fx.apply_codec_attention(model)
    try:
        out = greedy(model, ids, mask, num_beams=2)
        assert model.config._attn_implementation == "kvcodec"
        assert same_logits(greedy(model, ids, mask), reference)
    finally:
        fx.remove_codec_attention(model)
    assert torch.equal(out.sequences, greedy(model, ids, mask, num_beams=2).sequences)


@pytest.mark.parametrize("model_type", MODELS)
def test_nothing_to_compress_is_said_and_the_attention_kept(model_type):
    model = build_model(model_type)
    ids, mask = padded_batch()
    reference = greedy(model, ids, mask)
    apply_saying(model, "NoCodecLayers", "compresses nothing", preset="int8")
    try:
        assert model.config._attn_implementation == "sdpa"
        out = greedy(model, ids, mask)
    finally:
        fx.remove_flash_codec(model)
    assert same_logits(out, reference) and cache_of(out).codec_layers == []
