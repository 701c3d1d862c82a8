"""DCT-II basis: orthonormal, and equal to an FFT-based DCT-II computed independently in fp64."""

from __future__ import annotations

import math

import torch
from _codec_data import FAST
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx.codecs import dct_basis


def fft_dct2(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II of the columns of ``x (r, D)`` via an FFT of the even extension (fp64)."""
    r = x.shape[0]
    y = torch.cat([x, x.flip(0)]).to(torch.float64)
    spec = torch.fft.fft(y, dim=0)[:r]
    k = torch.arange(r, dtype=torch.float64)[:, None]
    twiddle = torch.exp(-1j * math.pi * k / (2 * r))
    coeffs = 0.5 * (twiddle * spec).real
    norm = torch.full((r, 1), math.sqrt(2.0 / r), dtype=torch.float64)
    norm[0] = math.sqrt(1.0 / r)
    return coeffs * norm


@FAST
@given(r=st.integers(2, 64))
def test_dct_basis_is_orthonormal(r):
    m = dct_basis(r).double()
    assert m.dtype == torch.float64 and m.shape == (r, r)
    torch.testing.assert_close(m @ m.T, torch.eye(r, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(m.T @ m, torch.eye(r, dtype=torch.float64), atol=1e-6, rtol=0)


@FAST
@given(r=st.integers(2, 64))
def test_dct_basis_matches_fft_dct(r):
    eye = torch.eye(r, dtype=torch.float64)
    torch.testing.assert_close(dct_basis(r).double(), fft_dct2(eye), atol=1e-6, rtol=0)


def test_dct_basis_is_fp32_on_requested_device():
    m = dct_basis(8, "cpu")
    assert m.dtype == torch.float32 and m.device.type == "cpu"
    assert torch.allclose(m[0], torch.full((8,), 8 ** -0.5))
