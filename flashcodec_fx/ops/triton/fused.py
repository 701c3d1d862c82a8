"""Triton ``flashcodec::append_attention``: the Triton append launcher for each stream, then the Triton attention
launcher, after the fused op's own checks (nothing changes before they pass). Each launcher keeps its contract and
tolerance against the reference (``append.py``, ``attention.py``; docs/triton.md), so this composition has theirs.
"""

from __future__ import annotations

import torch

from ..reference.append_attention import check_append_attention_args
from .append import triton_append
from .attention import triton_codec_attention


def triton_append_attention(q: torch.Tensor, k_state: list[torch.Tensor], v_state: list[torch.Tensor], spec_k: str,
                            spec_v: str, k_new: torch.Tensor, v_new: torch.Tensor, mask: torch.Tensor | None = None,
                            scale: float | None = None, softcap: float | None = None,
                            sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None) -> torch.Tensor:
    """Append ``k_new`` / ``v_new`` to the streams, then attention of ``q`` over them (same contract as
    :func:`~flashcodec_fx.ops.reference.append_attention.append_attention_reference`): three launches' worth of
    kernels, no host sync."""
    check_append_attention_args(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, softcap, sinks, alibi)
    triton_append(k_state, k_new, spec_k, None)
    triton_append(v_state, v_new, spec_v, None)
    return triton_codec_attention(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, scale, softcap, sinks,
                                  alibi)
