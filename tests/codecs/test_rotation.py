"""The head_dim rotation: orthonormal, reproducible from its seed, a random-sign Walsh-Hadamard for powers of two."""

from __future__ import annotations

import pytest
import torch
from _codec_data import FAST
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx.codecs import rotation


@FAST
@given(d=st.integers(1, 96), seed=st.integers(0, 2**31))
def test_orthonormal_for_any_head_dim(d, seed):
    """Powers of two and the QR fallback alike: R R^T = R^T R = I."""
    r = rotation(d, seed)
    assert r.shape == (d, d) and r.dtype == torch.float32
    eye = torch.eye(d, dtype=torch.float64)
    torch.testing.assert_close(r.double() @ r.double().T, eye, atol=1e-6, rtol=0)
    torch.testing.assert_close(r.double().T @ r.double(), eye, atol=1e-6, rtol=0)


@pytest.mark.parametrize("d", [8, 64, 128])
def test_power_of_two_is_signed_walsh_hadamard(d):
    """Entries are +-1/sqrt(D); R diag(1/signs) sqrt(D) is the Sylvester Hadamard matrix (signs on the columns)."""
    r = rotation(d, seed=3).double()
    torch.testing.assert_close(r.abs(), torch.full((d, d), d**-0.5, dtype=torch.float64), atol=1e-7, rtol=0)
    signs = torch.sign(r[0])  # the first Hadamard row is all ones
    h = r / signs * d**0.5
    idx = torch.arange(d)
    parity = torch.tensor([[bin(int(i) & int(j)).count("1") % 2 for j in idx] for i in idx], dtype=torch.float64)
    torch.testing.assert_close(h, 1 - 2 * parity, atol=1e-6, rtol=0)


@pytest.mark.parametrize("d", [16, 24, 80])
def test_reproducible_and_seed_dependent(d):
    assert torch.equal(rotation(d, 7), rotation(d, 7))
    assert not torch.equal(rotation(d, 7), rotation(d, 8))


def test_preserves_dot_products():
    """q . x == (R q) . (R x): attention may run in the rotated space."""
    gen = torch.Generator().manual_seed(0)
    for d in (16, 48):
        r = rotation(d, 1).double()
        q, x = torch.randn(5, d, generator=gen, dtype=torch.float64), torch.randn(7, d, generator=gen, dtype=torch.float64)
        torch.testing.assert_close((q @ r.T) @ (x @ r.T).T, q @ x.T, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bad", [0, -4, 8.0, True, "64"])
def test_bad_head_dim_is_rejected(bad):
    with pytest.raises(ValueError, match="head_dim"):
        rotation(bad, 0)


def test_on_requested_device():
    assert rotation(16, 0, "meta").device.type == "meta"
