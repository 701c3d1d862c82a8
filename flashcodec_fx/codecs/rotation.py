"""A fixed orthonormal rotation along head_dim: random signs, then a normalized Walsh-Hadamard transform.

Rotating spreads a few large channels over all of them, so one scale per vector fits every channel (what the
TurboQuant family relies on). ``R = H_D @ diag(signs) / sqrt(D)`` with ``signs`` drawn from a seeded generator, so a
cache rebuilt with the same seed stores and reads the same codes. ``D`` not a power of two: a seeded random
orthonormal matrix (QR of a Gaussian) instead, same contract (documented in docs/quantization.md).
"""

from __future__ import annotations

import functools

import torch


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=64)
def _rotation_cpu(head_dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if head_dim & (head_dim - 1) == 0:
        signs = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.float64) * 2 - 1
        matrix = _hadamard(head_dim) * signs / head_dim ** 0.5
    else:
        q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
        matrix = q * torch.sign(torch.diagonal(r))
    return matrix.to(torch.float32)


def rotation(head_dim: int, seed: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``R (D, D)`` fp32, orthonormal (``R @ R.T == I``): a vector ``x`` is stored as ``R @ x``; ``q . x ==
    (R @ q) . (R @ x)``, so attention can run in the rotated space and rotate its output back with ``R.T``."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    return _on_device(head_dim, seed, str(torch.device("cpu") if device is None else torch.device(device)))


@functools.lru_cache(maxsize=256)
def _on_device(head_dim: int, seed: int, device: str) -> torch.Tensor:
    return _rotation_cpu(head_dim, seed).to(device)
