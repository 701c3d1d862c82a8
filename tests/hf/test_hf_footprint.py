"""What a default FlashCodecCache holds on an fp32 model, in bytes (issue 10's memory target).

A tiny Llama with SmolLM2's head geometry (head_dim 64, GQA 2) runs a real prefill and decode steps through the
``"kvcodec"`` attention, as ``apply_flash_codec`` sets it up. The presets' stored bits are tests/test_presets.py's,
the per-step allocations at two lengths tests/hf/test_hf_long_run.py's.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import cache_kwargs  # noqa: E402

from flashcodec_fx.hf import FlashCodecCache, apply_codec_attention, remove_codec_attention  # noqa: E402

HEAD_DIM = 64
PROMPT = 1000  # + 4 decode steps: 1004 tokens
STEPS = 4
INT8_HELD_MAX = 0.30  # issue 10: a default cache on an fp32 model holds at most 0.30x the raw K/V bytes


def _model():
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                                      max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()  # fp32


def _decode(model, cache, prompt: int, steps: int) -> None:
    """Prefill ``prompt`` random tokens, then ``steps`` greedy single-token steps, through the kvcodec attention."""
    ids = torch.randint(3, 256, (1, prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **cache_kwargs(cache))
        for i in range(steps):
            tok = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=tok, position_ids=torch.tensor([[prompt + i]]), use_cache=True, **cache_kwargs(cache))


@pytest.fixture(scope="module")
def codec_model():
    model = _model()
    apply_codec_attention(model)
    yield model
    remove_codec_attention(model)


@pytest.mark.parametrize("options", [{}, {"mode": "jpeg", "block_size": 8, "quant_bits": 8}], ids=["default", "jpeg-r8"])
@pytest.mark.parametrize("prompt", [PROMPT, 1030, 1290])
def test_default_cache_bytes_on_an_fp32_model(codec_model, options, prompt):
    """Every byte held, allocated capacity included, stays under 0.30x raw at lengths before and just past the
    dynamic archive's growth steps (it grows by 1/16, so capacity never strays far from what is stored)."""
    # no options: the default preset (int8: 8-bit mid-rise per token after a rotation); both on the stored form
    cache = FlashCodecCache.from_config(codec_model.config, **options)
    _decode(codec_model, cache, prompt, STEPS)
    parts = cache.storage_breakdown()
    raw = 2 * 2 * 2 * (prompt + STEPS) * HEAD_DIM * 4  # K and V, 2 layers, 2 kv heads, fp32
    assert parts["raw_equivalent"] == raw
    assert parts["memo"] == 0  # no decoded copy next to the archive
    assert parts["stored"] <= INT8_HELD_MAX * raw
    assert cache.storage_bytes() == parts["total"] <= INT8_HELD_MAX * raw


@pytest.mark.parametrize("preset", ["3bit", "lossless"])
def test_a_short_prompt_never_holds_more_than_a_dynamic_cache(codec_model, preset):
    """A 3-token prompt, then 60 decode steps through the model: after every step the cache holds at most a
    DynamicCache's bytes (lossy presets; lossless exactly as many while its 64-token raw prefix lasts), its first
    tokens held raw until each stream's state fits in their bytes."""
    cache = FlashCodecCache.from_config(codec_model.config, preset=preset)
    ids = torch.randint(3, 256, (1, 3), generator=torch.Generator().manual_seed(2))
    converted = set()
    with torch.no_grad():
        out = codec_model(input_ids=ids, use_cache=True, **cache_kwargs(cache))
        for i in range(60):
            n = 3 + i
            assert cache.storage_bytes() <= cache.storage_breakdown()["raw_equivalent"] == 2 * 2 * 2 * n * HEAD_DIM * 4
            converted |= {id(s) for layer in cache.layers for s in (layer.keys_stream, layer.values_stream)
                          if not s.raw_prefix}
            tok = out.logits[:, -1:].argmax(-1)
            out = codec_model(input_ids=tok, position_ids=torch.tensor([[n]]), use_cache=True, **cache_kwargs(cache))
    assert len(converted) == (4 if preset == "3bit" else 0)  # 3bit: every stream converted within 60 tokens
