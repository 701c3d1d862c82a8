"""ALiBi models whose attention modules compute attention themselves instead of calling transformers' attention
functions (BLOOM's ``BloomAttention``, MPT's ``MptAttention``): adapters that take the module's place while the codec
attention is installed (``apply_codec_attention``), so these models decode on the stored form too.

An adapter does what the module does (projections, ``cache.update``, the output projection) and attends through
:func:`~flashcodec_fx.hf.attention.model_reads`: on the stored form with per-head ALiBi slopes
(``flashcodec::codec_attention``'s ``alibi``: bias ``slope * position``), or, for the prompt, ``lossless`` and
fallbacks, with the module's own arithmetic over the tensors it reads (so ``lossless`` gives its tokens exactly).
Softmax is unchanged by a bias that is the same for every key of a query, so ``slope * position`` equals BLOOM's
``slope * (position - first non-padding position)`` and MPT's ``slope * (position - last position)``.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .attention import model_reads, stored_form_attention, take
from .handoff import COMPILED, dataflow


def alibi_slopes(num_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ALiBi slopes of ``num_heads`` heads ``(num_heads,)`` fp32 (Press et al.: a geometric sequence from
    ``2^(-8 / n)``, ``n`` the largest power of two <= ``num_heads``; the heads beyond ``n`` take every other slope of
    the ``2n`` sequence), as BLOOM builds its bias."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    slopes += [2.0 ** (-4.0 * i / n) for i in range(1, 2 * (num_heads - n), 2)]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def _bloom_forward(self, hidden_states: torch.Tensor, residual: torch.Tensor, alibi: torch.Tensor,
                   attention_mask: torch.Tensor | None, layer_past=None, use_cache: bool = False,
                   output_attentions: bool = False, **kwargs):
    """``BloomAttention.forward`` attending on the stored form (module docstring)."""
    b, t, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    step = None if dataflow() is COMPILED else take(self, key, value)
    dropout = self.attention_dropout.p if self.training else 0.0
    reads = model_reads(step, query, key, value, attention_mask, dropout, {"output_attentions": output_attentions})
    probs = None
    if reads is None:
        slopes = alibi_slopes(self.num_heads, query.device)
        out = stored_form_attention(query, step, attention_mask, self.inv_norm_factor * self.beta, alibi=slopes)
        context = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
    else:
        context, probs = _bloom_attend(self, query, *reads, alibi, attention_mask)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(self.pretraining_tp):
            output = output + F.linear(context[:, :, int(i * slices): int((i + 1) * slices)],
                                       self.dense.weight[:, int(i * slices): int((i + 1) * slices)])
    else:
        output = self.dense(context)
    output = F.dropout(output, p=self.hidden_dropout, training=self.training) + residual
    return output, probs


def _bloom_attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, alibi: torch.Tensor,
                  mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """BLOOM's own attention over ``key`` / ``value (B, H, L, D)``: ``(context (B, T, H * D), probs)``."""
    b, h, t, d = query.shape
    scores = alibi.baddbmm(batch1=query.reshape(b * h, t, d), batch2=key.reshape(b * h, -1, d).transpose(-1, -2),
                           beta=self.beta, alpha=self.inv_norm_factor).view(b, h, t, -1)
    if mask is not None:
        scores = scores + mask
    probs = self.attention_dropout(F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype))
    context = torch.bmm(probs.view(b * h, t, -1), value.reshape(b * h, -1, d))
    return self._merge_heads(context), probs


def _mpt_forward(self, hidden_states: torch.Tensor, position_bias: torch.Tensor | None, cache=None,
                 attention_mask: torch.Tensor | None = None, past_key_values=None, **kwargs):
    """``MptAttention.forward`` attending on the stored form (module docstring); ``past_key_values``: transformers
    < 5.24's name of ``cache``."""
    cache = past_key_values if cache is None else cache
    b, t = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (x.reshape(b, t, self.n_heads, self.head_dim).transpose(1, 2) for x in mixed.chunk(3, dim=2))
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    step = None if dataflow() is COMPILED else take(self, key, value)
    dropout = self.attn_dropout_p if self.training else 0.0
    reads = model_reads(step, query, key, value, attention_mask, dropout, {})
    probs = None
    if reads is None:
        slopes = None if position_bias is None else (position_bias[:, 0, -1] - position_bias[:, 0, -2]).float()
        mask = None if attention_mask is None else ~attention_mask  # MPT's mask: True where masked
        out = stored_form_attention(query, step, mask, self.softmax_scale, alibi=slopes)
        context = out.transpose(1, 2).reshape(b, t, -1)
    else:
        query_length = t if cache is None else t + cache.get_seq_length()  # as MptAttention counts it
        context, probs = _mpt_attend(self, query, *reads, position_bias, attention_mask, query_length)
    return self.out_proj(context), probs


def _mpt_attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position_bias: torch.Tensor | None,
                mask: torch.Tensor | None, query_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MPT's own attention over ``key`` / ``value (B, H, L, D)``: ``(context (B, T, H * D), probs)``."""
    b, _, t, _ = query.shape
    scores = torch.matmul(query, key.transpose(-1, -2)) * self.softmax_scale
    if position_bias is not None:
        rows, cols = max(0, position_bias.size(1) - query_length), max(0, position_bias.size(2) - key.shape[-2])
        scores = scores + position_bias[:, rows:, cols:]
    if mask is not None:
        scores = scores.masked_fill(mask, torch.finfo(query.dtype).min)
    probs = F.softmax(scores.float(), dim=-1).to(value.dtype)
    probs = F.dropout(probs, p=self.attn_dropout_p, training=self.training)
    context = torch.matmul(probs, value).permute(0, 2, 1, 3).contiguous().view(b, t, -1)
    return context, probs


ADAPTERS: dict[str, Callable] = {"BloomAttention": _bloom_forward, "MptAttention": _mpt_forward}
"""Attention module class name -> the forward that serves it on the stored form."""


def adapted_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` an adapter serves."""
    return [m for m in model.modules() if type(m).__name__ in ADAPTERS]


def install(model: torch.nn.Module) -> int:
    """Put the adapters in place of the served modules' forwards (per instance); returns how many."""
    modules = adapted_modules(model)
    for module in modules:
        module.forward = types.MethodType(ADAPTERS[type(module).__name__], module)
    return len(modules)


def uninstall(model: torch.nn.Module) -> None:
    """Give the served modules their own forwards back."""
    for module in adapted_modules(model):
        vars(module).pop("forward", None)
