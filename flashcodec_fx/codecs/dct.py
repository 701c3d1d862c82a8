"""Orthonormal DCT-II basis along the sequence axis of a block."""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=64)
def _dct_basis_cpu(block_size: int) -> torch.Tensor:
    n = torch.arange(block_size, dtype=torch.float64)
    j = torch.arange(block_size, dtype=torch.float64)[:, None]
    basis = torch.cos(math.pi / block_size * (n + 0.5) * j)
    basis[0] *= math.sqrt(1.0 / block_size)
    basis[1:] *= math.sqrt(2.0 / block_size)
    return basis.to(torch.float32)


def dct_basis(block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """DCT-II analysis matrix ``M`` of shape ``(r, r)``, fp32: ``M[j, n] = c_j cos(pi/r (n + 1/2) j)``.

    ``M`` is orthonormal, so ``M @ M.T == I`` and a block ``X (r, D)`` has coefficients ``C = M @ X``
    and is rebuilt as ``X = M.T @ C``.
    """
    return _on_device(block_size, str(torch.device("cpu") if device is None else torch.device(device)))


@functools.lru_cache(maxsize=256)
def _on_device(block_size: int, device: str) -> torch.Tensor:
    """One copy per device, made once (a later call inside a CUDA-graph capture never copies from the host)."""
    return _dct_basis_cpu(block_size).to(device)
