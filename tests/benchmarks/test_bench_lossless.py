"""bench_lossless.py measures what it claims: every transform x coder it reports decodes back bitwise, and its
named-method rows are the library's own blobs (exact, smaller than raw on K/V-like values)."""

from __future__ import annotations

import bench_lossless
import pytest
import torch

from flashcodec_fx.persist import planes


def kv_like(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2, 64, 16, generator=gen) * torch.exp(torch.randn(1, 2, 1, 16, generator=gen))).bfloat16()


@pytest.mark.parametrize("transform", planes.TRANSFORMS)
@pytest.mark.parametrize("coder", bench_lossless.CODERS)
def test_every_combo_decodes_back_bitwise(transform, coder):
    x = kv_like()
    out = bench_lossless.combo_decode(bench_lossless.combo_encode(x, transform, coder), transform, x)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))


def test_measure_kv_rows_are_exact_and_counted_as_stored():
    tensors = [kv_like(0), kv_like(1)]
    result = bench_lossless.measure_kv(tensors, combos=True)
    assert result["values"] == sum(t.numel() for t in tensors)
    assert {row["method"] for row in result["methods"]} == {"raw", "zstd", "ppmd"}
    assert all(row["exact"] for row in result["methods"])
    bits = {row["method"]: row["bits_per_value"] for row in result["methods"]}
    assert bits["ppmd"] < bits["zstd"] < 16 < bits["raw"]  # raw pays its headers and checksums
    assert len(result["combos"]) == len(planes.TRANSFORMS) * len(bench_lossless.CODERS)
