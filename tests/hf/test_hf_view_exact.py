"""The view path (``materialization_free=False``, and every fallback to the decoded view) attends on each call's own
keys and values exactly, whatever the preset's raw window (issue 22): the last ``T`` rows of the views an update
returns are the states passed in, bitwise, for every preset, layout (dynamic, static, sliding rings) and memo choice;
the rows of earlier calls hold what is stored (the op's ``read`` of the state)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from conftest import tiny_config  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.hf.layer import FlashCodecLayer  # noqa: E402
from flashcodec_fx.hf.sliding_layer import FlashCodecSlidingLayer  # noqa: E402

CALLS = (40, 16, 1, 16, 3, 1, 9)  # a prompt, then chunks longer and shorter than every preset's window
CAPACITY = 128


def _states(layer, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 2, t, 16)  # conftest's tiny configs: 2 KV heads, head_dim 16; batch 2
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _stored(stream) -> torch.Tensor:
    """What the stream stores, as the op reads it (no memo, no overlay; tokens held raw: a raw codec's state)."""
    return torch.ops.flashcodec.read(*stream.op_state())


def _layers(family: str, **options) -> list[FlashCodecLayer]:
    cache = fx.FlashCodecCache.from_config(tiny_config(family), materialization_free=False, **options)
    return [layer for layer in cache.layers if isinstance(layer, FlashCodecLayer)]


@pytest.mark.parametrize("memoize", [True, False])
@pytest.mark.parametrize("layout", ["dynamic", "static"])
@pytest.mark.parametrize("preset", list(fx.PRESETS))
def test_each_call_reads_its_own_states_exactly(preset, layout, memoize):
    static = dict(layout="static", max_cache_len=CAPACITY) if layout == "static" else {}
    layers = _layers("llama", preset=preset, memoize=memoize, **static)
    _check_calls(layers)


@pytest.mark.parametrize("preset", ["4bit", "2.5bit", "int8"])
def test_sliding_rings_read_their_own_states_exactly(preset):
    layers = _layers("gemma3", preset=preset)
    assert any(isinstance(layer, FlashCodecSlidingLayer) for layer in layers)
    _check_calls(layers)


def _check_calls(layers: list[FlashCodecLayer]) -> None:
    for layer in layers:
        seen = 0
        for i, t in enumerate(CALLS):
            k, v = _states(layer, t, seed=i)
            k_view, v_view = layer.update(k, v)
            held = layer.keys_stream.get_seq_length()
            for view, new, stream in ((k_view, k, layer.keys_stream), (v_view, v, layer.values_stream)):
                assert torch.equal(view[:, :, held - t: held], new), f"call {i}: the view does not hold this call's states"
                if i:  # the prompt attends on its own states; later views hold earlier calls as stored
                    stored = _stored(stream)
                    assert torch.equal(view[:, :, : held - t], stored[:, :, : held - t]), f"call {i}: history != stored"
            seen += t
        assert layer.get_seq_length() == seen


@pytest.mark.parametrize("preset", ["4bit", "int8"])
def test_a_compiled_update_returns_the_same_views(preset):
    """What a compiled graph the pass did not rewrite attends on: the static layer's update traced by Dynamo
    (aot_eager: the same ops, no code generation) returns the eager update's views bitwise, its own rows exact."""
    static = dict(layout="static", max_cache_len=CAPACITY)
    eager, compiled = (_layers("llama", preset=preset, **static)[0] for _ in range(2))
    step = torch.compile(lambda k, v: compiled.update(k, v), backend="aot_eager", fullgraph=False)
    for i, t in enumerate(CALLS[:4]):
        k, v = _states(eager, t, seed=i)
        want = eager.update(k, v)
        got = step(k, v)
        held = eager.keys_stream.get_seq_length()
        for w, g, new in zip(want, got, (k, v), strict=True):
            assert torch.equal(g, w), f"call {i}: compiled view != eager view"
            assert torch.equal(g[:, :, held - t: held], new), f"call {i}: the compiled view lost this call's states"
