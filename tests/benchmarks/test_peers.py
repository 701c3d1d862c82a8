"""benchmarks/peers: the fake-quant formats quantize what their policy says, keep raw what it keeps raw, and count
the bytes of the real format."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from peers import peer_tiers  # noqa: E402
from peers.fakequant import FakeQuantCache, FakeQuantLayer, FakeQuantSlidingLayer  # noqa: E402
from peers.kivi import GROUP, RESIDUAL, KiviPolicy  # noqa: E402
from peers.turboquant import TurboQuantPolicy, hadamard, lloyd_max_gaussian, rotation, turbo_fake_quant  # noqa: E402

D = 64  # SmolLM2's head_dim
# Max (1960), Table I: positive Lloyd-Max levels of the standard normal
MAX_1960 = {1: [0.7979], 2: [0.4528, 1.5104], 3: [0.2451, 0.7560, 1.3440, 2.1520],
            4: [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326]}
# Max (1960): mean squared error of those levels on N(0, 1)
MAX_1960_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def _stream(layer, total: int, prefill: int = 128, chunk: int = 16, heads: int = 2, seed: int = 0):
    """Feed ``total`` random bf16 tokens through ``layer`` as the streaming protocol does; returns (keys, values)
    fed, and the states each call returned."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, heads, total, D, generator=gen).bfloat16()
    values = torch.randn(1, heads, total, D, generator=gen).bfloat16()
    returned = []
    for start, end in [(0, prefill)] + [(s, min(s + chunk, total)) for s in range(prefill, total, chunk)]:
        returned.append(layer.update(keys[:, :, start:end], values[:, :, start:end]))
    return keys, values, returned


def _bits(layer) -> float:
    b, h, n, d = layer.keys.shape
    return 8 * layer.storage_breakdown()["total"] / (2 * b * h * n * d)


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_bits_at_1024_tokens_are_the_format_formula(bits):
    layer = FakeQuantLayer(KiviPolicy(bits), 0)
    _stream(layer, 1024)
    key_bits = bits + 2 * 16 / GROUP  # fp16 scale + min per (channel, 32-token group); every key quantized at 1024
    value_bits = ((1024 - RESIDUAL) * (bits + 2 * 16 / GROUP) + RESIDUAL * 16) / 1024
    assert _bits(layer) == pytest.approx((key_bits + value_bits) / 2, abs=1e-12)
    assert _bits(layer) == pytest.approx({2: 3.8125, 4: 5.6875}[bits])  # issue 9's 3.81 / 5.69


@settings(max_examples=10, deadline=None)
@given(total=st.integers(129, 500), chunk=st.integers(1, 40), bits=st.sampled_from([2, 4]))
def test_kivi_raw_window_stays_raw_and_history_is_on_its_grid(total, chunk, bits):
    layer = FakeQuantLayer(KiviPolicy(bits), 0)
    keys, values, returned = _stream(layer, total, chunk=chunk)
    raw_keys = total % RESIDUAL
    assert layer.key_done == total - raw_keys and layer.value_done == total - RESIDUAL
    assert torch.equal(layer.values[:, :, -RESIDUAL:], values[:, :, -RESIDUAL:])  # newest 128 values exact
    assert torch.equal(layer.keys[:, :, total - raw_keys:], keys[:, :, total - raw_keys:])
    # quantized keys: at most 2**bits distinct values per (channel, 32-token group)
    groups = layer.keys[:, :, : layer.key_done].float().reshape(1, 2, -1, GROUP, D).permute(0, 1, 2, 4, 3)
    ordered = groups.reshape(-1, GROUP).sort(-1).values
    distinct = 1 + (ordered.diff(dim=-1) != 0).sum(-1)
    assert int(distinct.max()) <= 2 ** bits
    err = (layer.values[:, :, : layer.value_done].float() - values[:, :, : layer.value_done].float()).abs()
    grouped = values[:, :, : layer.value_done].float().reshape(1, 2, -1, D // GROUP, GROUP)
    step = (grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)) / (2 ** bits - 1)
    assert err.max() > 0 and bool((err.reshape(grouped.shape) <= step / 2 * 1.02 + 2e-2).all())
    for (ret_k, ret_v), start in zip(returned[1:], range(128, total, chunk), strict=True):  # own tokens exact
        end = min(start + chunk, total)
        assert torch.equal(ret_k[:, :, start:end], keys[:, :, start:end])
        assert torch.equal(ret_v[:, :, start:end], values[:, :, start:end])


def test_kivi_rejects_a_head_dim_it_cannot_group_and_an_unshipped_width():
    with pytest.raises(ValueError, match="head_dim divisible by 32"):
        FakeQuantLayer(KiviPolicy(2), 0).update(torch.randn(1, 1, 4, 48), torch.randn(1, 1, 4, 48))
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        KiviPolicy(3)


def test_sliding_layer_attends_to_its_window_and_keeps_only_what_the_format_still_needs():
    """Window 99 tokens, shorter than KIVI's raw 128: the newest 128 values stay (raw, the format keeps them) and
    raw keys wait for their 128-token flush; everything older is dropped."""
    window = 100
    layer = FakeQuantSlidingLayer(KiviPolicy(2), 0, sliding_window=window)
    keys, values, returned = _stream(layer, 300, prefill=40, chunk=16)
    assert returned[-1][0].shape[-2] == window - 1 + 300 - 296  # the window's history + the call's own 4 tokens
    assert torch.equal(returned[-1][1][:, :, -4:], values[:, :, -4:])
    span = layer.span()
    assert (span.first, span.key_done, span.value_done) == (300 - RESIDUAL, 256, 300 - RESIDUAL)
    assert torch.equal(layer.values, values[:, :, -RESIDUAL:])
    groups = 256 // GROUP - span.first // GROUP  # key groups 5, 6, 7 overlap the kept [172, 256)
    expected_keys = 2 * D * groups * (GROUP * 2 // 8 + 4) + 2 * D * 2 * (300 - 256)
    assert layer.storage_breakdown()["total"] == expected_keys + 2 * D * 2 * RESIDUAL


def test_sliding_layer_with_a_long_window_keeps_exactly_the_window():
    layer = FakeQuantSlidingLayer(TurboQuantPolicy(3, 2), 0, sliding_window=200)
    _stream(layer, 500)
    assert layer.keys.shape[-2] == 199 and layer.first == 301
    assert _bits(layer) == pytest.approx(2.5 + 16 / D)


@pytest.mark.parametrize("bits", sorted(MAX_1960))
def test_lloyd_max_levels_match_max_1960_and_are_centroids(bits):
    levels = lloyd_max_gaussian(bits)
    assert torch.allclose(levels, -levels.flip(0), atol=1e-12)  # symmetric
    torch.testing.assert_close(levels[len(levels) // 2:], torch.tensor(MAX_1960[bits], dtype=torch.float64),
                               atol=1e-4, rtol=0)
    x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(bits), dtype=torch.float64)
    cells = torch.bucketize(x, (levels[1:] + levels[:-1]) / 2)
    means = torch.zeros_like(levels).index_add_(0, cells, x) / torch.bincount(cells, minlength=len(levels))
    torch.testing.assert_close(means, levels, atol=5e-3, rtol=0)  # each level is its cell's mean
    mse = float(((x - levels[cells]) ** 2).mean())
    assert mse == pytest.approx(MAX_1960_MSE[bits], rel=0.02)


def test_rotation_is_orthonormal_and_hadamard_needs_a_power_of_two():
    for d in (16, 64, 256):
        r = rotation(d, 3)
        torch.testing.assert_close(r @ r.T, torch.eye(d), atol=1e-6, rtol=0)
        assert not torch.equal(r, hadamard(d) / math.sqrt(d))  # the signs are random, not all +1
    with pytest.raises(ValueError, match="power of two"):
        hadamard(48)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_turboquant_error_is_the_lloyd_max_distortion_of_the_rotated_coordinates(bits):
    """Rotated coordinates of any vector (here: heavy-tailed, outlier channels) are ~ N(0, |x|^2 / D), so the
    relative squared error is close to the Gaussian Lloyd-Max distortion."""
    torch.manual_seed(0)
    x = torch.distributions.StudentT(3.0).sample((4096, D)) * torch.linspace(0.2, 5, D)
    out = turbo_fake_quant(x, bits, rotation(D, 1))
    relative = float(((out - x) ** 2).sum() / (x ** 2).sum())
    assert relative == pytest.approx(MAX_1960_MSE[bits], rel=0.15)


@pytest.mark.parametrize("kb, vb", [(4, 4), (3, 3), (3, 2)])
def test_turboquant_quantizes_every_token_and_counts_bits_plus_a_16_bit_norm(kb, vb):
    layer = FakeQuantLayer(TurboQuantPolicy(kb, vb), 0)
    keys, values, returned = _stream(layer, 300)
    assert layer.key_done == layer.value_done == 300
    assert not torch.equal(layer.keys[:, :, -1], keys[:, :, -1])  # nothing raw, not even the newest token
    assert _bits(layer) == pytest.approx((kb + vb) / 2 + 16 / D, abs=1e-12)  # 4.25, 3.25, 2.75 at D = 64
    assert torch.equal(returned[-1][0][:, :, 288:], keys[:, :, 288:])  # the call's own tokens exact


def test_peer_caches_cover_full_and_sliding_layers_and_reject_others():
    from conftest import tiny_config

    config = tiny_config("gemma3")
    config.head_dim = 32
    cache = FakeQuantCache(config, KiviPolicy(2))
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [FakeQuantSlidingLayer if t == "sliding_attention" else FakeQuantLayer for t in config.layer_types]
    hybrid = tiny_config("hybrid")
    with pytest.raises(ValueError, match="linear_attention"):
        FakeQuantCache(hybrid, KiviPolicy(2))


def test_peer_list_is_the_issue_set():
    names = [tier.name for _, tier in peer_tiers()]
    assert names == ["KIVI-2", "KIVI-4", "TurboQuant-style K4V4", "TurboQuant-style K3V3", "TurboQuant-style K3V2",
                     "quanto int4"]
