"""benchmarks/bench_ppl.py: the KIVI-like peer quantizes complete groups and counts its format's bytes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import bench_ppl  # noqa: E402


def test_kivi_like_layer_quantizes_complete_groups_and_counts_the_format():
    layer = bench_ppl.KiviLikeLayer(bits=4)
    keys, values = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    out_k, _ = layer.update(keys, values)
    assert out_k is keys  # prefill attends on the exact states
    assert layer.quantized == 32 and torch.equal(layer.keys[:, :, 32:], keys[:, :, 32:])
    err = (layer.keys[:, :, :32] - keys[:, :, :32]).abs()
    span = keys[:, :, :32].amax(2, keepdim=True) - keys[:, :, :32].amin(2, keepdim=True)
    assert err.max() > 0 and bool((err <= span / 15 / 2 * 1.01 + 1e-3).all())  # half a step of the per-channel grid
    parts = layer.storage_breakdown()
    assert parts["archive_used"] == 2 * 2 * 32 * 64 * 4 // 8 + 2 * 2 * 2 * 2 * 32 * 64 // 32
    assert parts["tail"] == 2 * 2 * 8 * 64 * 4
