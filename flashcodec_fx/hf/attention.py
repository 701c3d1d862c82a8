"""Attention on the stored form, eager, through transformers' ``AttentionInterface``: ``"kvcodec"`` over the model's
``"sdpa"`` and ``"kvcodec_eager"`` over its ``"eager"`` implementation (the delegate: the registered name says which).

One decode dataflow: ``FlashCodecLayer.update`` returns the call's new keys and values and hands the attention call
that follows an :class:`AttentionStep`: a typed record (the keys and values it returns, a snapshot of both streams'
stored form as the ops read it, what attention needs to know of the layer) passed through one forward-context slot
(as vLLM's forward context), never tagged onto tensors and never a call back into the layer. The ``"kvcodec"``
function :func:`take` s it when the keys it receives are the ones handed out (identity: any operation on them makes a
new tensor): the slot is emptied and the step's :class:`StepStatus`, which the layer keeps, says it was taken. Only
the slot and the attention call hold the snapshot, so it lives for one call: an offload right after the update moves
the streams while attention still reads this step's device tensors, freed when it returns. Then it attends:

- prefill (the layer was empty): on the exact prompt states, through the delegate;
- later calls: ``torch.ops.flashcodec.codec_attention`` on the step's stored form, the call's own tokens read exactly,
  with the mask transformers passes (bool, additive or None), ``scaling`` and GQA; no ``(S, D)`` view.

Every other call (layers without a codec, linear layers, models not using a FlashCodecCache) runs the delegate
unchanged; a codec sliding-window layer is served like a full one (the mask bounds its window). Calls the stored-form
path cannot serve (``output_attentions``, dropout, a sliding window on a layer that is not a codec ring, logit
soft-capping, attention sinks, position bias, a multi-token call without a mask) attend on one decode of the stored
view, with a ``MaterializationFreeFallback`` warning, or raise ``NotImplementedError`` when the cache was built with
``strict=True``. A call that receives other keys than those a codec layer handed out for a decode step raises.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from .._compat import attn_implementation

NAME = "kvcodec"  # not "flashcodec": transformers treats every implementation name containing "flash" as flash attention
IMPLEMENTATIONS = {"sdpa": NAME, "eager": f"{NAME}_eager"}  # the model's implementation -> ours over it
DELEGATES = tuple(IMPLEMENTATIONS)
NAMES = tuple(IMPLEMENTATIONS.values())


class MaterializationFreeFallback(UserWarning):
    """A step that was to attend on the stored form attended on the decoded view instead (see docs/hf.md)."""


# --- the step a layer hands attention ---------------------------------------------------------------------

@dataclass(frozen=True)
class StoredStream:
    """One stream's stored form as ``torch.ops.flashcodec`` reads it: ``state`` (the 9 tensors of
    :class:`~flashcodec_fx.ops.StreamState`), ``spec``, and ``length`` (stored tokens, host int; None: static layout,
    whose views span the capacity)."""

    state: list[torch.Tensor]
    spec: str
    length: int | None

    def view(self, new: torch.Tensor) -> torch.Tensor:
        """The decoded ``(B, H, L, D)`` view, this call's tokens ``new (B, H, T, D)`` read exactly."""
        view = torch.ops.flashcodec.read(self.state, self.spec, new)
        return view if self.length is None else view[:, :, : self.length]


@dataclass
class StepStatus:
    """What the layer keeps of a step it handed out: whether it was a decode step, and whether attention took it."""

    decode: bool
    taken: bool = False


@dataclass(frozen=True)
class AttentionStep:
    """What one codec layer's update hands its attention call.

    ``key`` / ``value``: the ``(B, H, T, D)`` tensors the update returned (the call's exact states); ``keys`` /
    ``values``: the streams' stored form after the append; ``views``: the ``(B, H, L, D)``
    views to attend on when the stored form is the tokens themselves (lossless: zero-copy), else None; ``strict``: no
    fallback to the decoded view; ``sliding``: a codec ring (the mask transformers passes bounds its window);
    ``status``: shared with the layer."""

    key: torch.Tensor
    value: torch.Tensor
    keys: StoredStream
    values: StoredStream
    views: tuple[torch.Tensor, torch.Tensor] | None
    strict: bool
    sliding: bool
    status: StepStatus

    @property
    def decode(self) -> bool:
        return self.status.decode

    def decoded_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoded views of both streams, this call's tokens exact (one decode: the fallback path)."""
        return self.keys.view(self.key), self.values.view(self.value)


_current: ContextVar[AttentionStep | None] = ContextVar("flashcodec_attention_step", default=None)


def hand_off(step: AttentionStep) -> None:
    """Make ``step`` the current step (replacing the previous one, taken or not)."""
    _current.set(step)


def current() -> AttentionStep | None:
    """The step handed out and not taken yet (None when there is none)."""
    return _current.get()


def take(key: torch.Tensor) -> AttentionStep | None:
    """The current step when ``key`` is the key it handed out (the slot emptied, the step marked taken), else None."""
    step = _current.get()
    if step is None or step.key is not key:
        return None
    _current.set(None)
    step.status.taken = True
    return step


def drop(status: StepStatus) -> None:
    """Empty the slot if it holds the step of ``status`` (a layer that resets forgets what it handed out)."""
    step = _current.get()
    if step is not None and step.status is status:
        _current.set(None)


# --- the attention implementations -------------------------------------------------------------------------


def _delegate(module: torch.nn.Module, delegate: str) -> Callable:
    if delegate == "sdpa":
        return sdpa_attention_forward
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"no eager_attention_forward in {type(module).__module__} to delegate to")
    return eager


def _unsupported(query: torch.Tensor, mask: torch.Tensor | None, dropout: float, step: AttentionStep,
                 kwargs: dict) -> str | None:
    if kwargs.get("output_attentions"):
        return "output_attentions=True"
    if dropout:
        return "attention dropout"
    for name, what in (("sliding_window", "a sliding window"), ("softcap", "logit soft-capping"),
                       ("s_aux", "attention sinks"), ("position_bias", "a position bias")):
        if kwargs.get(name) is not None and not (name == "sliding_window" and step.sliding):
            return what  # a codec sliding layer holds its window as a ring; the mask transformers builds bounds it
    if query.shape[2] > 1 and mask is None:
        return "a multi-token step without an explicit mask"
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4):
        return f"a {type(mask).__name__} mask (needs a 4D bool or additive tensor)"
    return None


def _forward(delegate: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
             kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    run = _delegate(module, delegate)
    step = None if torch.compiler.is_compiling() else take(key)
    if step is None:
        if not torch.compiler.is_compiling():
            _check_no_pending_step()
        return run(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if not step.decode:  # the prompt attends on its exact states
        return run(module, query, step.key, step.value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if step.views is not None:  # the stored form is the tokens themselves: the delegate reads it, exactly
        return run(module, query, *step.views, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    reason = _unsupported(query, attention_mask, dropout, step, kwargs)
    if reason is not None:
        if step.strict:
            raise NotImplementedError(f"attention on the stored form does not support {reason} (strict=True)")
        warnings.warn(f"attention on the stored form does not support {reason}: this step attends on the decoded view",
                      MaterializationFreeFallback, stacklevel=4)
        return run(module, query, *step.decoded_views(), attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return stored_form_attention(query, step, attention_mask, scaling).transpose(1, 2).contiguous(), None


def stored_form_attention(query: torch.Tensor, step: AttentionStep, mask: torch.Tensor | None,
                          scaling: float | None) -> torch.Tensor:
    """``query (B, Hq, T, D)`` over the step's stored form, its own keys and values read exactly: ``(B, Hq, T, D)``."""
    keys, values = step.keys, step.values
    return torch.ops.flashcodec.codec_attention(query, keys.state, values.state, keys.spec, values.spec, step.key,
                                                step.value, mask, scaling)


def flashcodec_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``"kvcodec"`` attention implementation (over sdpa). ``query (B, Hq, T, D)``; returns ``(B, T, Hq, D)``
    and None (like transformers' sdpa implementation)."""
    return _forward("sdpa", module, query, key, value, attention_mask, dropout, scaling, kwargs)


def flashcodec_eager_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                       value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                       scaling: float | None = None,
                                       **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``"kvcodec_eager"`` attention implementation: as ``"kvcodec"``, over the model's eager implementation."""
    return _forward("eager", module, query, key, value, attention_mask, dropout, scaling, kwargs)


def _check_no_pending_step() -> None:
    """Raise when a codec layer handed out a decode step that no attention call took, and this call received other
    keys (the model changed K/V between ``cache.update`` and attention): attending on them would read this call's
    tokens only, a wrong answer."""
    step = current()
    if step is not None and step.decode:
        raise RuntimeError("the 'kvcodec' attention did not receive the keys its cache layer handed out for this step "
                           "(the model changes K/V between cache.update and attention): attention on the stored form "
                           "cannot serve this model; build the cache with materialization_free=False")


for _delegate_name, _forward_fn in (("sdpa", flashcodec_attention_forward), ("eager", flashcodec_eager_attention_forward)):
    AttentionInterface.register(IMPLEMENTATIONS[_delegate_name], _forward_fn)
    AttentionMaskInterface.register(IMPLEMENTATIONS[_delegate_name], ALL_MASK_ATTENTION_FUNCTIONS[_delegate_name])


def _configs(model: torch.nn.Module) -> list[Any]:
    seen, out = set(), []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and id(config) not in seen:
            seen.add(id(config))
            out.append(config)
            for name in getattr(config, "sub_configs", {}):
                sub = getattr(config, name, None)
                if sub is not None and hasattr(sub, "_attn_implementation") and id(sub) not in seen:
                    seen.add(id(sub))
                    out.append(sub)
    return out


def apply_codec_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to the ``"kvcodec"`` attention implementation over the one it uses (see the module docstring):
    ``"kvcodec"`` over ``"sdpa"``, ``"kvcodec_eager"`` over ``"eager"``, per config (a sub-config on the other one keeps
    it as its delegate).

    The model must currently use ``"sdpa"`` or ``"eager"`` (ValueError otherwise); calling it again is a no-op.
    Layers whose cache is not a FlashCodecLayer keep computing exactly as before.
    """
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    current_name = attn_implementation(model.config)
    if current_name in NAMES:
        return
    if current_name not in DELEGATES:
        raise ValueError(f"apply_codec_attention needs a model using attn_implementation in {DELEGATES}, got "
                         f"{current_name!r}")
    own = [(config, attn_implementation(config)) for config in _configs(model)]
    model.set_attn_implementation(IMPLEMENTATIONS[current_name])
    model._flashcodec_previous_attn = current_name
    if attn_implementation(model.config) != IMPLEMENTATIONS[current_name]:
        remove_codec_attention(model)
        raise ValueError(f"{type(model).__name__} does not support switching its attention implementation")
    for config, was in own:
        if was in DELEGATES and was != current_name:
            config._attn_implementation = IMPLEMENTATIONS[was]


def remove_codec_attention(model: torch.nn.Module) -> None:
    """Undo :func:`apply_codec_attention`: the model's previous implementation is set back, and each sub-config's
    (no-op if not applied)."""
    previous = getattr(model, "_flashcodec_previous_attn", None)
    if previous is None:
        return
    delegates = {name: delegate for delegate, name in IMPLEMENTATIONS.items()}
    own = [(config, delegates.get(attn_implementation(config))) for config in _configs(model)]
    model.set_attn_implementation(previous)
    for config, was in own:
        if was is not None and was != previous:
            config._attn_implementation = was
    del model._flashcodec_previous_attn
