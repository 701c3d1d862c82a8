"""`flashcodec::append_attention`: one decode step of a codec layer, both appends and attention in one op.

The op IS the three ops it fuses, in this order (:func:`append_attention_reference`, its default kernel):

    append(k_state, k_new, spec_k, None)
    append(v_state, v_new, spec_v, None)
    return codec_attention(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, scale, softcap, sinks, alibi)

so a fast kernel is tested against those calls: the stream states it leaves bitwise theirs, its output within the
attention kernel's tolerance of theirs. Every argument is checked before any state changes
(:func:`check_append_attention_args`: ValueError / TypeError naming the parameter).

Why one op: a step of three custom-op calls paid the dispatcher and three launchers' Python three times, a fixed cost
that decode attention at a few hundred tokens does not hide. So the op is defined with ``torch.library.Library``
(``define`` + ``impl``): its dispatch costs a fraction of a ``torch.library.custom_op`` with mutated tensor lists (no
Python autograd / version-counter layer around the kernel); it is still a registered op with a schema that declares
the mutated lists, a fake kernel, opcheck and torch.compile (auto-functionalized). The kernels registered per device
are kept in :data:`KERNELS` (:func:`register_kernel`), the table ``kernel_report`` and the Triton gate read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .append import append
from .attention import check_attention_args, check_variants, codec_attention

NAME = "append_attention"
QUALNAME = f"flashcodec::{NAME}"
SCHEMA = (f"{NAME}(Tensor q, Tensor(a!)[] k_state, Tensor(b!)[] v_state, str spec_k, str spec_v, Tensor k_new, "
          "Tensor v_new, Tensor? mask=None, float? scale=None, float? softcap=None, Tensor? sinks=None, "
          "Tensor? alibi=None) -> Tensor")
DISPATCH_KEYS = {None: "CompositeExplicitAutograd", "cpu": "CPU", "cuda": "CUDA"}


def check_append_attention_args(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, softcap=None, sinks=None,
                                alibi=None):
    """Validate ``append_attention``'s arguments (every kernel's launcher calls this before changing anything): the
    append checks of both streams (``k_new`` / ``v_new`` ``(B, H_kv, T, D)`` in the stream dtype) and attention's;
    returns ``(codec_k, codec_v, k_state, v_state)``."""
    for name, x in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    return check_attention_args(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, softcap, sinks, alibi)


def append_attention_reference(q: torch.Tensor, k_state: list[torch.Tensor], v_state: list[torch.Tensor],
                               spec_k: str, spec_v: str, k_new: torch.Tensor, v_new: torch.Tensor,
                               mask: torch.Tensor | None = None, scale: float | None = None,
                               softcap: float | None = None, sinks: torch.Tensor | None = None,
                               alibi: torch.Tensor | None = None) -> torch.Tensor:
    """Append ``k_new`` / ``v_new (B, H_kv, T, D)`` to the streams (``k_state`` / ``v_state`` mutated in place), then
    attention of ``q (B, Hq, T, D)`` over them with the call's own tokens read exactly: the ``flashcodec::append``
    and ``flashcodec::codec_attention`` ops themselves (each served by its kernel for the tensors' device), so this
    is their contract, arguments and results alike (``mask``, ``scale`` and the variants as in
    ``codec_attention_reference``)."""
    check_append_attention_args(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, softcap, sinks, alibi)
    append(k_state, k_new, spec_k, None)
    append(v_state, v_new, spec_v, None)
    return codec_attention(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, scale, softcap, sinks, alibi)


def _fake(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask=None, scale=None, softcap=None, sinks=None,
          alibi=None):
    check_variants(q, softcap, sinks, alibi)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


_LIBRARY = torch.library.Library("flashcodec", "FRAGMENT")  # the op's definition (kept alive with the module)
_LIBRARY.define(SCHEMA)
_LIBRARY.impl(NAME, append_attention_reference, DISPATCH_KEYS[None])
torch.library.register_fake(QUALNAME, _fake, lib=_LIBRARY)
KERNELS: dict[str | None, Callable] = {None: append_attention_reference}  # device type (None: default) -> kernel
_DEVICE_LIBRARIES: dict[str, torch.library.Library] = {}  # one per device kernel, so that it can be replaced

append_attention = torch.ops.flashcodec.append_attention


def register_kernel(device: str, fn: Callable) -> None:
    """Make ``fn`` the op's kernel for ``device`` (``"cpu"`` or ``"cuda"``; registering it again is a no-op, another
    function replaces it). Not ``torch.library.register_kernel``: that wraps the kernel in a Dynamo-disabling layer
    whose cost a decode step pays for nothing (Dynamo never traces into a kernel of a registered op)."""
    if KERNELS.get(device) is fn:
        return
    old = _DEVICE_LIBRARIES.pop(device, None)
    if old is not None:
        old._destroy()
    library = torch.library.Library("flashcodec", "FRAGMENT")
    library.impl(NAME, fn, DISPATCH_KEYS[device])
    _DEVICE_LIBRARIES[device] = library
    KERNELS[device] = fn


def library_op_kernels(qualname: str) -> dict[str | None, Callable] | None:
    """The kernels by device type of an op defined here with ``torch.library.Library`` (None for another op)."""
    return dict(KERNELS) if qualname == QUALNAME else None
