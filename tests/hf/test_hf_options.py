"""Option validation of FlashCodecCache / apply_flash_codec / compress_kv: errors name the option, nothing changes."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from conftest import tiny_config, tiny_model  # noqa: E402
from transformers.cache_utils import DynamicLayer, StaticLayer, StaticSlidingWindowLayer  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.codecs import JPEGCodec, PNGCodec  # noqa: E402
from flashcodec_fx.hf.sliding_layer import FlashCodecSlidingLayer  # noqa: E402


@pytest.mark.parametrize(("options", "message"), [
    (dict(mode="gif"), "mode must be one of"),
    (dict(block_size=0), "block_size"),
    (dict(keep_freqs=9), "keep_freqs"),
    (dict(quant_bits=9), "quant_bits"),
    (dict(quant_bits=(8, 8)), "one entry per kept frequency"),
    (dict(quant_bits=2, levels="fancy"), "levels must be one of"),
    (dict(quant_bits=2, scale_axis="row"), "scale_axis must be one of"),
    (dict(quant_bits=2, scale_axis="channel", group=12), "group must be a multiple"),
    (dict(quant_bits=None, levels="lloyd"), "set quant_bits too"),
    (dict(sinks=-1), "sinks must be >= 0"),
    (dict(preset="1bit"), "preset must be one of"),
    (dict(memoize=True), "memoize=True keeps a decoded view"),
    (dict(crop="lossy"), "crop must be one of"),
    (dict(mode="png", keep_ratio=0.0), "keep_ratio"),
    (dict(keep_ratio=0.5), "keep_ratio"),  # png option with the default jpeg mode
    (dict(mode="png", quant_bits=8), "quant_bits"),
    (dict(layout="paged"), "layout must be one of"),
    (dict(layout="static"), "max_cache_len"),
    (dict(max_cache_len=64), "max_cache_len applies to layout='static'"),
    (dict(strict=True, materialization_free=False), "strict=True only applies"),
    (dict(key_options={"bits": 8}), "key_options: unknown option"),
    (dict(value_options={"mode": "png", "quant_bits": 8}), r"value_options: unknown option\(s\) \['quant_bits'\]"),
    (dict(layout="static", max_cache_len=64, key_options={"sinks": 4}), "same sinks"),
    (dict(per_layer={-1: {}}), "per_layer keys"),
])
def test_bad_options_raise_value_error(options, message):
    with pytest.raises(ValueError, match=message):
        fx.FlashCodecCache(num_layers=2, **options)


@pytest.mark.parametrize(("options", "message"), [
    (dict(materialization_free="yes"), "materialization_free must be a bool"),
    (dict(per_layer=[{}]), "per_layer must be a dict"),
    (dict(per_layer={"1": {}}), r"per_layer keys must be layer indices \(int >= 0\), got str '1' "
                                r"\(per_layer=\{1: ...\}, not \{'1': ...\}\)"),
    (dict(per_layer={True: {}}), "per_layer keys must be layer indices .*got bool True"),
    (dict(per_layer={1.0: {}}), "per_layer keys must be layer indices .*got float"),
    (dict(layout=3), r"layout must be one of \('dynamic', 'static'\), got int 3"),
    (dict(crop=None), "crop must be one of"),
    (dict(mode=3), "mode must be one of"),
    (dict(layout="static", max_cache_len="64"), "max_cache_len must be an int, got str"),
])
def test_bad_types_raise_type_error(options, message):
    with pytest.raises(TypeError, match=message):
        fx.FlashCodecCache(num_layers=2, **options)


def test_a_model_config_passed_as_codecs_is_named():
    """``FlashCodecCache(model.config, preset=...)``: the config lands in ``codecs``; the error says what to call."""
    config = tiny_config("llama")
    for codecs, what in ((config, "a model config"), (tiny_model("llama"), "a model")):
        with pytest.raises(TypeError, match=rf"codecs \(FlashCodecCache's first positional argument\) .*got {what} "
                                            r"\((LlamaConfig|LlamaForCausalLM)\).*"
                                            r"FlashCodecCache.from_config\(model.config, preset=...\)"):
            fx.FlashCodecCache(codecs, preset="4bit")
    with pytest.raises(TypeError, match="codecs .* must be a CacheConfig, a preset name or a CacheConfig.spec string, "
                                        "got int"):
        fx.FlashCodecCache(3)


def test_the_other_arguments_of_the_wrong_type(tmp_path):
    for call in (lambda: fx.FlashCodecCache.from_config(None), lambda: fx.FlashCodecCache.from_config("llama"),
                 lambda: fx.FlashCodecCache(config={"model_type": "llama"})):
        with pytest.raises(TypeError, match=r"config must be .*a transformers PreTrainedConfig \(model.config\)"):
            call()
    with pytest.raises(TypeError, match="num_layers must be an int, got str"):
        fx.FlashCodecCache(num_layers="2")
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        fx.FlashCodecCache(num_layers=0)
    with pytest.raises(ValueError, match="layout='static' needs max_cache_len"):
        fx.FlashCodecCache(num_layers=2, layout="static")
    with pytest.raises(TypeError, match="sliding_window must be an int"):
        FlashCodecSlidingLayer(PNGCodec(sinks=0), sliding_window="12")
    cache = fx.FlashCodecCache(num_layers=2)
    with pytest.raises(TypeError, match="attention_mask must be a \\(B, P\\) tensor or None, got list"):
        cache.set_padding_mask([[1, 1]])
    with pytest.raises(TypeError, match="compression must be one of"):
        cache.save(tmp_path / "c.fc", compression=3, model_or_config=tiny_config("llama"))
    assert not any(tmp_path.iterdir())


def test_per_layer_checks_against_the_model():
    with pytest.raises(ValueError, match="out of range"):
        fx.FlashCodecCache.from_config(tiny_config("llama"), per_layer={5: {}})
    with pytest.raises(ValueError, match="'sliding_attention' layer; with layout='static'"):
        fx.FlashCodecCache.from_config(tiny_config("gemma3"), layout="static", max_cache_len=20,
                                       per_layer={0: {"mode": "png"}})
    with pytest.raises(ValueError, match="'linear_attention' layer"):
        fx.FlashCodecCache.from_config(tiny_config("hybrid"), per_layer={0: {"mode": "png"}})
    with pytest.raises(ValueError, match=r"per_layer\[1\]: unknown option"):
        fx.FlashCodecCache.from_config(tiny_config("llama"), per_layer={1: {"keepfreqs": 2}})
    with pytest.raises(ValueError, match="per_layer needs the layer count"):
        fx.FlashCodecCache(per_layer={0: {}})


def test_per_layer_schedule_is_applied():
    cache = fx.FlashCodecCache.from_config(
        tiny_config("llama"), mode="jpeg", quant_bits=8, value_options={"keep_freqs": 6},
        per_layer={0: {"mode": "png", "keep_ratio": 0.5}, 1: {"keep_freqs": 4, "key_options": {"quant_bits": None}}})
    first, second = cache.layers
    assert isinstance(first.keys_stream.codec, PNGCodec) and first.keys_stream.codec.keep_ratio == 0.5
    assert isinstance(first.values_stream.codec, PNGCodec)  # a per-layer mode starts afresh: no jpeg value option
    k, v = second.keys_stream.codec, second.values_stream.codec
    assert isinstance(k, JPEGCodec) and (k.keep_freqs, k.quant_bits) == (4, 0)
    assert isinstance(v, JPEGCodec) and (v.keep_freqs, v.quant_bits) == (4, 8)  # a layer's shared option: both streams
    native = fx.FlashCodecCache.from_config(tiny_config("llama"), per_layer={0: None})
    assert native.codec_layers == [1] and type(native.layers[0]) is DynamicLayer


def test_from_config_keeps_native_layers_on_hybrid_models():
    gemma = fx.FlashCodecCache.from_config(tiny_config("gemma3"), mode="png", sinks=4)
    assert gemma.codec_layers == [0, 1, 2, 3]  # dynamic: sliding layers are codec rings, without sinks
    assert all(type(gemma.layers[i]) is FlashCodecSlidingLayer and gemma.layers[i].sliding_window == 12 for i in (0, 2))
    assert gemma.layers[0].keys_stream.codec.sinks == 0 and gemma.layers[1].keys_stream.codec.sinks == 4
    static_gemma = fx.FlashCodecCache.from_config(tiny_config("gemma3"), mode="png", layout="static", max_cache_len=20)
    assert static_gemma.codec_layers == [1, 3]
    assert all(type(static_gemma.layers[i]) is StaticSlidingWindowLayer for i in (0, 2))
    static = fx.FlashCodecCache.from_config(tiny_config("llama"), layout="static", max_cache_len=20, per_layer={1: None})
    assert static.codec_layers == [0] and type(static.layers[1]) is StaticLayer and static.is_compileable


def test_apply_validates_before_patching():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="unknown option"):
        fx.apply_flash_codec(model, mode="png", quality=3)
    with pytest.raises(ValueError, match="out of range"):
        fx.apply_flash_codec(model, per_layer={7: {}})
    assert "_prepare_cache_for_generation" not in vars(model)
    with pytest.raises(ValueError, match="not patched"):
        fx.remove_flash_codec(model)
    with pytest.raises(ValueError, match="keep_ratio"):
        fx.compress_kv(keep_ratio=0.5)
