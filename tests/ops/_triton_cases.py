"""Shared builders for the Triton kernel tests: stored states made by the reference ops, on any device."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from flashcodec_fx.codecs import make_codec  # noqa: E402

# Triton kernels need a GPU or the interpreter; the README's test command sets TRITON_INTERPRET=1.
DEVICES = ["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []
if torch.cuda.is_available():
    DEVICES.append("cuda")
if not DEVICES:
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

# (name, codec options): every tier the kernels support, small blocks to keep the interpreter fast.
TIERS = {
    "jpeg_k8": ("jpeg", {"block_size": 8, "keep_freqs": 8}),
    "jpeg_k3": ("jpeg", {"block_size": 8, "keep_freqs": 3}),
    "jpeg_k2_int8": ("jpeg", {"block_size": 8, "keep_freqs": 2, "quant_bits": 8}),
    "jpeg_k8_int8": ("jpeg", {"block_size": 8, "keep_freqs": 8, "quant_bits": 8}),
    "png": ("png", {"block_size": 8}),
    "png_pruned": ("png", {"block_size": 8, "keep_ratio": 0.5}),
    "jpeg_r4_int8": ("jpeg", {"block_size": 4, "keep_freqs": 2, "quant_bits": 8}),
    "png_r4": ("png", {"block_size": 4}),
}


def dtypes(device: str) -> list[torch.dtype]:
    """The interpreter has no bf16; CUDA runs all three."""
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


def codec(tier: str):
    mode, opts = TIERS[tier]
    return make_codec(mode, **opts)


def smooth(b: int, h: int, s: int, d: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """A correlated random walk along seq (like real keys), unit scale."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, s, d, generator=gen).cumsum(2) * 0.3 + torch.randn(b, h, 1, d, generator=gen)
    return x.to(dtype).to(device)


def stored_state(c, x: torch.Tensor, capacity_blocks: int):
    """Reference state of stream ``x (B, H, L, D)`` in an archive of ``capacity_blocks``: (data, scale, index, tail, length)."""
    b, h, length, d = x.shape
    data, scale, index = c.empty_state((b, h), capacity_blocks, d, x.dtype, x.device)
    tail = x.new_zeros(b, h, c.block_size, d)
    n = torch.zeros((), dtype=torch.int64, device=x.device)
    torch.ops.flashcodec.append(data, scale, index, tail, n, x, c.spec)
    return data, scale, index, tail, n


def to(device: str, *tensors):
    """Copies on ``device`` (references are always computed on CPU, where the plain-torch kernels are registered)."""
    return tuple(t.to(device) for t in tensors)

