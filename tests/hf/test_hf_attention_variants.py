"""Attention variants on the stored form (issue 40): attention-sink logits (GPT-OSS), logit soft-capping (Gemma 2),
ALiBi (BLOOM and MPT, whose attention modules are served by adapters: ``hf/alibi.py``). ``lossless`` gives the plain
model's tokens in a left-padded batch; a lossy preset decodes on the stored form with ``strict=True`` (no fallback)
and equals the model's own attention over the same stored codes decoded (``materialization_free=False``)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.hf.alibi import alibi_slopes  # noqa: E402

SMALL = dict(vocab_size=128, pad_token_id=0)
ATTENTION = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
CONFIGS = {
    "gpt_oss": dict(SMALL, **ATTENTION, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),
    "gemma2": dict(SMALL, **ATTENTION, sliding_window=8, attn_logit_softcapping=5.0),
    "bloom": dict(SMALL, hidden_size=64, n_layer=2, n_head=4),
    "mpt": dict(SMALL, d_model=64, n_layers=2, n_heads=4, max_seq_len=256, use_cache=True),  # MptConfig: False
}
SAME_ROWS = {"raw_dtype": "stream"}  # rows kept as computed, so both routes read identical stored tokens


def _model(model_type: str):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **CONFIGS[model_type])
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _generate(model, **options):
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :20] = 0  # longer than the sliding windows
    ids[1, :20] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    if not options:
        return model.generate(ids, **kwargs)
    fx.apply_flash_codec(model, **options)
    try:
        return model.generate(ids, **kwargs)
    finally:
        fx.remove_flash_codec(model)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_lossless_is_token_exact(model_type):
    model = _model(model_type)
    assert torch.equal(_generate(model, preset="lossless").sequences, _generate(model).sequences)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_lossy_preset_decodes_on_the_stored_form(model_type):
    model = _model(model_type)
    stored = _generate(model, preset="4bit", strict=True, **SAME_ROWS)
    view = _generate(model, preset="4bit", materialization_free=False, memoize=False, **SAME_ROWS)
    assert torch.equal(stored.sequences, view.sequences)
    torch.testing.assert_close(torch.stack(stored.logits), torch.stack(view.logits), rtol=1e-4, atol=1e-4)


def test_the_adapters_leave_with_the_codec():
    model = _model("bloom")
    fx.apply_flash_codec(model, preset="int8")
    assert all("forward" in vars(m) for m in model.modules() if type(m).__name__ == "BloomAttention")
    fx.remove_flash_codec(model)
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("heads", [1, 4, 6, 12, 16])
def test_alibi_slopes_are_blooms(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bias = build_alibi_tensor(torch.ones(1, 3), heads, torch.float32)  # (heads, 1, 3): slope * position
    torch.testing.assert_close(alibi_slopes(heads), bias[:, 0, 1])


def test_a_model_that_keeps_no_cache_is_told_at_apply_time():
    """MPT's config defaults to ``use_cache=False``: generate() keeps no cache, so the codec would compress nothing."""
    torch.manual_seed(0)
    config = transformers.MptConfig(**{**CONFIGS["mpt"], "use_cache": False})
    model = transformers.MptForCausalLM(config).eval()
    with pytest.warns(fx.NoCodecLayers, match="use_cache=False"):
        fx.apply_flash_codec(model, preset="int8")
    fx.remove_flash_codec(model)
