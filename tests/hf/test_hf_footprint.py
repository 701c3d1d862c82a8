"""What a default FlashCodecCache holds on a model (bytes, not time) and what a decode step allocates.

A tiny Llama with SmolLM2's head geometry (head_dim 64, GQA 2) runs a real prefill and decode steps through the
``"kvcodec"`` attention, as ``apply_flash_codec`` sets it up; nothing is compared against a timing.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import cache_kwargs  # noqa: E402

from flashcodec_fx import PRESETS  # noqa: E402
from flashcodec_fx.hf import FlashCodecCache, apply_codec_attention, remove_codec_attention  # noqa: E402

HEAD_DIM = 64
PROMPT = 1000  # + 4 decode steps: 1004 tokens, just under the dynamic archive's 1024-position capacity step
PRESET_PROMPT = 4000  # 4004 tokens, under the 4096-position step
STEPS = 4
INT8_HELD_MAX = 0.30  # issue 10: a default cache on an fp32 model holds at most 0.30x the raw K/V bytes
INT8_HELD_AFTER_STEP = 0.55  # what it holds just past a capacity step (measured 0.52x): issue 10's 0.30x is missed
# Presets on a bf16 model at 4004 tokens: stored bits / 16 within this slack of the bits their name gives. The
# slack pays for what a name leaves out: scales and zero points, 4 raw sinks, the raw window of values and the key
# group (128 tokens) waiting to complete. Measured at 4004 tokens: 4bit 4.34, 3bit 2.75, 2.5bit 2.41 bits; those
# fixed raw tokens weigh 3x more at 1004 tokens (5.02, 3.59, 3.20 bits there).
PRESET_BITS = {"4bit": 4.0, "3bit": 3.0, "2.5bit": 2.5}
PRESET_SLACK = 1.10


def _model(dtype: torch.dtype):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                                      max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _decode(model, cache, prompt: int, steps: int) -> None:
    """Prefill ``prompt`` random tokens, then ``steps`` greedy single-token steps, through the kvcodec attention."""
    ids = torch.randint(3, 256, (1, prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **cache_kwargs(cache))
        for i in range(steps):
            tok = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=tok, position_ids=torch.tensor([[prompt + i]]), use_cache=True, **cache_kwargs(cache))


@pytest.fixture
def codec_model():
    models = {}

    def get(dtype):
        if dtype not in models:
            models[dtype] = _model(dtype)
            apply_codec_attention(models[dtype])
        return models[dtype]

    yield get
    for model in models.values():
        remove_codec_attention(model)


@pytest.mark.parametrize(("prompt", "held_max"), [(PROMPT, INT8_HELD_MAX), (1030, INT8_HELD_AFTER_STEP)])
def test_default_cache_bytes_on_an_fp32_model(codec_model, prompt, held_max):
    """Stored bytes (archive groups in use + scales + tail) stay under 0.30x raw at any length; every byte held
    (allocated capacity included) does just under a capacity step (1004 tokens in 1024 positions) but not just past
    one (1034 tokens in 2048 positions): the dynamic archive doubles, so held bytes reach ~2x the stored ones there."""
    model = codec_model(torch.float32)
    cache = FlashCodecCache.from_config(model.config)  # the defaults: the 8-bit preset, attention on the stored form
    _decode(model, cache, prompt, STEPS)
    parts = cache.storage_breakdown()
    raw = 2 * 2 * 2 * (prompt + STEPS) * HEAD_DIM * 4  # K and V, 2 layers, 2 kv heads, fp32
    assert parts["raw_equivalent"] == raw
    assert parts["memo"] == 0  # no decoded copy next to the archive
    assert parts["stored"] <= INT8_HELD_MAX * raw
    assert cache.storage_bytes() == parts["total"] <= held_max * raw


@pytest.mark.parametrize("preset", list(PRESET_BITS))
def test_quality_presets_store_their_bits_over_16_of_raw_on_a_bf16_model(codec_model, preset):
    assert preset in PRESETS
    model = codec_model(torch.bfloat16)
    cache = FlashCodecCache.from_config(model.config, preset=preset)
    _decode(model, cache, PRESET_PROMPT, STEPS)
    parts = cache.storage_breakdown()
    assert parts["memo"] == 0
    ratio = parts["stored"] / parts["raw_equivalent"]
    nominal = PRESET_BITS[preset] / 16
    assert ratio <= nominal * PRESET_SLACK, f"{preset}: {ratio * 16:.2f} bits/value stored"
    assert cache.bits_per_value() == pytest.approx(16 * ratio, rel=1e-9)


def _step_allocations(model, cache, position: int) -> list[int]:
    """Sizes of every allocation one decode step makes through torch's CPU allocator (profiler memory events)."""
    tok = torch.tensor([[7]])
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                 profile_memory=True) as prof:
        model(input_ids=tok, position_ids=torch.tensor([[position]]), use_cache=True, **cache_kwargs(cache))
    return sorted(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def test_decode_step_allocations_do_not_grow_with_the_length(codec_model):
    """After warm-up, a default cache's decode step allocates the same bytes at 300 and at 900 stored tokens (no
    archive growth inside either step: both lengths sit inside one capacity step)."""
    model = codec_model(torch.float32)
    seen = {}
    for prompt in (300, 900):
        cache = FlashCodecCache.from_config(model.config)
        _decode(model, cache, prompt, 3)  # warm-up: plans, validation and the first steps' lazy set-up
        capacity = cache.layers[0].keys_stream.capacity
        seen[prompt] = _step_allocations(model, cache, prompt + 3)
        assert cache.layers[0].keys_stream.capacity == capacity  # the measured step did not grow the archive
    assert seen[300], "the profiler saw no allocation at all"
    assert sum(seen[300]) == sum(seen[900]) and seen[300] == seen[900]
