"""Named presets: every one builds, decodes on the stored form through generate(), and stores what its name says."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import fresh_tiny_model, tiny_prompt  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.config import CacheConfig, cache_config  # noqa: E402
from flashcodec_fx.presets import PRESETS, RECIPES, preset_options  # noqa: E402

# Stored bits per value of each preset on SmolLM2-135M's shape (30 layers x 3 KV heads x head_dim 64, bf16), after
# the streaming protocol's 1024 tokens (prefill 128, chunks of 16); the README's figures come from the same count.
# A trellis twin (``NAME-tcq``, issue 42) stores exactly its scalar twin's bits: the same codes' bytes and scales.
SCALAR_BITS_AT_1024 = {"lossless": 16.0, "int8": 8.25, "4bit": 4.181, "3bit": 2.964, "2.5bit": 2.468, "2bit": 1.967}
BITS_AT_1024 = {**SCALAR_BITS_AT_1024, **{f"{n}-tcq": SCALAR_BITS_AT_1024[n] for n in ("4bit", "3bit", "2.5bit", "2bit")}}
# What each lossy preset may store at most from the protocol's length on (issue 20): its name, except 4bit, whose
# 4-bit codes keep their scale on top (4.25 bits/value, what TurboQuant-style K4V4 stores).
SCALAR_BUDGET = {"4bit": 4.25, "3bit": 3.0, "2.5bit": 2.5, "2bit": 2.0}
BUDGET = {**SCALAR_BUDGET, **{f"{n}-tcq": b for n, b in SCALAR_BUDGET.items()}}


def _bits_at(config, preset: str, length: int = 1024, prefill: int = 128, chunk: int = 16,
             dtype: torch.dtype = torch.bfloat16) -> float:
    cache = fx.FlashCodecCache.from_config(config, preset=preset)
    gen = torch.Generator().manual_seed(0)
    heads, d = config.num_key_value_heads, config.head_dim
    for t in [prefill] + [chunk] * ((length - prefill) // chunk):
        for layer in cache.layers:
            k, v = (torch.randn(1, heads, t, d, generator=gen).to(dtype) for _ in range(2))
            layer.codec_cache.append(k, v)
    return cache.bits_per_value()


def test_the_preset_table_is_the_documented_one():
    assert set(PRESETS) == set(BITS_AT_1024) and fx.PRESETS is PRESETS
    assert fx.presets.DEFAULT_PRESET in PRESETS


@pytest.mark.parametrize("scalar", sorted(SCALAR_BUDGET))
def test_a_trellis_preset_is_its_scalar_twin_with_trellis_codes(scalar):
    """``NAME-tcq``: ``NAME``'s recipe with ``levels="tcq"`` in both streams (what ``preset=NAME, levels="tcq"``
    builds), listed beside the scalar presets; its codes pack into the same bytes, so the bits as stored are equal
    at every length (tested at the protocol's length in ``test_bits_as_stored_at_the_protocol_length``)."""
    twin = f"{scalar}-tcq"
    assert (scalar in fx.presets.SCALAR_PRESETS and twin in fx.presets.TRELLIS_PRESETS and
            twin in fx.PRESETS)
    for stream in ("key_options", "value_options"):
        assert RECIPES[scalar][stream]["levels"] == "lloyd"
        assert RECIPES[twin][stream] == {**RECIPES[scalar][stream], "levels": "tcq"}
    assert PRESETS[twin] == cache_config(preset=scalar, levels="tcq")
    key, value = fx.presets.preset_codecs(twin, 3)
    assert key.quantizer.levels == value.quantizer.levels == ("tcq",)
    config = transformers.LlamaConfig(num_hidden_layers=2, num_key_value_heads=3, num_attention_heads=9,
                                      hidden_size=576, head_dim=64)
    assert _bits_at(config, twin, length=300) == _bits_at(config, scalar, length=300)


@pytest.mark.parametrize("preset", sorted(BITS_AT_1024))
def test_bits_as_stored_at_the_protocol_length(preset):
    config = transformers.LlamaConfig(num_hidden_layers=2, num_key_value_heads=3, num_attention_heads=9,
                                      hidden_size=576, head_dim=64)
    assert _bits_at(config, preset) == pytest.approx(BITS_AT_1024[preset], abs=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("preset", sorted(BUDGET))
def test_a_preset_stores_at_most_its_budget_in_bits_from_the_protocol_length_on(preset, dtype):
    """The name is an upper bound a user can plan memory with (``BUDGET``): from 897 tokens (the shortest length the streaming
    protocol's worst case covers) every later length keeps at most the name's bits per value as stored (SmolLM2's
    head shape), the raw sinks and newest tokens included; shorter caches are dominated by those. In bf16 and in fp32
    (``from_pretrained``'s dtype on a CPU) alike: an fp32 stream keeps its raw rows in bf16 (``raw_dtype="auto"``), so
    it stores exactly a bf16 stream's bits."""
    config = transformers.LlamaConfig(num_hidden_layers=2, num_key_value_heads=3, num_attention_heads=9,
                                      hidden_size=576, head_dim=64)
    cache = fx.FlashCodecCache.from_config(config, preset=preset)
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for length in [896] + [1] * 160:
        for layer in cache.layers:
            k, v = (torch.randn(1, 3, length, 64, generator=gen).to(dtype) for _ in range(2))
            layer.codec_cache.append(k, v)
        worst = max(worst, cache.bits_per_value())
    assert worst <= BUDGET[preset]
    assert all(s.raw_dtype == torch.bfloat16 and s.dtype == dtype for layer in cache.layers
               for s in (layer.keys_stream, layer.values_stream))


@pytest.mark.parametrize("preset", sorted(BITS_AT_1024))
def test_fp32_streams_store_what_bf16_streams_store_but_int8_and_lossless(preset):
    """The bits of the protocol's 1024 tokens in fp32: a lossy preset's are its bf16 figure (raw rows in bf16);
    ``int8`` holds no raw token (8.25 either way); ``lossless`` keeps the tokens as given (32 bits in fp32)."""
    config = transformers.LlamaConfig(num_hidden_layers=2, num_key_value_heads=3, num_attention_heads=9,
                                      hidden_size=576, head_dim=64)
    want = 32.0 if preset == "lossless" else BITS_AT_1024[preset]
    assert _bits_at(config, preset, dtype=torch.float32) == pytest.approx(want, abs=1e-3)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_generates_on_the_stored_form(preset):
    model = fresh_tiny_model("llama")
    ids = tiny_prompt(1, 10)
    reference = model.generate(ids, max_new_tokens=24, do_sample=False)
    fx.apply_flash_codec(model, preset=preset, strict=True)  # strict: no fallback to a decoded view
    cache = fx.FlashCodecCache.from_config(model.config, preset=preset)
    try:
        out = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=cache)
    finally:
        fx.remove_flash_codec(model)
    assert out.shape == reference.shape
    if preset == "lossless":
        assert torch.equal(out, reference)
    stream = cache.layers[0].keys_stream  # fp32 model: a lossy preset's raw rows in bf16, int8 and lossless as given
    assert model.dtype == stream.dtype == torch.float32
    assert stream.raw_dtype == (torch.bfloat16 if preset in BUDGET else torch.float32)


def test_overrides_apply_over_the_preset_streams():
    """Shared options reach both streams over the preset's own (they are never silently shadowed by them); stream
    options reach one; the preset table itself never changes."""
    base = PRESETS["3bit"].layers
    merged = cache_config(preset="3bit", window=8, value_options={"quant_bits": 4}).layers
    assert merged.key.as_dict == {**base.key.as_dict, "window": 8}
    assert merged.value.as_dict == {**base.value.as_dict, "window": 8, "quant_bits": 4}
    assert PRESETS["3bit"].layers == base and RECIPES["3bit"]["key_options"]["window"] == 18
    options = preset_options("3bit")
    options["key_options"]["sinks"] = 99
    assert RECIPES["3bit"]["key_options"]["sinks"] != 99  # copies, never the table itself


@pytest.mark.parametrize("options", [dict(mode="png"), dict(key_options={"mode": "png"})])
def test_a_mode_next_to_a_preset_is_refused(options):
    with pytest.raises(ValueError, match="would replace preset '4bit'"):
        fx.FlashCodecCache(preset="4bit", **options)


def test_presets_are_configs_whose_spec_round_trips():
    for name, config in PRESETS.items():
        assert isinstance(config, CacheConfig) and CacheConfig.from_spec(config.spec) == config, name
        assert cache_config(**RECIPES[name]) == config


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="preset must be one of"):
        preset_options("1bit")
    with pytest.raises(TypeError, match="preset must be a preset name"):
        preset_options(3)
