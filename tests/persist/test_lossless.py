"""The lossless stored form: every method gives back the exact bytes of any tensor; a damaged or truncated blob is
refused (``ValueError``) before a decoder reads it; real-looking K/V gets smaller."""

from __future__ import annotations

import pytest
import torch
from codec_tiers import FAST
from hypothesis import given
from hypothesis import strategies as st
from test_planes import FLOATS, random_bits, same_bits, shapes

from flashcodec_fx.persist import entropy, lossless

OTHER = (torch.uint8, torch.int64, torch.bool)


@FAST
@given(shape=shapes, dtype=st.sampled_from(FLOATS + OTHER), method=st.sampled_from(lossless.METHODS),
       seed=st.integers(0, 2**31))
def test_round_trip_bitwise(shape, dtype, method, seed):
    x = random_bits(shape, dtype, seed) if dtype in FLOATS else \
        torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    assert same_bits(lossless.decode(lossless.encode(x, method)), x)


@pytest.mark.parametrize("x", [torch.tensor(7), torch.zeros(0, 4, dtype=torch.bfloat16), torch.ones(3, 0)],
                         ids=["0-dim", "empty-rows", "empty-channels"])
@pytest.mark.parametrize("method", lossless.METHODS)
def test_degenerate_shapes(x, method):
    assert same_bits(lossless.decode(lossless.encode(x, method)), x)


def kv_like(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """(B, H, S, D) values whose channels keep their magnitude along the tokens, as real keys do."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(1, 2, 1, 32, generator=gen) * 2)
    return (torch.randn(1, 2, 256, 32, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_dense_methods_shrink_kv_like_values(dtype):
    x = kv_like(dtype)
    sizes = {m: len(lossless.encode(x, m)) for m in lossless.METHODS}
    assert sizes["ppmd"] < sizes["zstd"] < sizes["raw"]
    assert sizes["raw"] < x.nbytes + 1024  # raw: the bytes and a small header


@pytest.mark.parametrize("method", lossless.METHODS)
def test_every_damaged_byte_is_refused(method):
    blob = lossless.encode(kv_like(torch.bfloat16)[:, :1, :16, :8], method)
    for at in range(len(blob)):
        damaged = bytearray(blob)
        damaged[at] ^= 0x5A
        with pytest.raises(ValueError, match="blob"):
            lossless.decode(bytes(damaged))


@pytest.mark.parametrize("cut", [0, 5, 20, -1])
def test_truncated_blob_is_refused(cut):
    blob = lossless.encode(kv_like(torch.float16), "ppmd")
    with pytest.raises(ValueError, match="blob"):
        lossless.decode(blob[:cut])


def plane_transform(blob: bytes) -> str | None:
    return lossless._header(blob)[0]["transform"]


def test_each_dtype_takes_its_transform_and_many_exponents_take_fields():
    for dtype, transform in lossless.TRANSFORM.items():
        assert plane_transform(lossless.encode(kv_like(dtype), "zstd")) == transform
    wide = torch.tensor([2.0 ** e for e in range(-126, 128)] + [-(2.0 ** e) for e in range(-126, -100)]).reshape(-1, 2)
    blob = lossless.encode(wide, "ppmd")
    assert plane_transform(blob) == "fields" and same_bits(lossless.decode(blob), wide)
    assert plane_transform(lossless.encode(torch.arange(6).reshape(2, 3), "zstd")) is None  # ints: their bytes


def test_bad_method_names_the_allowed_values():
    with pytest.raises(ValueError, match="compression must be one of"):
        lossless.encode(torch.zeros(2, 2), "lz4")
    with pytest.raises(TypeError, match=r"compression must be one of \('raw', 'zstd', 'ppmd'\), got int 3"):
        lossless.encode(torch.zeros(2, 2), 3)
    with pytest.raises(TypeError, match="coder must be one of"):
        entropy.compress(b"abc", None)
    with pytest.raises(TypeError, match="tensor"):
        lossless.encode([1.0, 2.0], "zstd")
    with pytest.raises(TypeError, match="dtype must be one of"):
        lossless.encode(torch.zeros(2, dtype=torch.complex64), "zstd")


def test_a_plane_ppmd_cannot_round_trip_is_coded_by_zstd(monkeypatch):
    """pyppmd 1.x does not give every input back: the coder checks, and the plane falls back to zstd, exactly."""
    x = kv_like(torch.bfloat16)
    monkeypatch.setattr(entropy, "_ppmd_decompress", lambda blob: None)
    with pytest.raises(entropy.RoundTripError, match="does not give"):
        entropy.compress(b"abc" * 100, "ppmd")
    blob = lossless.encode(x, "ppmd")
    monkeypatch.undo()
    assert lossless._header(blob)[0]["planes"][0][0] == "zstd"
    assert same_bits(lossless.decode(blob), x)
