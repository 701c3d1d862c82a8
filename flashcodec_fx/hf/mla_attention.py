"""Attention of an MLA module on its layer's stored latent rows, in the absorbed form (no per-head K/V).

transformers' MLA modules (DeepSeek-V2/V3 and their kin) score ``q = [q_nope ; q_rot]`` against per-head keys
``[W_UK c ; k_rot]`` and read per-head values ``W_UV c``, where ``kv_b_proj.weight`` viewed ``(H, nope + v, rank)``
holds ``W_UK (H, nope, rank)`` and ``W_UV (H, v, rank)``. Folded into the query and the output:

    q . k_t   = (W_UK^T q_nope) . c_t + q_rot . k_rot_t = [W_UK^T q_nope ; q_rot] . [c_t ; k_rot_t]
    sum p v_t = W_UV (sum_t p_t c_t)        (+ the value bias, where ``kv_b_proj`` has one: the weights sum to 1)

so ``flashcodec::codec_attention`` runs on the stored rows as keys and as values (one KV head for all query heads),
and the output's first ``rank`` channels times ``W_UV`` are the heads' outputs. A key bias adds ``q_nope . b_k``, the
same to every position of a query: softmax does not see it.
"""

from __future__ import annotations

import torch

from .handoff import AttentionStep

MODULE_PARTS = ("kv_b_proj", "qk_nope_head_dim", "v_head_dim", "expand_kv")  # what the absorbed form reads of the module


def missing_parts(module: torch.nn.Module) -> list[str]:
    """The parts of :data:`MODULE_PARTS` ``module`` lacks (an MLA module of another shape)."""
    return [name for name in MODULE_PARTS if not hasattr(module, name)]


def absorbed_attention(module: torch.nn.Module, query: torch.Tensor, step: AttentionStep, mask: torch.Tensor | None,
                       scaling: float | None) -> torch.Tensor:
    """``query (B, H, T, nope + rope)`` over the step's stored rows ``[c ; k_rot]``: ``(B, T, H, v)`` as transformers'
    attention functions return it."""
    b, h, t, _ = query.shape
    nope, v, rank = module.qk_nope_head_dim, module.v_head_dim, step.latent
    weight = module.kv_b_proj.weight.view(h, nope + v, rank)
    w_uk, w_uv = weight[:, :nope], weight[:, nope:]
    q_latent = torch.einsum("bhtn,hnr->bhtr", query[..., :nope], w_uk)
    q_row = torch.cat([q_latent, query[..., nope:]], dim=-1)
    rows = step.keys
    out = torch.ops.flashcodec.codec_attention(q_row, rows.state, rows.state, rows.spec, rows.spec, step.key, step.key,
                                               mask, scaling)
    heads = torch.einsum("bhtr,hvr->bhtv", out[..., :rank], w_uv)
    bias = module.kv_b_proj.bias
    if bias is not None:
        heads = heads + bias.view(h, nope + v)[:, nope:][None, :, None, :]
    return heads.transpose(1, 2).contiguous()
