"""`flashcodec::codec_attention`: decode attention on stored coefficients, never on the (S, D) view.

Each archived block is ``X = A @ S`` (A the codec's ``(r, R)`` synthesis matrix, S its dense stored rows), so

    scores[p] = q . X[p] = ((q @ S^T) @ A^T)[p]        out = sum_p prob[p] X[p] = (prob @ A) @ S

per block; the open block's raw tail rows are attended directly in the same softmax.
"""

from __future__ import annotations

import math

import torch

from ..codecs import Encoded
from ._validate import check_length, check_state, spec_codec


def _check_mask(mask: torch.Tensor | None, b: int, hq: int, t: int) -> None:
    if mask is None:
        return
    ok = mask.dim() == 4 and mask.shape[0] in (1, b) and mask.shape[1] in (1, hq) and mask.shape[2] in (1, t)
    if not ok or not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise ValueError(f"mask must be bool (True = attend) or additive float of shape (1|B, 1|Hq, 1|T, L) with "
                         f"B={b}, Hq={hq}, T={t}, got {mask.dtype} {tuple(mask.shape)}")


def check_attention_args(q, k_state, v_state, spec_k, spec_v, mask):
    """Validate ``codec_attention`` arguments; returns ``(codec_k, codec_v)``."""
    ck, cv = spec_codec("spec_k", spec_k), spec_codec("spec_v", spec_v)
    check_state("k", ck, *k_state)
    check_state("v", cv, *v_state)
    if ck.block_size != cv.block_size:
        raise ValueError(f"spec_k and spec_v must share block_size, got {ck.block_size} and {cv.block_size}")
    if q.dim() != 4 or q.shape[3] != k_state[0].shape[4] or q.shape[0] != k_state[0].shape[0]:
        raise ValueError(f"q must be (B, Hq, T, D) matching the cache's B and D, got {tuple(q.shape)}")
    if k_state[0].shape[:3] != v_state[0].shape[:3] or k_state[3].shape[:2] != v_state[3].shape[:2]:
        raise ValueError("k and v states must have the same (B, H_kv, NB)")
    if v_state[0].shape[4] != q.shape[3]:
        raise ValueError(f"v states must have q's head_dim {q.shape[3]}, got {v_state[0].shape[4]}")
    if not q.dtype == k_state[3].dtype == v_state[3].dtype:
        raise ValueError(f"q dtype must match the streams' dtype (k_tail {k_state[3].dtype}, v_tail {v_state[3].dtype}), "
                         f"got {q.dtype}")
    if q.shape[1] % k_state[0].shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k_state[0].shape[1]})")
    _check_mask(mask, q.shape[0], q.shape[1], q.shape[2])
    return ck, cv


def stream_probabilities(scores: torch.Tensor, length: torch.Tensor, mask: torch.Tensor | None, block_size: int,
                         query_len: int) -> torch.Tensor:
    """Softmax of ``scores (B, H_kv, G * T, NB * r + r)`` over a stream's positions: the archive's ``0 .. NB*r - 1``
    (valid below the archived length ``length // r * r``), then the open block's ``r`` raw tail rows (valid below
    ``length``). ``mask`` (see :func:`codec_attention`) is added over those absolute positions; rows that see
    nothing get zeros. Shared by the reference op and the compile pass's inline lowering: plain ATen ops with
    scalar fills only (no constant tensor), so Inductor fuses it."""
    b, hkv, gt, total = scores.shape
    r, dev = block_size, scores.device
    start = torch.div(length, r, rounding_mode="floor") * r
    arch_pos = torch.arange(total - r, device=dev)
    tail_pos = start + torch.arange(r, device=dev)
    valid = torch.cat([arch_pos < start, tail_pos < length])
    if mask is not None:
        picked = mask.index_select(3, torch.cat([arch_pos, tail_pos]).clamp(max=mask.shape[3] - 1))
        if picked.dtype == torch.bool:
            picked = torch.where(picked, 0.0, float("-inf"))
        scores = scores + picked.float().expand(b, hkv * (gt // query_len), query_len, -1).reshape(b, hkv, gt, -1)
    scores = scores.masked_fill(~valid, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, 0.0)
    weights = torch.exp(scores - peak)
    denom = weights.sum(dim=-1, keepdim=True)
    return weights / torch.where(denom > 0, denom, 1.0)


@torch.library.custom_op("flashcodec::codec_attention", mutates_args=())
def codec_attention(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, k_index: torch.Tensor,
                    k_tail: torch.Tensor, v_data: torch.Tensor, v_scale: torch.Tensor, v_index: torch.Tensor,
                    v_tail: torch.Tensor, length: torch.Tensor, spec_k: list[int], spec_v: list[int],
                    mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of ``q (B, Hq, T, D)`` over the first ``length`` stored tokens; returns ``(B, Hq, T, D)`` in q's dtype.

    GQA: query head ``i`` reads kv head ``i // (Hq // H_kv)``. ``mask``: bool (True = attend) or additive float,
    ``(1|B, 1|Hq, 1|T, L)`` over absolute positions ``0..L-1`` with ``L >= length``; without a mask every query
    sees every stored token. ``scale`` defaults to ``1 / sqrt(D)``. Accumulates in fp32.
    """
    ck, cv = check_attention_args(q, (k_data, k_scale, k_index, k_tail), (v_data, v_scale, v_index, v_tail),
                                  spec_k, spec_v, mask)
    check_length(length)
    b, hq, t, d = q.shape
    hkv, nb, r = k_data.shape[1], k_data.shape[2], ck.block_size
    g = hq // hkv
    dev = q.device
    qg = q.float().reshape(b, hkv, g * t, d)
    sk = ck.stored_rows(Encoded(k_data, k_scale, k_index))
    sv = cv.stored_rows(Encoded(v_data, v_scale, v_index))

    coef = torch.einsum("bhqd,bhnrd->bhqnr", qg, sk)
    s_arch = torch.einsum("bhqnr,pr->bhqnp", coef, ck.synthesis(dev)).reshape(b, hkv, g * t, nb * r)
    s_tail = qg @ k_tail.float().transpose(-1, -2)
    scores = torch.cat([s_arch, s_tail], dim=-1) * (1.0 / math.sqrt(d) if scale is None else scale)

    probs = stream_probabilities(scores, length, mask, r, t)

    p_arch = probs[..., : nb * r].reshape(b, hkv, g * t, nb, r)
    p_coef = torch.einsum("bhqnp,pr->bhqnr", p_arch, cv.synthesis(dev))
    out = torch.einsum("bhqnr,bhnrd->bhqd", p_coef, sv) + probs[..., nb * r:] @ v_tail.float()
    return out.reshape(b, hq, t, d).to(q.dtype)


@codec_attention.register_fake
def _(q, k_data, k_scale, k_index, k_tail, v_data, v_scale, v_index, v_tail, length, spec_k, spec_v,
      mask=None, scale=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
