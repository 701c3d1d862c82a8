"""FlashCodecLayer / FlashCodecCache layer contract on random (B, H, T, D) states, plus crop on a tiny model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from conftest import cache_kwargs, tiny_model, tiny_prompt  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.codecs import make_codec  # noqa: E402
from flashcodec_fx.hf import FlashCodecLayer  # noqa: E402
from flashcodec_fx.hf.attention import take  # noqa: E402
from flashcodec_fx.hf.handoff import current_table  # noqa: E402

B, H, D = 3, 2, 16


def _states(t: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, t, D, generator=gen).to(dtype), torch.randn(B, H, t, D, generator=gen).to(dtype))


def _layer(mode="jpeg", layout="dynamic", max_cache_len=None, view=True, crop="decode", **codec):
    """A layer attending on the decoded view (``view=True``, the materialized path) or on the stored form."""
    kc = make_codec(mode, block_size=8, **codec)
    return FlashCodecLayer(kc, kc, layout=layout, max_cache_len=max_cache_len, materialization_free=not view, crop=crop)


def _filled(layer, prompt=13, steps=8, seed=0, dtype=torch.float32):
    """Prefill ``prompt`` tokens then ``steps`` single-token updates; returns every appended (k, v)."""
    ks, vs = _states(prompt + steps, seed, dtype)
    layer.update(ks[:, :, :prompt], vs[:, :, :prompt])
    for i in range(prompt, prompt + steps):
        layer.update(ks[:, :, i: i + 1], vs[:, :, i: i + 1])
    return ks, vs


class _Attention(torch.nn.Module):
    num_key_value_groups, is_causal = 1, True

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx


def test_stored_form_layer_hands_attention_its_step():
    """Default layers return the call's exact states and hand the attention call an AttentionStep (those tensors, the
    stored form after the append) in their table at their index; the attention of that layer index takes it."""
    layer = _layer(view=False, quant_bits=8)
    table = layer._steps
    k, v = _states(13, 0)
    out_k, out_v = layer.update(k, v)
    handed = table.get(0)
    assert out_k is k and out_v is v and handed.key is k and handed.value is v and not handed.decode
    assert current_table() is table and not layer.attention_bound
    assert layer.keys_stream.memo is None  # nothing but the stored form is kept
    assert take(_Attention(1), k.clone(), v) is None and table.get(0) is handed  # another layer's tensors: not its step
    assert take(_Attention(0), k.clone(), v) is None and not layer.attention_bound  # a prompt step with other keys stays
    assert take(_Attention(0), k, v.clone()) is None and not layer.attention_bound  # or other values
    assert take(_Attention(0), k, v) is handed and layer.attention_bound and table.get(0) is None
    nk, nv = _states(1, 1)
    out_k, _ = layer.update(nk, nv)
    handed = table.get(0)
    assert out_k is nk and handed.decode and layer.handed_out and layer.attention_bound  # served before: still bound
    state, spec = layer.keys_stream.op_state()
    assert handed.keys.spec == spec and all(a is b for a, b in zip(handed.keys.state, state, strict=True))
    with pytest.raises(RuntimeError, match="did not receive the keys"):
        layer.update(nk, nv)  # nobody took the last hand-off: a wrong answer would follow, so it raises
    layer.reset()
    assert table.get(0) is None and not layer.handed_out and not layer.attention_bound  # a reset forgets it


def test_a_step_left_behind_is_not_owed_to_another_caches_keys():
    """A decode step nobody took (the forward stopped between update and attention) does not make a later model on
    another cache in this context fail: its attention calls bring keys of another shape (the whole history), so the
    step is not theirs; keys of the step's shape at the step's layer (a model changing K/V after update) still raise,
    and the layer's own next update reports the step untaken."""
    layer = _layer(view=False, quant_bits=8)
    layer.update(*_states(13, 0))
    step = layer._steps.get(0)
    assert take(_Attention(0), step.key, step.value) is not None
    nk, nv = _states(1, 1)
    layer.update(nk, nv)  # a decode step, never taken
    with pytest.raises(RuntimeError, match="did not receive the keys"):
        take(_Attention(0), nk.clone(), nv)  # its own attention call, with changed keys of its shape
    other_cache_keys = torch.cat([_states(13, 2)[0], nk], 2)  # a DynamicCache's view: 14 positions
    for idx in (0, 1, 0):
        assert take(_Attention(idx), other_cache_keys, other_cache_keys) is None
    with pytest.raises(RuntimeError, match="did not receive the keys"):
        layer.update(nk, nv)


def test_a_cache_seats_each_layer_at_its_index():
    """Layers of a FlashCodecCache hand their steps to the cache's table at the index the model passes to update; the
    attention of each module takes its own layer's step, whatever the order."""
    cache = fx.FlashCodecCache(num_layers=2, mode="png")
    k, v = _states(13, 0)
    for idx in (0, 1):
        cache.update(k, v, idx)
    steps = [cache.step_table.get(idx) for idx in (0, 1)]
    assert current_table() is cache.step_table and steps[0] is not steps[1] and all(s.key is k for s in steps)
    assert take(_Attention(1), k, v) is steps[1] and take(_Attention(0), k, v) is steps[0]
    assert all(cache.layers[idx].attention_bound for idx in (0, 1))
    other = fx.FlashCodecCache(num_layers=2, mode="png")  # another cache: its own table, its own steps
    other.update(k, v, 1)
    assert current_table() is other.step_table and other.step_table.get(1).key is k
    assert cache.step_table.get(1) is None and not other.layers[1].attention_bound


def test_a_cache_index_other_than_the_modules_takes_the_step_of_its_very_tensors():
    """A model passing update another index than its attention module's layer_idx (a cache offset, a shared block)
    takes the step handed last when its attention receives the very tensors the update returned; a later call that
    receives a taken decode step's tensors again (KV sharing) reads the same stored form, its tokens appended."""
    cache = fx.FlashCodecCache(num_layers=2, preset="int8")
    k, v = _states(13, 0)
    cache.update(k, v, 1)  # the module is layer 0, the cache index 1
    assert take(_Attention(0), k, v).key is k and cache.step_table.get(1) is None and cache.layers[1].attention_bound
    nk, nv = _states(1, 1)
    cache.update(nk, nv, 1)
    step = take(_Attention(0), nk, nv)
    assert step.decode and step.pending and cache.step_table.kept[1] is step
    step.append_now()  # what the attention call does with a pending step
    again = take(_Attention(3), nk, nv)  # a layer sharing these K/V
    assert again.keys is step.keys and not again.pending
    assert take(_Attention(3), nk.clone(), nv) is None
    cache.update(*_states(1, 2), 1)
    assert 1 not in cache.step_table.kept  # the layer's next step replaces it


def test_a_cache_index_other_than_the_modules_falls_back_to_the_view_loudly():
    """A model passing update another index than its attention module's layer_idx whose attention receives other
    tensors never reads another layer's step: its prompt attends exactly, the step stays untaken, and the layer's next
    update warns and switches to the decoded view (strict=True raises)."""
    k, v = _states(13, 0)
    for strict in (False, True):
        cache = fx.FlashCodecCache(num_layers=2, mode="png", strict=strict)
        cache.update(k, v, 1)  # the module is layer 0, the cache index 1
        assert take(_Attention(0), k.clone(), v) is None and cache.step_table.get(1) is not None
        nk, nv = _states(1, 1)
        if strict:
            with pytest.raises(RuntimeError, match="does not use the 'kvcodec' attention"):
                cache.update(nk, nv, 1)
            continue
        with pytest.warns(fx.MaterializationFreeFallback, match="does not use the 'kvcodec' attention"):
            out_k, _ = cache.update(nk, nv, 1)
        assert out_k.shape[2] == 14 and cache.step_table.get(1) is None and not cache.layers[1].materialization_free


def test_prefill_returns_exact_states_then_the_stored_view():
    layer = _layer(keep_freqs=4)
    k, v = _states(29, 0)  # past the raw prefix (a 13-token prompt would be held raw, its view exact)
    out_k, out_v = layer.update(k, v)
    assert out_k is k and out_v is v  # the prompt attends on its exact states
    nk, nv = _states(1, 1)
    view_k, view_v = layer.update(nk, nv)
    assert view_k.shape == (B, H, 30, D) and layer.get_seq_length() == 30 and layer.get_mask_sizes(1) == (31, 0)
    assert torch.equal(view_k[:, :, 24:29], k[:, :, 24:]) and torch.equal(view_k[:, :, 29:], nk)  # open block: raw
    assert not torch.allclose(view_k[:, :, :8], k[:, :, :8], atol=1e-3)  # the archive is what later steps read (lossy)


def test_png_view_is_bitwise_exact_in_bf16():
    layer = _layer("png")
    ks, vs = _filled(layer, dtype=torch.bfloat16)
    view_k, view_v = layer.read_view()
    assert torch.equal(view_k, ks) and torch.equal(view_v, vs)


def test_static_layout_pads_to_capacity_and_keeps_a_device_length():
    layer = _layer("png", layout="static", max_cache_len=20)
    assert layer.is_compileable and layer.get_max_length() == 20 and layer.get_mask_sizes(1) == (24, 0)
    k, v = _states(13, 0)
    out_k, _ = layer.update(k, v)
    assert out_k.shape == (B, H, 24, D) and torch.equal(out_k[:, :, :13], k) and not out_k[:, :, 13:].any()
    length = layer.get_seq_length()
    assert isinstance(length, torch.Tensor) and int(length) == 13
    view_k, _ = layer.update(*_states(1, 1))
    assert view_k.shape == (B, H, 24, D) and int(layer.get_seq_length()) == 14
    with pytest.raises(IndexError, match="max_length=20"):  # as transformers' StaticCache (and a ValueError)
        layer.update(*_states(7, 2))


@pytest.mark.parametrize("layout", ["dynamic", "static"])
def test_crop_gives_back_exactly_the_prefix_of_the_view(layout):
    layer = _layer(keep_freqs=4, quant_bits=8, layout=layout, max_cache_len=32 if layout == "static" else None,
                   crop="decode")
    _filled(layer)
    before_k, before_v = (t.clone() for t in layer.read_view())
    layer.crop(0)
    assert int(layer.get_seq_length()) == 21
    layer.crop(-6)  # cuts into an archived block (8..15)
    after_k, after_v = layer.read_view()
    assert int(layer.get_seq_length()) == 15
    assert torch.equal(after_k[:, :, :15], before_k[:, :, :15]) and torch.equal(after_v[:, :, :15], before_v[:, :, :15])
    layer.crop(-16)  # past the start: empty, as DynamicLayer
    assert int(layer.get_seq_length()) == 0 and layer.keys.shape[2] == 0


def test_a_lossy_block_layer_is_croppable_unless_exact_crops_are_asked_for():
    exact, decode = _layer(quant_bits=8, crop="exact"), _layer(quant_bits=8)  # the default reopens groups
    png = _layer("png", crop="exact")
    for layer in (exact, decode, png):
        _filled(layer, prompt=29, dtype=torch.bfloat16)  # past the raw prefix: 4 archived groups, 5 tail tokens
    assert not exact.is_croppable and decode.is_croppable and png.is_croppable  # bf16 png reopens exactly
    exact.crop(-5)  # inside the raw tail: allowed and exact
    with pytest.raises(ValueError, match="reopen archived tokens"):
        exact.crop(-3)
    decode.crop(-8)
    assert decode.get_seq_length() == 29


def test_beam_reorder_and_batch_ops_move_every_tensor_together():
    layer = _layer(keep_freqs=6, quant_bits=8)
    _filled(layer)
    before_k, before_v = (t.clone() for t in layer.read_view())
    scale = layer.keys_stream.state.scale.clone()
    beam_idx = torch.tensor([2, 0, 0])
    layer.reorder_cache(beam_idx)
    k, v = layer.read_view()
    assert torch.equal(k, before_k[beam_idx]) and torch.equal(v, before_v[beam_idx])
    assert torch.equal(layer.keys_stream.state.scale, scale[beam_idx])
    nk, nv = _states(2, 5)  # the reordered raw tail keeps receiving each row's tokens
    layer.update(nk, nv)
    assert torch.equal(layer.read_view()[0][:, :, 16:], torch.cat([before_k[beam_idx][:, :, 16:], nk], dim=2))
    layer.batch_select_indices(torch.tensor([1, 2]))
    layer.batch_repeat_interleave(2)
    k2, _ = layer.read_view()
    assert k2.shape[0] == 4 and torch.equal(k2[:, :, :21], before_k[[0, 0, 0, 0]])


def test_reset_forgets_tokens_and_prefill_is_exact_again():
    layer = _layer()
    _filled(layer)
    layer.reset()
    assert layer.get_seq_length() == 0
    k, v = _states(5, 9)
    assert layer.update(k, v)[0] is k and layer.get_seq_length() == 5


@pytest.mark.parametrize("view", [True, False])
def test_storage_counts_every_part(view):
    cache = fx.FlashCodecCache(num_layers=2, mode="jpeg", quant_bits=8, materialization_free=not view)
    for idx in range(2):
        ks, vs = _states(21, idx)
        cache.update(ks, vs, idx)
    total = cache.storage_breakdown()
    parts = ("archive", "scales", "sinks", "tail", "mean", "memo", "native")
    assert cache.storage_bytes() == total["total"] == sum(total[p] for p in parts) and total["native"] == 0
    assert (total["memo"] > 0) == view  # the stored-form path keeps no decoded view
    assert total["raw_equivalent"] == 2 * 2 * B * H * 21 * D * 4
    assert 0 < total["archive_used"] < total["raw_equivalent"]
    assert type(cache.storage_bytes()) is int
    assert cache.storage_bytes() == sum(cache.layers[i].storage_bytes() for i in range(2))
    per_layer = cache.storage_breakdown(per_layer=True)
    assert sorted(per_layer) == [0, 1] and sum(r["total"] for r in per_layer.values()) == total["total"]
    # 16 tokens in full int8 groups (8 + 16 * 8 / 16 bits at D=16), 5 raw fp32 tokens
    assert cache.bits_per_value() == pytest.approx((16 * 9 + 5 * 32) / 21)


def test_padding_positions_are_stored_as_zeros():
    cache = fx.FlashCodecCache(num_layers=1, mode="png")
    mask = torch.ones(B, 13, dtype=torch.long)
    mask[1, :9] = 0
    cache.set_padding_mask(mask)
    k, v = _states(13, 0, torch.bfloat16)  # png is bitwise exact on bf16 states
    out_k, _ = cache.update(k, v, 0)
    assert torch.equal(out_k, k)  # the prompt's own attention is untouched (padding is masked there)
    view_k, view_v = cache.layers[0].read_view()
    assert not view_k[1, :, :9].any() and not view_v[1, :, :9].any()
    assert torch.equal(view_k[1, :, 9:], k[1, :, 9:]) and torch.equal(view_k[0], k[0])
    with pytest.raises(ValueError, match="attention_mask must be"):
        cache.set_padding_mask(torch.ones(13))


def test_crop_then_refeed_reproduces_the_logits_on_the_lossless_tier():
    model = tiny_model("llama")
    ids = tiny_prompt(1, 12)
    tokens = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(7))
    cache = fx.FlashCodecCache.from_config(model.config, mode="png")
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
        logits = [model(tokens[:, i: i + 1], **cache_kwargs(cache)).logits for i in range(10)]
        cache.crop(-5)
        assert cache.get_seq_length() == 17
        again = [model(tokens[:, i: i + 1], **cache_kwargs(cache)).logits for i in range(5, 10)]
    for first, second in zip(logits[5:], again, strict=True):
        torch.testing.assert_close(second, first, rtol=0, atol=1e-5)
