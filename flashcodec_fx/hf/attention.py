"""Attention on the stored form, eager, through transformers' ``AttentionInterface`` (registered name ``"kvcodec"``).

One decode dataflow: ``FlashCodecLayer.update`` returns the call's new keys and values as :class:`CodecStates`,
tensors that carry the layer that stored them; the ``"kvcodec"`` attention function receives them and attends:

- prefill (the layer was empty): on the exact prompt states, through the model's previous implementation (``"sdpa"``
  or ``"eager"``), and the layer is marked as served (``attention_bound``);
- later calls: :func:`flashcodec_fx.codec_decode_attention` on the layer's stored form, the call's own tokens read
  exactly, with the mask transformers passes (bool, additive or None), ``scaling`` and GQA; no ``(S, D)`` view.

Every other call (layers without a codec, linear layers, models not using a FlashCodecCache) runs the previous
implementation unchanged; a codec sliding-window layer is served like a full one (the mask bounds its window).
Calls the stored-form path cannot serve (``output_attentions``, dropout, a sliding window on a layer that is not a
codec ring, logit soft-capping, attention sinks, position bias, a multi-token call without a mask) attend on one
decode of the stored view, with a ``MaterializationFreeFallback`` warning, or raise ``NotImplementedError`` when the
cache was built with ``strict=True``. A call that receives other keys than those its codec layer handed out raises.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from .._compat import attn_implementation

NAME = "kvcodec"  # not "flashcodec": transformers treats every implementation name containing "flash" as flash attention
DELEGATES = ("sdpa", "eager")


class MaterializationFreeFallback(UserWarning):
    """A step that was to attend on the stored form attended on the decoded view instead (see docs/hf.md)."""


class CodecStates(torch.Tensor):
    """The new ``(B, H, T, D)`` keys or values of one call, carrying the :class:`FlashCodecLayer` that stored them
    (``codec_layer``) and whether the layer held tokens before the call (``codec_decode``). Any operation on it gives a
    plain tensor: only the ``"kvcodec"`` attention function reads the tag."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    codec_layer: Any
    codec_decode: bool


def tag_states(x: torch.Tensor, layer: Any, decode: bool) -> CodecStates:
    out = x.as_subclass(CodecStates)
    out.codec_layer, out.codec_decode = layer, decode
    return out


def plain(x: torch.Tensor) -> torch.Tensor:
    return x.as_subclass(torch.Tensor) if isinstance(x, CodecStates) else x


_delegate_of: dict[int, str] = {}  # id(config) -> implementation the model used before apply_codec_attention
# attention module -> weak reference to the codec layer whose prefill it served last (neither is kept alive by this)
_served: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _delegate(module: torch.nn.Module) -> Callable:
    name = _delegate_of.get(id(getattr(module, "config", None)), "sdpa")
    if name == "sdpa":
        return sdpa_attention_forward
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"no eager_attention_forward in {type(module).__module__} to delegate to")
    return eager


def _unsupported(query: torch.Tensor, mask: torch.Tensor | None, dropout: float, layer: Any, kwargs: dict) -> str | None:
    if kwargs.get("output_attentions"):
        return "output_attentions=True"
    if dropout:
        return "attention dropout"
    for name, what in (("sliding_window", "a sliding window"), ("softcap", "logit soft-capping"),
                       ("s_aux", "attention sinks"), ("position_bias", "a position bias")):
        if kwargs.get(name) is not None and not (name == "sliding_window" and layer.is_sliding):
            return what  # a codec sliding layer holds its window as a ring; the mask transformers builds bounds it
    if query.shape[2] > 1 and mask is None:
        return "a multi-token step without an explicit mask"
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4):
        return f"a {type(mask).__name__} mask (needs a 4D bool or additive tensor)"
    return None


def flashcodec_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``"kvcodec"`` attention implementation. ``query (B, Hq, T, D)``; returns ``(B, T, Hq, D)`` and None
    (like transformers' sdpa implementation)."""
    delegate = _delegate(module)
    if not isinstance(key, CodecStates) or torch.compiler.is_compiling():
        if not torch.compiler.is_compiling():
            _check_no_pending_hand_off(module)
        return delegate(module, query, plain(key), plain(value), attention_mask, dropout=dropout, scaling=scaling,
                        **kwargs)
    layer, decode = key.codec_layer, key.codec_decode
    key, value = plain(key), plain(value)
    try:
        return _attend(module, delegate, layer, decode, query, key, value, attention_mask, dropout, scaling, kwargs)
    finally:
        layer.finish_step()  # the step's state was read: a waiting offload may move it now


def _attend(module: torch.nn.Module, delegate: Callable, layer: Any, decode: bool, query: torch.Tensor,
            key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float,
            scaling: float | None, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not decode:
        layer.attention_bound = True
        _served[module] = weakref.ref(layer)
        return delegate(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if layer.stores_raw:  # the stored form is the tokens themselves: the model's own attention reads it, exactly
        key_view, value_view = layer.read_view((key, value))
        return delegate(module, query, key_view, value_view, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    reason = _unsupported(query, attention_mask, dropout, layer, kwargs)
    if reason is not None:
        if layer.strict:
            raise NotImplementedError(f"attention on the stored form does not support {reason} (strict=True)")
        warnings.warn(f"attention on the stored form does not support {reason}: this step attends on the decoded view",
                      MaterializationFreeFallback, stacklevel=3)
        key_view, value_view = layer.read_view((key, value))
        return delegate(module, query, key_view, value_view, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = layer.attend(query, attention_mask, scaling, (key, value))
    return out.transpose(1, 2).contiguous(), None


def _check_no_pending_hand_off(module: torch.nn.Module) -> None:
    """Raise when ``module`` served a codec layer's prefill and that layer handed this step's states to attention,
    but the call received other keys (the model changed K/V between ``cache.update`` and attention): attending on them
    would read this call's tokens only, a wrong answer."""
    served = _served.get(module)
    layer = None if served is None else served()
    if layer is not None and layer.handed_out:
        raise RuntimeError("the 'kvcodec' attention did not receive the keys its cache layer handed out for this step "
                           "(the model changes K/V between cache.update and attention): attention on the stored form "
                           "cannot serve this model; build the cache with materialization_free=False")


def flashcodec_mask(*args: Any, **kwargs: Any):
    """Mask interface for ``"kvcodec"``: the mask of the implementation the model used before (sdpa or eager)."""
    name = _delegate_of.get(id(kwargs.get("config")), "sdpa")
    return ALL_MASK_ATTENTION_FUNCTIONS[name](*args, **kwargs)


AttentionInterface.register(NAME, flashcodec_attention_forward)
AttentionMaskInterface.register(NAME, flashcodec_mask)


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
    """Switch ``model`` to the ``"kvcodec"`` attention implementation (see the module docstring).

    The model must currently use ``"sdpa"`` or ``"eager"`` (ValueError otherwise); calling it again is a no-op.
    Layers whose cache is not a FlashCodecLayer keep computing exactly as before.
    """
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    current = attn_implementation(model.config)
    if current == NAME:
        return
    if current not in DELEGATES:
        raise ValueError(f"apply_codec_attention needs a model using attn_implementation in {DELEGATES}, got {current!r}")
    configs = _configs(model)
    for config in configs:
        own = attn_implementation(config)
        _delegate_of[id(config)] = own if own in DELEGATES else current
    model.set_attn_implementation(NAME)
    model._flashcodec_previous_attn = current
    if attn_implementation(model.config) != NAME:
        remove_codec_attention(model)
        raise ValueError(f"{type(model).__name__} does not support switching its attention implementation")


def remove_codec_attention(model: torch.nn.Module) -> None:
    """Undo :func:`apply_codec_attention`: the model's previous implementation is set back (no-op if not applied)."""
    previous = getattr(model, "_flashcodec_previous_attn", None)
    if previous is None:
        return
    model.set_attn_implementation(previous)
    for config in _configs(model):
        _delegate_of.pop(id(config), None)
    del model._flashcodec_previous_attn
