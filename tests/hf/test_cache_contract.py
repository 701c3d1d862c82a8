"""Regressions of issue 11: the transformers Cache contract, one test per bug (each failed on the code before the fix).

Bugs 1-8 of the issue, in order; the stateful fuzzer (test_cache_contract_fuzz.py) explores the same calls at random.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from cache_state import same, snapshot  # noqa: E402
from codec_tiers import grid_data  # noqa: E402
from conftest import cache_kwargs, fresh_tiny_model, tiny_config, tiny_model, tiny_prompt  # noqa: E402
from transformers.cache_utils import DynamicLayer, StaticCache  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx import CodecKVCache, CodecOverflowError  # noqa: E402
from flashcodec_fx.codecs import make_codec  # noqa: E402
from flashcodec_fx.hf import FlashCodecLayer  # noqa: E402
from flashcodec_fx.hf.attention import flashcodec_attention_forward  # noqa: E402

B, H, D = 3, 2, 16


def _grid(t: int, seed: int, batch: int = B, dtype=torch.bfloat16, head_dim: int = D) -> torch.Tensor:
    """Multiples of 1/16: png stores them bitwise in every dtype."""
    return grid_data((batch, H, t, head_dim), dtype, seed)


def _png_layer(**kwargs) -> FlashCodecLayer:
    codec = make_codec("png", block_size=8)
    return FlashCodecLayer(codec, codec, materialization_free=False, **kwargs)


# 1. batch_select_indices with a bool mask selected rows [1, 0, 1] instead of [0, 2]
def test_bool_mask_selects_the_rows_it_marks():
    layer, native = _png_layer(), DynamicLayer()
    k, v = _grid(13, 0), _grid(13, 1)
    layer.update(k, v)
    native.update(k, v)
    mask = torch.tensor([True, False, True])
    layer.batch_select_indices(mask)
    native.batch_select_indices(mask)
    view_k, view_v = layer.read_view()
    assert view_k.shape[0] == 2 and torch.equal(view_k, native.keys) and torch.equal(view_v, native.values)
    assert torch.equal(view_k, k[[0, 2]])
    before = snapshot(layer)
    with pytest.raises(ValueError, match=r"boolean batch mask must be \(2,\)"):
        layer.batch_select_indices(torch.tensor([True, False, True]))
    assert same(snapshot(layer), before)


# 2. crop + re-append was not a rollback (jpeg int8 off by 2.4e-3, png fp32 by 1 ulp) although is_croppable said so
ROLLBACKS = {  # name: (cache options, stream dtype, crop, exact rollback?)
    "jpeg-int8": (dict(quant_bits=8), torch.float32, -4, False),
    "jpeg-k4-int8": (dict(keep_freqs=4, quant_bits=8), torch.float32, -4, False),
    "png-fp32": (dict(mode="png"), torch.float32, -4, False),
    "png-bf16": (dict(mode="png"), torch.bfloat16, -4, True),
    "jpeg-int8-window4": (dict(quant_bits=8, window=4), torch.float32, -4, True),  # inside the raw tail
    "jpeg-int8-group-boundary": (dict(quant_bits=8), torch.float32, -8, True),
    "token-lloyd2": (dict(block_size=1, quant_bits=2, levels="lloyd", rotate=True, center=True, sinks=2),
                     torch.float32, -4, True),  # per-token groups: any crop is at a group boundary
    # block_size 1 with channel scales over 8-token groups: a crop inside a group reopens it (found by the fuzzer:
    # exact_crop took any codec with block_size - 1 == 0 kept deltas for lossless png)
    "token-channel-int4": (dict(block_size=1, quant_bits=4, scale_axis="channel", group=8, sinks=2),
                           torch.bfloat16, -8, False),
}


@pytest.mark.parametrize("name", list(ROLLBACKS))
def test_crop_then_reappend_is_a_bitwise_rollback_or_is_refused(name):
    """crop="exact": every crop is a bitwise rollback, or raises and changes nothing (is_croppable says which)."""
    options, dtype, crop, exact = ROLLBACKS[name]
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, H, 48, D, generator=gen).to(dtype) for _ in range(2))
    caches = [fx.FlashCodecCache(num_layers=1, materialization_free=False, crop="exact", **options) for _ in range(2)]
    for cache in caches:
        cache.update(k, v, 0)
    plain, rolled = caches
    layer = rolled.layers[0]
    assert not layer.keys_stream.raw_prefix  # past the raw prefix: the codec's state is what crops
    per_token = options.get("block_size") == 1 and options.get("scale_axis", "token") == "token"
    assert rolled.is_croppable == ((options.get("mode") == "png" and dtype == torch.bfloat16) or per_token)
    if not exact:
        before = snapshot(layer)
        with pytest.raises(ValueError, match="would reopen archived tokens"):
            rolled.crop(crop)
        assert same(snapshot(layer), before)  # refused: nothing changed
        return
    rolled.crop(crop)
    rolled.update(k[:, :, 48 + crop:], v[:, :, 48 + crop:], 0)
    assert same(snapshot(plain.layers[0]), snapshot(layer))  # every tensor of the state, bitwise
    assert torch.equal(plain.layers[0].keys, layer.keys) and torch.equal(plain.layers[0].values, layer.values)


@pytest.mark.parametrize("name", list(ROLLBACKS))
def test_the_default_crop_mode_crops_every_tier_at_any_depth(name):
    """issue 32: the default crop="decode" reopens an archived group with the values attention read, so every tier is
    croppable; the kept positions read as before the crop, and where crop="exact" rolls back bitwise so does it."""
    options, dtype, crop, exact = ROLLBACKS[name]
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, H, 48, D, generator=gen).to(dtype) for _ in range(2))
    plain, rolled = (fx.FlashCodecCache(num_layers=1, materialization_free=False, **options) for _ in range(2))
    for cache in (plain, rolled):
        cache.update(k, v, 0)
    assert rolled.is_croppable
    kept = [view[:, :, : 48 + crop].clone() for view in (rolled.layers[0].keys, rolled.layers[0].values)]
    rolled.crop(crop)
    assert rolled.get_seq_length() == 48 + crop
    assert torch.equal(rolled.layers[0].keys, kept[0]) and torch.equal(rolled.layers[0].values, kept[1])
    rolled.update(k[:, :, 48 + crop:], v[:, :, 48 + crop:], 0)
    if exact:
        assert same(snapshot(plain.layers[0]), snapshot(rolled.layers[0]))
    elif options.get("mode") == "png":  # fp32 deltas: the reopened rows within fp rounding of the tokens given
        torch.testing.assert_close(rolled.layers[0].keys, plain.layers[0].keys, rtol=1e-6, atol=1e-6)


def test_assisted_decoding_needs_a_croppable_cache():
    """transformers checks is_croppable before its first crop: a lossy block tier with crop="exact" is refused there;
    the default crop="decode" runs (the reopened tokens come back as attention read them)."""
    model, assistant = tiny_model("llama"), fresh_tiny_model("llama", seed=1)
    ids = tiny_prompt(1, 12)
    kw = dict(max_new_tokens=6, do_sample=False, assistant_model=assistant)
    blocks = dict(mode="jpeg", block_size=8, quant_bits=8, materialization_free=False)  # 8-token groups: lossy crops
    exact = fx.FlashCodecCache.from_config(model.config, **blocks, crop="exact")
    with pytest.raises(ValueError, match="can be cropped|would reopen archived tokens"):  # 5.2x checks first
        model.generate(ids, **kw, **cache_kwargs(exact))
    decode = fx.FlashCodecCache.from_config(model.config, **blocks)
    assert decode.is_croppable
    assert model.generate(ids, **kw, **cache_kwargs(decode)).shape == (1, 18)


# 3. reset() kept the old batch shape: generate with batch 2, reset(), generate with batch 1 raised
def test_reset_lets_the_next_generate_bring_another_batch_size():
    model = tiny_model("llama")
    cache = fx.FlashCodecCache.from_config(model.config, mode="png", materialization_free=False)
    kw = dict(max_new_tokens=4, do_sample=False)
    model.generate(tiny_prompt(2, 12), **kw, **cache_kwargs(cache))
    cache.reset()
    assert cache.get_seq_length() == 0 and not cache.is_initialized
    alone = model.generate(tiny_prompt(1, 9, seed=5), **kw)
    assert torch.equal(model.generate(tiny_prompt(1, 9, seed=5), **kw, **cache_kwargs(cache)), alone)


# 4. layer.keys / layer.values were always None
def test_layer_keys_and_values_are_decoded_views():
    layer, native = _png_layer(), DynamicLayer()
    assert layer.keys is None and layer.values is None  # empty, as DynamicLayer before its first update
    for t, seed in ((13, 0), (1, 2), (5, 4)):
        k, v = _grid(t, seed), _grid(t, seed + 1)
        layer.update(k, v)
        native.update(k, v)
        assert torch.equal(layer.keys, native.keys) and torch.equal(layer.values, native.values)
    with pytest.raises(AttributeError, match="decoded view"):
        layer.keys = native.keys
    lossy = FlashCodecLayer(make_codec("jpeg", block_size=8, quant_bits=8), materialization_free=False)
    lossy.update(native.keys.float(), native.values.float())
    assert torch.equal(lossy.keys, lossy.read_view()[0])  # what attention reads, archive decoded


# 5. batch_size was -1 on the static layout, early_initialization a no-op
def test_static_batch_size_and_early_initialization_match_static_cache():
    config = tiny_config("llama")
    codec = fx.FlashCodecCache.from_config(config, mode="png", layout="static", max_cache_len=20)
    native = StaticCache(config=config, max_cache_len=20)
    assert not hasattr(codec.layers[0], "batch_size") and codec.batch_size == native.batch_size == -1  # as lazy layers
    for cache in (codec, native):
        cache.early_initialization(batch_size=2, num_heads=2, head_dim=16, dtype=torch.bfloat16, device="cpu")
        assert cache.is_initialized and cache.batch_size == 2 and int(cache.get_seq_length()) == 0
    k, v = _grid(7, 0, batch=2), _grid(7, 1, batch=2)
    out_k, _ = codec.update(k, v, 0)
    assert torch.equal(out_k[:, :, :7], k) and not out_k[:, :, 7:].any()  # still the exact prefill
    assert codec.layers[0].keys.shape == (2, H, 7, D)


# 6. static overflow raised ValueError where StaticCache's callers expect IndexError
def test_static_overflow_is_an_index_error_and_changes_nothing():
    layer = _png_layer(layout="static", max_cache_len=16)
    layer.update(_grid(13, 0), _grid(13, 1))
    before = snapshot(layer)
    with pytest.raises(CodecOverflowError, match="max_length=16") as err:
        layer.update(_grid(4, 2), _grid(4, 3))
    assert isinstance(err.value, IndexError) and isinstance(err.value, ValueError)
    assert same(snapshot(layer), before)


# 7. the materialization-free hand-off fell back silently to attention over one token when the attention function
#    did not receive the key tensor it expected
class _Attention(torch.nn.Module):
    num_key_value_groups, is_causal, layer_idx = 2, True, 0


def test_a_hand_off_the_attention_never_received_raises():
    cache = fx.FlashCodecCache(num_layers=1, mode="png")
    module, k, v = _Attention(), _grid(12, 0, batch=1, dtype=torch.float32), _grid(12, 1, batch=1, dtype=torch.float32)
    q = _grid(12, 2, batch=1, dtype=torch.float32).repeat(1, 2, 1, 1)
    key, value = cache.update(k, v, 0)
    flashcodec_attention_forward(module, q, key, value, None, scaling=0.25)  # the prefill, as the model runs it
    key, value = cache.update(k[:, :, :1], v[:, :, :1], 0)
    with pytest.raises(RuntimeError, match="did not receive the keys its cache layer handed out"):  # K changed
        flashcodec_attention_forward(module, q[:, :, :1], key.clone(), value.clone(), None, scaling=0.25)
    with pytest.raises(RuntimeError, match="did not receive the keys"):  # and the cache refuses to go on
        cache.update(k[:, :, 1:2], v[:, :, 1:2], 0)
    cache.reset()  # forgets the step: attention without a pending step attends as before (layers without a codec)
    out, _ = flashcodec_attention_forward(_Attention(), q[:, :, :1], k[:, :, :1], v[:, :, :1], None, scaling=0.25)
    assert out.shape == (1, 1, 4, D)


# 8. input checks
@pytest.mark.parametrize("block_size", ["8", 8.0, True])
def test_block_size_of_a_wrong_type_is_a_type_error(block_size):
    with pytest.raises(TypeError, match="block_size must be an int"):
        make_codec("jpeg", block_size=block_size)
    with pytest.raises(TypeError, match="block_size must be an int"):
        fx.FlashCodecCache(num_layers=1, block_size=block_size)


def test_keys_and_values_with_different_head_dims():
    """The engine's attention reads keys and values with the queries' head dim: it refuses them at append. A layer
    attending on the decoded view stores them (as DynamicLayer); attention on the stored form refuses them."""
    k, v = _grid(12, 0, head_dim=64), _grid(12, 1, head_dim=32)
    engine = CodecKVCache(mode="jpeg", block_size=8, quant_bits=8)
    with pytest.raises(ValueError, match="keys have 64, values 32"):
        engine.append(k.float(), v.float())
    assert not engine.keys.is_initialized and not engine.values.is_initialized
    stored_form = FlashCodecLayer(make_codec("png", block_size=8))
    with pytest.raises(ValueError, match="keys have head_dim 64 and values 32.*materialization_free=False"):
        stored_form.update(k, v)
    layer, native = _png_layer(), DynamicLayer()
    for t, seed in ((12, 0), (1, 2), (6, 4)):
        k, v = _grid(t, seed, head_dim=64), _grid(t, seed + 1, head_dim=32)
        layer.update(k, v)
        native.update(k, v)
    assert torch.equal(layer.keys, native.keys) and torch.equal(layer.values, native.values)


def test_quantized_cache_implementation_on_a_patched_model_is_a_value_error(monkeypatch):
    """The documented ValueError comes before transformers builds its QuantizedCache (which raises ImportError where
    optimum-quanto is not installed: simulated here, as this venv has it for the peer benchmarks)."""
    from transformers.generation import utils

    def no_quanto(*args, **kwargs):
        raise ImportError("optimum-quanto is not installed (simulated)")

    monkeypatch.setattr(utils, "QuantizedCache", no_quanto)
    model = fresh_tiny_model("llama")
    fx.apply_flash_codec(model)
    try:
        with pytest.raises(ValueError, match="cache_implementation='quantized'"):
            model.generate(tiny_prompt(1, 6), max_new_tokens=2, cache_implementation="quantized")
    finally:
        fx.remove_flash_codec(model)


@pytest.mark.parametrize("layout", ["dynamic", "static"])
def test_crop_past_the_start_empties_the_layer_as_dynamic_layer_does(layout):
    layer, native = _png_layer(layout=layout, max_cache_len=32 if layout == "static" else None), DynamicLayer()
    k, v = _grid(13, 0), _grid(13, 1)
    layer.update(k, v)
    native.update(k, v)
    layer.crop(-20)
    native.crop(-20)
    assert int(layer.get_seq_length()) == native.get_seq_length() == 0
    assert layer.keys.shape == native.keys.shape == (B, H, 0, D)
    layer.update(k[:, :, :5], v[:, :, :5])  # and it fills again from position 0
    assert torch.equal(layer.keys, k[:, :, :5])


def test_crop_takes_a_one_element_integer_tensor_as_transformers_5_17_passes():
    """transformers 5.17's assisted decoding crops with a 0-dim tensor (DynamicLayer takes it); anything but an int or
    a one-element integer tensor is a TypeError that changes nothing."""
    caches = [fx.FlashCodecCache(num_layers=1, mode="png", materialization_free=False) for _ in range(2)]
    k, v = _grid(13, 0), _grid(13, 1)
    for cache in caches:
        cache.update(k, v, 0)
    caches[0].crop(-3)
    caches[1].crop(torch.tensor(-3))
    assert same(snapshot(caches[0]), snapshot(caches[1]))
    before = snapshot(caches[1])
    for bad in (torch.tensor(-3.0), torch.tensor([-1, -2]), torch.tensor(True), -3.0):
        with pytest.raises(TypeError, match="tokens_to_remove must be an int"):
            caches[1].crop(bad)
    assert same(snapshot(caches[1]), before)
