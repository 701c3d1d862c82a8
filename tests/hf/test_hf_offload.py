"""Offloading (issue 11): ``FlashCodecCache(offloading=True)`` and the hot patch's ``"offloaded"`` /
``"offloaded_static"`` move a codec layer's stored form (filled archive groups, scales, raw sinks and tail, mean,
lengths), never a decoded view. On CPU the device and the host are one: the moves still copy, and their bytes are
counted here (the CUDA path runs in benchmarks/gpu_check.sh through benchmarks/bench_offload.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from conftest import cache_kwargs, fresh_tiny_model, output_cache, tiny_model, tiny_prompt  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from transformers.cache_utils import DynamicLayer  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.hf import apply_codec_attention, remove_codec_attention  # noqa: E402
from flashcodec_fx.hf.attention import flashcodec_attention_forward  # noqa: E402


class TransferCounter(TorchFunctionMode):
    """Bytes handed to ``Tensor.to(device)`` and ``Tensor.copy_`` while active (inside offload / prefetch every such
    call is a device-host transfer)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and ("device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])):
            self.bytes += args[0].nbytes
        elif func is torch.Tensor.copy_:
            self.bytes += args[1].nbytes
        return func(*args, **kwargs)


def moved_bytes(move) -> int:
    with TransferCounter() as counter:
        move()
    return counter.bytes


def _states(t: int, seed: int, heads: int = 3, head_dim: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, t, head_dim, generator=gen).to(torch.bfloat16) for _ in range(2))


@pytest.mark.parametrize("preset", ["lossless", "int8", "3bit"])
def test_offload_moves_the_stored_form_not_a_view(preset):
    k, v = _states(300, 0)
    cache = fx.FlashCodecCache(num_layers=1, preset=preset, materialization_free=False, memoize=False)
    twin = fx.FlashCodecCache(num_layers=1, preset=preset, materialization_free=False, memoize=False)
    for c in (cache, twin):
        c.update(k, v, 0)
    layer = cache.layers[0]
    parts, views = layer.storage_breakdown(), (layer.keys, layer.values)
    stored_form = parts["archive_used"] + parts["sinks"] + parts["tail"] + parts["mean"] + parts["norm"]

    assert moved_bytes(layer.offload) == stored_form  # filled groups only: the unused capacity stays behind
    streams = (layer.keys_stream, layer.values_stream)
    # zeros (allocated, not moved) for the positions of the raw tail: the views span the stored length
    assert all((s.covering_groups - s.filled_groups) * s.codec.group <= s.codec.tail_capacity for s in streams)
    spare = sum(t[:, :, s.filled_groups:].nbytes for s in streams for t in s.state[:4])
    assert layer.storage_bytes() == stored_form + spare
    assert torch.equal(layer.keys, views[0]) and torch.equal(layer.values, views[1])  # readable while offloaded
    native = DynamicLayer()
    native.update(k, v)
    native_bytes = moved_bytes(native.offload)
    assert native_bytes == k.nbytes + v.nbytes
    tail_rows = parts["tail"] + parts["sinks"]  # raw rows of the open group / window / sinks: full precision
    assert stored_form - tail_rows <= native_bytes * cache.bits_per_value() / 16

    assert moved_bytes(layer.prefetch) == stored_form
    assert layer.storage_bytes() == parts["total"]  # the archive's capacity again
    more_k, more_v = _states(40, 1)
    for c in (cache, twin):
        c.update(more_k, more_v, 0)
    assert torch.equal(layer.keys, twin.layers[0].keys) and torch.equal(layer.values, twin.layers[0].values)


def test_a_memo_moves_its_filled_positions():
    """A layer attending on the decoded view keeps it as a memo: that memo moves too (its stored positions)."""
    k, v = _states(50, 2)
    cache = fx.FlashCodecCache(num_layers=1, preset="int8", materialization_free=False)
    cache.update(k, v, 0)
    layer = cache.layers[0]
    parts = layer.storage_breakdown()
    assert parts["memo"] > 0
    stored_form = parts["archive_used"] + parts["sinks"] + parts["tail"] + parts["mean"] + parts["norm"]
    assert moved_bytes(layer.offload) == stored_form + k.nbytes + v.nbytes


class _Attention(torch.nn.Module):
    num_key_value_groups, is_causal, layer_idx = 1, True, 0


def test_offload_moves_the_layer_while_attention_reads_the_step_it_was_handed():
    """Cache.update offloads a layer right after its update, before attention runs (one step's order, as a model runs
    it): the step handed to attention holds the stored form's tensors from before the move, and attention reads them
    (the output of a resident cache)."""
    k, v = _states(20, 3, heads=2, head_dim=16)
    q = _states(21, 4, heads=2, head_dim=16)[0]
    outs = []
    for offloading in (True, False):
        cache = fx.FlashCodecCache(num_layers=1, preset="int8", offloading=offloading)
        layer, module = cache.layers[0], _Attention()
        key, value = cache.update(k, v, 0)
        assert (layer._offloaded is not None) == offloading  # the prefill attends on the exact states: moved already
        flashcodec_attention_forward(module, q[:, :, :20], key, value, None, scaling=0.25, is_causal=True)
        key, value = cache.update(q[:, :, 20:], q[:, :, 20:], 0)  # prefetched back, appended, offloaded again
        handed = cache.step_table.get(0)
        if offloading:
            assert layer._offloaded is not None and handed.keys.state[0] is not layer.keys_stream.state.data
        outs.append(flashcodec_attention_forward(module, q[:, :, 20:], key, value, None, scaling=0.25)[0])
        assert cache.step_table.get(0) is None and not layer.handed_out
    assert torch.equal(*outs)


@pytest.mark.parametrize("layout", ["dynamic", "static"])
@pytest.mark.parametrize("preset", ["lossless", "int8"])
@pytest.mark.parametrize("stored_form", [True, False])
def test_offloaded_generate_equals_the_resident_cache(layout, preset, stored_form):
    model = fresh_tiny_model("llama") if stored_form else tiny_model("llama")
    ids = tiny_prompt(2, 12)
    static = dict(layout="static", max_cache_len=40) if layout == "static" else {}
    caches = [fx.FlashCodecCache.from_config(model.config, preset=preset, materialization_free=stored_form,
                                             offloading=offloading, **static) for offloading in (False, True)]
    if stored_form:
        apply_codec_attention(model)
    try:
        resident, offloaded = (model.generate(ids, max_new_tokens=20, do_sample=False, **cache_kwargs(c))
                               for c in caches)
    finally:
        remove_codec_attention(model)
    assert torch.equal(offloaded, resident)
    # transformers' order: the last layer's update prefetched the first one back for the next step
    assert [layer._offloaded is not None for layer in caches[1].layers] == [False, True]
    for ours, theirs in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_hot_patch_serves_the_offloaded_cache_implementations():
    model = fresh_tiny_model("llama")
    ids = tiny_prompt(1, 12)
    fx.apply_flash_codec(model, preset="int8")
    try:
        for implementation, resident_implementation, layout in (("offloaded", None, "dynamic"),
                                                                ("offloaded_static", "static", "static")):
            kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
            resident = model.generate(ids, cache_implementation=resident_implementation, **kw)
            out = model.generate(ids, cache_implementation=implementation, **kw)
            cache = output_cache(out)
            assert isinstance(cache, fx.FlashCodecCache) and cache.offloading and cache.options["layout"] == layout
            assert not output_cache(resident).offloading
            assert torch.equal(out.sequences, resident.sequences)
    finally:
        fx.remove_flash_codec(model)


def test_compiled_decode_does_not_combine_with_offloading():
    model = fresh_tiny_model("llama")
    fx.apply_flash_codec(model, compile=True)
    try:
        with pytest.raises(ValueError, match="does not combine with an offloaded cache"):
            model.generate(tiny_prompt(1, 6), max_new_tokens=2, cache_implementation="offloaded")
    finally:
        fx.remove_flash_codec(model)
