"""An Inductor-friendly formulation of ``flashcodec::codec_attention`` for compiled CPU graphs.

The op's reference (the spec) dequantizes and runs einsums through eager kernels; in a compiled graph the pass
inlines this formulation instead, written as broadcast products and sums so that Inductor fuses the int8
dequantization, the per-block synthesis and the softmax into a few C++ loops that read the stored archive once.
Same math as the reference: for a block ``X = A @ S``,

    scores = ((q . rows) * row_scale) @ A^T        out = ((prob @ A) * row_scale) . rows

The synthesis matrix ``A`` is built inside the graph (float64, cast to fp32, as ``codecs.dct`` does), so the
inlined graph holds no tensor constants.
"""

from __future__ import annotations

import math

import torch

from ..codecs import JPEG, Codec, Encoded, codec_from_spec
from ..ops.attention import stream_probabilities


def _synthesis(codec: Codec, device: torch.device) -> torch.Tensor:
    """``A (r, R)`` fp32, built from iota ops (no constant tensor)."""
    r = codec.block_size
    if codec.mode != JPEG:
        return torch.tril(torch.ones(r, r, device=device))
    p = torch.arange(r, dtype=torch.float64, device=device)[:, None]
    j = torch.arange(codec.rows, dtype=torch.float64, device=device)[None, :]
    norm = torch.where(j == 0, math.sqrt(1.0 / r), math.sqrt(2.0 / r))
    return (torch.cos(math.pi / r * (p + 0.5) * j) * norm).to(torch.float32)


def _rows(codec: Codec, data: torch.Tensor, scale: torch.Tensor, index: torch.Tensor):
    """Rows to contract with and their per-row scale (None when unquantized): ``S = rows * scale[..., None]``."""
    if codec.quant_bits:
        return data, scale
    return codec.stored_rows(Encoded(data, scale, index)), None


def _contract_d(qg: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``(B, H, GT, D) x (B, H, NB, R, D) -> (B, H, GT, NB, R)``. fp32 rows: one BLAS matmul, no copy; narrower rows
    (int8 codes): a broadcast product summed over D that Inductor fuses with the cast, the query index innermost so
    each stored row is read once."""
    b, h, nb, rr, d = rows.shape
    if rows.dtype == torch.float32:
        return (qg @ rows.reshape(b, h, nb * rr, d).transpose(-1, -2)).reshape(b, h, -1, nb, rr)
    prod = rows[:, :, :, :, None].float() * qg[:, :, None, None]  # (B, H, NB, R, GT, D)
    return prod.sum(-1).permute(0, 1, 4, 2, 3)


def _contract_rows(p_coef: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``(B, H, GT, NB, R) x (B, H, NB, R, D) -> (B, H, GT, D)`` (see :func:`_contract_d`)."""
    b, h, nb, rr, d = rows.shape
    if rows.dtype == torch.float32:
        return p_coef.reshape(b, h, -1, nb * rr) @ rows.reshape(b, h, nb * rr, d)
    return (p_coef[..., None] * rows[:, :, None].float()).sum((3, 4))


def codec_attention_fused(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, k_index: torch.Tensor,
                          k_tail: torch.Tensor, v_data: torch.Tensor, v_scale: torch.Tensor, v_index: torch.Tensor,
                          v_tail: torch.Tensor, length: torch.Tensor, spec_k: list[int], spec_v: list[int],
                          mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Same contract as ``flashcodec::codec_attention`` (``q (B, Hq, T, D)`` -> ``(B, Hq, T, D)`` in q's dtype);
    arguments are assumed valid (the pass only builds it from a matched, shape-checked site)."""
    ck, cv = codec_from_spec(spec_k), codec_from_spec(spec_v)
    b, hq, t, d = q.shape
    hkv, nb, r = k_data.shape[1], k_data.shape[2], ck.block_size
    g = hq // hkv
    dev = q.device
    qg = q.float().reshape(b, hkv, g * t, d)

    k_rows, k_row_scale = _rows(ck, k_data, k_scale, k_index)
    coef = _contract_d(qg, k_rows)  # (B, Hkv, GT, NB, R)
    if k_row_scale is not None:
        coef = coef * k_row_scale[:, :, None]
    s_arch = (coef[..., None, :] * _synthesis(ck, dev)).sum(-1).reshape(b, hkv, g * t, nb * r)
    s_tail = qg @ k_tail.float().transpose(-1, -2)  # (B, Hkv, GT, r)
    scores = torch.cat([s_arch, s_tail], dim=-1) * (1.0 / math.sqrt(d) if scale is None else scale)

    probs = stream_probabilities(scores, length, mask, r, t)

    p_arch = probs[..., : nb * r].reshape(b, hkv, g * t, nb, r, 1)
    p_coef = (p_arch * _synthesis(cv, dev)).sum(-2)  # (B, Hkv, GT, NB, R)
    v_rows, v_row_scale = _rows(cv, v_data, v_scale, v_index)
    if v_row_scale is not None:
        p_coef = p_coef * v_row_scale[:, :, None]
    out = _contract_rows(p_coef, v_rows) + probs[..., nb * r:] @ v_tail.float()
    return out.reshape(b, hq, t, d).to(q.dtype)
