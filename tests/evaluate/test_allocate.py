"""flashcodec_fx.evaluate.allocate: per-layer gains of an upgraded recipe, and the options they allocate."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from conftest import fresh_tiny_model, tiny_model, tiny_prompt  # noqa: E402

from flashcodec_fx.config import cache_config  # noqa: E402
from flashcodec_fx.evaluate import Tier, make_cache, prepared, streamed_logprobs, token_kl  # noqa: E402
from flashcodec_fx.evaluate.allocate import LayerGains, layer_gains, upgraded  # noqa: E402

BASE = {"mode": "jpeg", "block_size": 1, "quant_bits": 2, "levels": "tcq", "rotate": True}
UPGRADE = {"value_options": {"quant_bits": 4}}


def _kl(model, ids, options) -> float:
    """One recipe's mean KL against the raw cache, streamed on its own (prefill 4, chunks of 3)."""
    ref = streamed_logprobs(model, ids, make_cache(model, Tier("raw")), 4, 3)
    tier = Tier("one", options)
    with prepared(model, tier):
        out = streamed_logprobs(model, ids, make_cache(model, tier), 4, 3)
    return float(token_kl(ref, out).double().mean())


def test_lockstep_gains_equal_each_recipe_streamed_alone():
    """Every KL of the lockstep run is the KL its recipe gets streamed alone, and upgrading 2-bit trellis values to
    4 bits in a layer lowers the KL on the tiny model (its layers' values matter)."""
    model = fresh_tiny_model("llama")
    ids = tiny_prompt(2, 16)
    gains = layer_gains(model, ids, BASE, UPGRADE, prefill=4, chunk=3)
    assert [layer for layer, _ in gains.layer_kl] == [0, 1]
    assert gains.base_kl == pytest.approx(_kl(model, ids, BASE), rel=1e-9)
    for layer, kl in gains.layer_kl:
        assert kl == pytest.approx(_kl(model, ids, upgraded(BASE, UPGRADE, [layer])), rel=1e-9)
        assert kl < gains.base_kl


def test_allocation_upgrades_the_largest_gains():
    gains = LayerGains(BASE, UPGRADE, 0.5, ((0, 0.45), (1, 0.30), (2, 0.52), (3, 0.30)))
    assert gains.gains == pytest.approx({0: 0.05, 1: 0.2, 2: -0.02, 3: 0.2})
    assert gains.ranked() == [1, 3, 0, 2]
    options = gains.allocation(2)
    assert options["per_layer"] == {1: UPGRADE, 3: UPGRADE}
    config = cache_config(**options)
    assert ";bits=4;" in config.layer(1).value.build(1).spec
    assert ";bits=2;" in config.layer(0).value.build(0).spec
    assert "per_layer" not in gains.allocation(0)
    for bad, error in ((5, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="count"):
            gains.allocation(bad)


def test_upgrade_merges_over_the_base_overrides():
    base = {**BASE, "per_layer": {0: {"key_options": {"quant_bits": 3}}, 2: None}}
    options = upgraded(base, UPGRADE, [0, 1])
    assert options["per_layer"] == {0: {"key_options": {"quant_bits": 3}, "value_options": {"quant_bits": 4}},
                                    1: UPGRADE, 2: None}
    assert base["per_layer"][0] == {"key_options": {"quant_bits": 3}}  # the caller's options untouched


def test_bad_upgrade_or_recipe_raises_before_streaming():
    model = fresh_tiny_model("llama")
    ids = tiny_prompt(1, 8)
    with pytest.raises(TypeError, match="upgrade"):
        layer_gains(model, ids, BASE, [("value_options", {"quant_bits": 4})])
    with pytest.raises(ValueError, match="upgrade"):
        layer_gains(model, ids, BASE, {})
    with pytest.raises(ValueError, match="bogus"):
        layer_gains(model, ids, BASE, {"value_options": {"bogus": 1}})
    with pytest.raises(ValueError, match="out of range"):
        layer_gains(model, ids, BASE, UPGRADE, layers=[5])


@pytest.mark.parametrize("family, codec_layers", [("hybrid", [1, 3]), ("gemma3", [0, 1, 2, 3])])
def test_default_layers_are_the_codec_layers(family, codec_layers):
    """A hybrid model's linear-attention layers carry no codec, so they are not candidates; sliding-window layers
    are. Each measured upgrade's KL is its recipe's streamed alone."""
    model, ids = tiny_model(family), tiny_prompt(1, 16)
    gains = layer_gains(model, ids, BASE, UPGRADE, prefill=4, chunk=3)
    assert [layer for layer, _ in gains.layer_kl] == codec_layers
    layer, kl = gains.layer_kl[-1]
    assert kl == pytest.approx(_kl(model, ids, upgraded(BASE, UPGRADE, [layer])), rel=1e-9)
