"""KIVI (jy-yuan/KIVI, ICML 2024) as a fake-quant peer, with the official policy of its reference code
(``models/llama_kivi.py``; ``group_size=32``, ``residual_length=128``):

- keys per channel: asymmetric min/max over groups of ``GROUP`` tokens; raw keys accumulate and are quantized
  ``RESIDUAL`` at a time when ``RESIDUAL`` of them are waiting (so 0-127 keys are raw);
- values per token: asymmetric min/max over groups of ``GROUP`` channels; the newest ``RESIDUAL`` values stay raw
  (each value is quantized as it leaves that window);
- scale and minimum in fp16; codes packed at ``bits`` bits.

Bytes as the real format keeps them: keys ``bits`` per value + 2 x 16 bits per (channel, 32-token group); values
``bits`` per value + 2 x 16 bits per (token, 32-channel group); raw tokens at 16 bits. A sliding-window layer keeps
every key group that still overlaps its window (whole).
"""

from __future__ import annotations

import torch

from .fakequant import RAW_BYTES, FakeQuantPolicy, Span

GROUP = 32
RESIDUAL = 128
PARAM_BYTES = 2 * 2  # fp16 scale + fp16 minimum per group


def minmax_fake_quant(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min/max quantize-dequantize of ``x`` with one (fp16 scale, fp16 minimum) per slice along ``dim``
    (``2**bits`` levels, round to nearest)."""
    levels = (1 << bits) - 1
    low = x.amin(dim, keepdim=True).half().float()
    scale = ((x.amax(dim, keepdim=True) - low) / levels).half().float()
    codes = torch.where(scale > 0, torch.round((x - low) / scale.clamp_min(torch.finfo(torch.float16).tiny)), 0)
    return codes.clamp(0, levels) * scale + low


class KiviPolicy(FakeQuantPolicy):
    def __init__(self, bits: int):
        if bits not in (2, 4):
            raise ValueError(f"bits must be 2 or 4 (the bit widths KIVI ships), got {bits}")
        self.bits, self.name = bits, f"KIVI-{bits}"

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % GROUP:
            raise ValueError(f"{self.name} needs head_dim divisible by {GROUP}, got {head_dim}")

    def key_boundary(self, length: int) -> int:
        return length // RESIDUAL * RESIDUAL

    def value_boundary(self, length: int) -> int:
        return max(length - RESIDUAL, 0)

    def quantize_keys(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        b, h, t, d = keys.shape  # t: a multiple of RESIDUAL, so of GROUP
        grouped = keys.reshape(b, h, t // GROUP, GROUP, d)
        return minmax_fake_quant(grouped, self.bits, dim=3).reshape(b, h, t, d)

    def quantize_values(self, values: torch.Tensor, layer_idx: int) -> torch.Tensor:
        b, h, t, d = values.shape
        grouped = values.reshape(b, h, t, d // GROUP, GROUP)
        return minmax_fake_quant(grouped, self.bits, dim=4).reshape(b, h, t, d)

    def stored_bytes(self, span: Span) -> dict[str, int]:
        rows = span.batch * span.heads
        key_groups = max(span.key_done // GROUP - span.first // GROUP, 0)  # whole groups overlapping the window
        keys = rows * span.head_dim * key_groups * (GROUP * self.bits // 8 + PARAM_BYTES)
        values = rows * span.quantized_tokens(span.value_done) * (
            span.head_dim * self.bits // 8 + span.head_dim // GROUP * PARAM_BYTES)
        raw = rows * span.head_dim * RAW_BYTES * (span.raw_tokens(span.key_done) + span.raw_tokens(span.value_done))
        return {"archive_used": keys + values, "tail": raw}
