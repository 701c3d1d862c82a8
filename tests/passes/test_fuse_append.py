"""The append-attention fusion (``passes/fuse_append.py``): a compiled decode step's two appends and its codec
attention become one ``flashcodec::append_attention`` per layer, with bitwise the logits and stored states of the
unfused graph; a site where something else reads the updated state first is left as it was."""

from __future__ import annotations

import pytest
import torch
from passes_toy import ToyDecoder, greedy, prefill

import flashcodec_fx as fc
from flashcodec_fx.passes import backend

CODECS = {"png": dict(mode="png", block_size=8),
          "jpeg_r1_4bit": dict(mode="jpeg", block_size=1, quant_bits=4, rotate=True)}
STEPS = 5


class ExactNew(ToyDecoder):
    """The toy reading its cache as the transformers layers do: this call's tokens read exactly (``read(new)``)."""

    def _kv(self, i, k, v, pos):
        cache = self.caches[i]
        cache.append(k, v)
        return cache.keys.read(k), cache.values.read(v)


class StateReader(ExactNew):
    """A toy whose last layer also reads its decoded keys outside attention (``x + 0 * k.sum()``), before attending
    (each layer's sum replaces the previous one: only the last reaches the output)."""

    def _kv(self, i, k, v, pos):
        k_view, v_view = super()._kv(i, k, v, pos)
        self.read_sum = k_view.sum()
        return k_view, v_view

    def forward(self, ids, pos):
        out = super().forward(ids, pos)
        return out + 0 * self.read_sum


def _compiled(model, fuse: bool, strict: bool = True):
    chosen = backend(strict=strict, inductor=False)
    if not fuse:
        chosen.fusion = lambda graph: None
    return chosen, torch.compile(model, backend=chosen, fullgraph=True)


def _decode(model, step):
    with torch.no_grad():
        return greedy(step, prefill(model), 11, STEPS)


def _states(model) -> list[torch.Tensor]:
    return [t for cache in model.caches for stream in (cache.keys, cache.values) for t in stream.state
            if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", list(CODECS))
def test_each_layer_step_is_one_fused_op_with_bitwise_the_unfused_results(name):
    torch._dynamo.reset()
    codec = fc.make_codec(**CODECS[name])
    fused_model = ExactNew(codec=codec)
    plain_model = ExactNew(codec=codec)
    plain_model.load_state_dict(fused_model.state_dict())
    fused_backend, fused_step = _compiled(fused_model, fuse=True)
    tokens, logits = _decode(fused_model, fused_step)
    torch._dynamo.reset()
    _, plain_step = _compiled(plain_model, fuse=False)
    plain_tokens, plain_logits = _decode(plain_model, plain_step)
    assert fused_backend.fusion.fused and all(n == len(fused_model.caches) for n in fused_backend.fusion.fused)
    assert tokens == plain_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, plain_logits, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_states(fused_model), _states(plain_model), strict=True))


def test_a_state_read_before_the_attention_keeps_the_appends_apart():
    torch._dynamo.reset()
    codec = fc.make_codec(**CODECS["png"])
    model = StateReader(codec=codec)
    chosen, step = _compiled(model, fuse=True, strict=False)
    tokens, _ = _decode(model, step)
    assert chosen.fusion.fused and set(chosen.fusion.fused) == {len(model.caches) - 1}  # all but the last layer
    eager = StateReader(codec=codec)
    eager.load_state_dict(model.state_dict())
    assert tokens == _decode(eager, eager)[0]
