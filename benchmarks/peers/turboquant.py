"""TurboQuant-style per-vector quantization as a fake-quant peer (the family vLLM, llama.cpp and ollama ship as a
KV cache type): every key / value vector of one (token, head) is

1. rotated along head_dim by a fixed orthonormal random-sign Walsh-Hadamard transform ``R = H diag(s) / sqrt(D)``
   (signs ``s`` from a fixed seed per layer; keys and values use different signs),
2. scaled by its norm, stored in 16 bits (fp16): the rotated coordinates of a unit vector are ~ N(0, 1/D),
3. quantized coordinate-wise to the ``bits``-bit Lloyd-Max levels of that Gaussian (MSE-optimal scalar levels),
4. read back as ``norm * R^T (levels / sqrt(D))``.

Every token is quantized, nothing is kept raw. Bytes: ``bits`` per value + 16 bits per vector, so K4V4 is
``4 + 16 / D`` bits per value (4.25 at D = 64). ``head_dim`` must be a power of two.
"""

from __future__ import annotations

import functools
import math

import torch

from .fakequant import FakeQuantPolicy, Span

NORM_BYTES = 2  # fp16 norm per (token, head) vector
LLOYD_ITERATIONS = 300
SEED = 0x7B0


@functools.cache
def lloyd_max_gaussian(bits: int) -> torch.Tensor:
    """The ``2**bits`` Lloyd-Max reconstruction levels of the standard normal, ascending, fp64 ``(2**bits,)``:
    Lloyd's iteration (thresholds halfway between levels; each level the conditional mean of its cell,
    ``(phi(a) - phi(b)) / (Phi(b) - Phi(a))``) from uniformly spread levels."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    n = 1 << bits
    levels = torch.linspace(-2.5, 2.5, n, dtype=torch.float64) * (1 if n > 2 else 0.5)
    inf = torch.tensor([math.inf], dtype=torch.float64)
    for _ in range(LLOYD_ITERATIONS):
        edges = torch.cat([-inf, (levels[1:] + levels[:-1]) / 2, inf])
        a, b = edges[:-1], edges[1:]
        levels = (_normal_pdf(a) - _normal_pdf(b)) / (_normal_cdf(b) - _normal_cdf(a))
    return levels


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # 0 at +-inf


def _normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return (1 + torch.erf(x / math.sqrt(2))) / 2


def hadamard(d: int) -> torch.Tensor:
    """The ``(d, d)`` Sylvester Hadamard matrix (entries +-1), ``d`` a power of two."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two for the Walsh-Hadamard rotation, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.cache
def rotation(d: int, seed: int) -> torch.Tensor:
    """Orthonormal ``(d, d)`` fp32 ``R = H diag(s) / sqrt(d)`` with random signs ``s`` from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
    return hadamard(d) * signs / math.sqrt(d)


def turbo_fake_quant(x: torch.Tensor, bits: int, rot: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize the ``(..., D)`` vectors ``x`` (fp32): rotate, 16-bit norm, Lloyd-Max levels of
    N(0, 1/D) per coordinate, back."""
    d = x.shape[-1]
    levels = lloyd_max_gaussian(bits).float() / math.sqrt(d)
    norm = x.norm(dim=-1, keepdim=True).half().float()
    unit = (x @ rot.T) / norm.clamp_min(torch.finfo(torch.float16).tiny)
    edges = (levels[1:] + levels[:-1]) / 2
    codes = torch.bucketize(unit, edges)
    return (levels[codes] * norm) @ rot


class TurboQuantPolicy(FakeQuantPolicy):
    def __init__(self, key_bits: int, value_bits: int):
        lloyd_max_gaussian(key_bits), lloyd_max_gaussian(value_bits)  # validates both
        self.key_bits, self.value_bits = key_bits, value_bits
        self.name = f"TurboQuant-style K{key_bits}V{value_bits}"

    def check_head_dim(self, head_dim: int) -> None:
        hadamard(head_dim)

    def key_boundary(self, length: int) -> int:
        return length

    def value_boundary(self, length: int) -> int:
        return length

    def quantize_keys(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return turbo_fake_quant(keys, self.key_bits, rotation(keys.shape[-1], SEED + 2 * layer_idx))

    def quantize_values(self, values: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return turbo_fake_quant(values, self.value_bits, rotation(values.shape[-1], SEED + 2 * layer_idx + 1))

    def stored_bytes(self, span: Span) -> dict[str, int]:
        vectors = span.batch * span.heads * (span.length - span.first)
        codes = vectors * (-(-span.head_dim * self.key_bits // 8) - (-span.head_dim * self.value_bits // 8))
        return {"archive_used": codes + 2 * vectors * NORM_BYTES, "tail": 0}
