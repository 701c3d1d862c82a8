"""Triton ``flashcodec::append_attention``: the Triton append launcher for each stream, then the Triton attention
launcher, after the fused op's own checks (nothing changes before they pass). Each launcher keeps its contract and
tolerance against the reference (``append.py``, ``attention.py``; docs/triton.md), so this composition has theirs.
A stream with trellis codes (``levels="tcq"``) is appended by the reference op (the Triton append has no Viterbi
encoder), then attended by the Triton kernels like any other.
"""

from __future__ import annotations

import torch

from ..reference.append import append_reference
from ..reference.append_attention import check_append_attention_args
from ..state import spec_codec, uses_trellis
from .append import triton_append
from .attention import triton_codec_attention


def triton_append_attention(q: torch.Tensor, k_state: list[torch.Tensor], v_state: list[torch.Tensor], spec_k: str,
                            spec_v: str, k_new: torch.Tensor, v_new: torch.Tensor, mask: torch.Tensor | None = None,
                            scale: float | None = None, softcap: float | None = None,
                            sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None) -> torch.Tensor:
    """Append ``k_new`` / ``v_new`` to the streams, then attention of ``q`` over them (same contract as
    :func:`~flashcodec_fx.ops.reference.append_attention.append_attention_reference`): three launches' worth of
    kernels, no host sync (except a trellis stream's reference append, which copies small tables from the host)."""
    check_append_attention_args(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, softcap, sinks, alibi)
    for state, new, spec, name in ((k_state, k_new, spec_k, "spec_k"), (v_state, v_new, spec_v, "spec_v")):
        append = append_reference if uses_trellis(spec_codec(name, spec)) else triton_append
        append(state, new, spec, None)
    return triton_codec_attention(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, scale, softcap, sinks,
                                  alibi)
