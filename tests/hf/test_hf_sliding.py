"""Sliding-window layers as codec rings (Gemma-3 style: sliding and full layers), dynamic layout."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import cache_kwargs, fresh_tiny_model, output_cache, tiny_prompt  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.cache import CodecStream  # noqa: E402
from flashcodec_fx.codecs import make_codec  # noqa: E402
from flashcodec_fx.hf.sliding_layer import FlashCodecSlidingLayer  # noqa: E402

WINDOW = 12  # conftest's tiny gemma3
LOSSY = dict(key_options={"mode": "jpeg", "block_size": 8, "quant_bits": 4, "scale_axis": "channel", "group": 8},
             value_options={"mode": "jpeg", "block_size": 1, "quant_bits": 4, "levels": "lloyd", "rotate": True,
                            "window": 4})
# The two routes' float arithmetic differs in the last bits; rows kept raw in bf16 (an fp32 stream's default) would
# round such a difference up to a bf16 step and carry it on: the routes are compared with rows stored as computed.
SAME_ROWS = {**LOSSY, "value_options": {**LOSSY["value_options"], "raw_dtype": "stream"}}


@pytest.fixture(scope="module")
def gemma():
    return fresh_tiny_model("gemma3")


def _generate(model, ids, new, **kwargs):
    return model.generate(ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True, **kwargs)


def _sliding(cache) -> list[FlashCodecSlidingLayer]:
    return [layer for layer in cache.layers if isinstance(layer, FlashCodecSlidingLayer)]


def test_png_ring_generates_the_tokens_of_the_native_cache(gemma):
    ids = tiny_prompt(2, 10)
    reference = _generate(gemma, ids, 40).sequences
    fx.apply_flash_codec(gemma, mode="png", strict=True)  # strict: every decode step on the stored form, no fallback
    try:
        out = _generate(gemma, ids, 40)
    finally:
        fx.remove_flash_codec(gemma)
    assert torch.equal(out.sequences, reference)
    cache = output_cache(out)
    rings = _sliding(cache)
    assert len(rings) == 2 and all(layer.dropped > 0 for layer in rings)
    for layer in rings:  # held: at most the window, one drop unit and the codec's tail
        held = layer.keys_stream.get_seq_length()
        assert held <= WINDOW + layer._unit + layer.keys_stream.codec.tail_capacity
        assert layer.get_seq_length() == 10 + 40 - 1


@pytest.mark.parametrize("preset", ["lossless", "int8", "4bit"])
def test_left_padding_longer_than_the_window_keeps_the_padded_row(gemma, preset):
    """A row left-padded by more than the window: its new tokens are stored as given once the ring has dropped
    positions (the padding mask is indexed by absolute position, not by the ring's length). ``lossless`` gives the
    native padded batch's tokens; a lossy preset attends on codes that match its own decoded view."""
    pad = 3 * WINDOW
    ids = tiny_prompt(2, 50, seed=7)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    kwargs = dict(attention_mask=mask, pad_token_id=0)
    reference = _generate(gemma, ids, 30, **kwargs).sequences
    fx.apply_flash_codec(gemma, preset=preset, strict=True)
    try:
        out = _generate(gemma, ids, 30, **kwargs)
    finally:
        fx.remove_flash_codec(gemma)
    rings = _sliding(output_cache(out))
    # the rings hold fewer positions than the padding: their lengths are no positions of the padding mask
    assert rings and all(layer.dropped > 0 and layer.keys_stream.get_seq_length() < pad for layer in rings)
    for layer in rings:  # the padded row's newest keys were stored, not zeroed
        newest = layer.keys_stream.read()[1, :, -4:]
        assert newest.abs().amax() > 0
    if preset == "lossless":
        assert torch.equal(out.sequences, reference)


def test_lossy_ring_stored_form_equals_its_decoded_view(gemma):
    """Both routes read the same stored tokens, and the call's own tokens exactly (the view without a memo)."""
    ids = tiny_prompt(1, 9, seed=3)
    outs = []
    for free in (True, False):
        fx.apply_flash_codec(gemma, materialization_free=free, strict=free, memoize=False, **SAME_ROWS)
        try:
            outs.append(_generate(gemma, ids, 36, output_scores=True))
        finally:
            fx.remove_flash_codec(gemma)
    stored, view = outs
    assert torch.equal(stored.sequences, view.sequences)
    torch.testing.assert_close(torch.stack(stored.scores), torch.stack(view.scores), rtol=1e-4, atol=1e-4)


def test_ring_storage_is_bounded_by_the_window(gemma):
    cache = fx.FlashCodecCache.from_config(gemma.config, **LOSSY)
    ids = tiny_prompt(1, 8, seed=5)
    fx.apply_flash_codec(gemma, **LOSSY)  # the kvcodec attention; the cache is ours
    try:
        sizes = []
        with torch.no_grad():
            out = gemma(ids, use_cache=True, **cache_kwargs(cache))
            for step in range(56):
                out = gemma(out.logits[:, -1:].argmax(-1), use_cache=True, **cache_kwargs(cache))
                if step >= 24:
                    sizes.append([layer.storage_breakdown()["stored"] for layer in _sliding(cache)])
    finally:
        fx.remove_flash_codec(gemma)
    assert max(map(max, sizes)) <= 2 * min(map(min, sizes))  # flat: a ring, not a growing archive
    full = [cache.layers[i] for i in cache.codec_layers if not cache.layers[i].is_sliding]
    assert all(layer.keys_stream.get_seq_length() == 8 + 56 for layer in full)


def test_crop_inside_the_ring_and_past_it():
    layer = FlashCodecSlidingLayer(make_codec("png", block_size=4), sliding_window=6)
    torch.manual_seed(0)
    k = torch.randn(1, 2, 30, 8)
    for t in range(30):
        layer.get_mask_sizes(1)
        layer.update(k[:, :, t:t + 1], k[:, :, t:t + 1])
    assert layer.dropped > 0 and layer.get_seq_length() == 30
    kv_length, kv_offset = layer.get_mask_sizes(1)
    assert kv_offset == layer.dropped and kv_length == 30 - layer.dropped + 1
    before = layer.keys.clone()
    with pytest.raises(ValueError, match="has dropped positions"):
        layer.crop(layer.dropped - 1)
    assert torch.equal(layer.keys, before) and layer.get_seq_length() == 30
    layer.crop(-2)
    assert layer.get_seq_length() == 28
    torch.testing.assert_close(layer.keys, k[:, :, layer.dropped:28], rtol=0, atol=1e-6)


def test_sliding_layer_rejects_what_it_cannot_hold():
    with pytest.raises(ValueError, match="without sinks"):
        FlashCodecSlidingLayer(make_codec("png", block_size=4, sinks=2), sliding_window=6)
    with pytest.raises(ValueError, match="layout='dynamic'"):
        FlashCodecSlidingLayer(make_codec("png", block_size=4), sliding_window=6, layout="static", max_cache_len=8)
    with pytest.raises(ValueError, match="sliding_window"):
        FlashCodecSlidingLayer(make_codec("png", block_size=4), sliding_window=0)
    stream = CodecStream(make_codec("png", block_size=4))
    stream.append(torch.randn(1, 1, 10, 8))
    with pytest.raises(ValueError, match="multiple of the group 4"):
        stream.drop_front(2)
    with pytest.raises(ValueError, match="archived tokens"):
        stream.drop_front(12)
    with pytest.raises(ValueError, match="without sinks"):
        CodecStream(make_codec("png", block_size=4, sinks=1)).drop_front(4)
