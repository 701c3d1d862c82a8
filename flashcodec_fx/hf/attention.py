"""Attention on the stored form, eager, through transformers' ``AttentionInterface``: ``"kvcodec"`` over the model's
``"sdpa"`` and ``"kvcodec_eager"`` over its ``"eager"`` implementation (the delegate: the registered name says which).

A codec layer's update hands the attention call that follows an :class:`~flashcodec_fx.hf.handoff.AttentionStep`
(the keys and values it returns, a snapshot of both streams' stored form as the ops read it, what attention needs to
know of the layer), put in a table by layer index (:mod:`flashcodec_fx.hf.handoff`): the ``"kvcodec"`` function
:func:`take` s the step of its module's ``layer_idx``, or the one whose very tensors it receives (cache offsets, KV
sharing). The keys and values it receives must be those the layer returned (a check: a model that changed K/V between
``cache.update`` and attention would get an answer over other tensors than its own, so a decode step raises). A
sparse-attention module's ``indices=`` are folded into the mask first (:func:`index_mask`). Then it attends:

- prefill (the layer was empty): on the exact prompt states, through the delegate;
- later calls: ``torch.ops.flashcodec.codec_attention`` on the step's stored form, the call's own tokens read exactly,
  with the mask transformers passes (bool, additive or None; a ``position_bias`` folded in: Inkling), ``scaling``,
  GQA, logit soft-capping (``softcap``: Gemma 2) and attention-sink logits (``s_aux``: GPT-OSS); no ``(S, D)`` view;
- an MLA module's calls: in the absorbed form on its stored latent rows (:mod:`flashcodec_fx.hf.mla_attention`).

ALiBi models, whose attention modules do not call an attention function (BLOOM, MPT), are served by module adapters
(:mod:`flashcodec_fx.hf.alibi`) that use :func:`model_reads` and :func:`stored_form_attention` the same way.

Every other call (layers without a codec, linear layers, models not using a FlashCodecCache, compiled steps) runs the
delegate unchanged; a codec sliding-window layer is served like a full one (the mask bounds its window). Calls the
stored-form path cannot serve (``output_attentions``, dropout, per-token sink logits, a multi-token call without a
mask, a mask over fewer keys than the layer holds) attend on one decode of the stored view, with a
``MaterializationFreeFallback`` warning, or raise ``NotImplementedError`` when the cache was built with
``strict=True``. Models known not to be served (:data:`NOT_SERVED`, or that cannot switch implementations) are refused
by :func:`apply_codec_attention`, so ``apply_flash_codec`` chooses the decoded view for them at apply time.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from .._compat import attn_implementation
from .handoff import COMPILED, AttentionStep, current_table, dataflow
from .mla_attention import MODULE_PARTS, absorbed_attention, missing_parts

NAME = "kvcodec"  # not "flashcodec": transformers treats every implementation name containing "flash" as flash attention
IMPLEMENTATIONS = {"sdpa": NAME, "eager": f"{NAME}_eager"}  # the model's implementation -> ours over it
DELEGATES = tuple(IMPLEMENTATIONS)
NAMES = tuple(IMPLEMENTATIONS.values())


class MaterializationFreeFallback(UserWarning):
    """A step that was to attend on the stored form attended on the decoded view instead (see docs/hf.md)."""


def take(module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor) -> AttentionStep | None:
    """The step a codec layer handed this call, taken out of the current table; None when it handed none (layers
    without a codec, other caches). The step at ``module.layer_idx`` when ``key`` / ``value`` are what it returned;
    else the step handed last when they are the very tensors it returned (a model that updates the cache at another
    index: a cache offset, a shared attention block); else a decode step taken before whose tensors they are (KV
    sharing: :meth:`StepTable.shared`). Raises ``RuntimeError`` when a decode step is pending and the call did not
    receive the keys and values it returned (the model changes K/V between ``cache.update`` and attention: attending
    on them would read this call's tokens only, a wrong answer); a prompt step with other tensors stays untaken (its
    layer then attends on the decoded view, warned). A step is owed to this call only when it is the one handed last
    (:attr:`StepTable.fresh`) and ``key`` has its shape: one a forward left behind (an exception between update and
    attention, then a model on another cache in this context) is not; it stays, and its layer's next update reports
    it untaken."""
    table = current_table()
    if table is None:
        return None
    layer_idx = getattr(module, "layer_idx", None)
    fresh = table.fresh
    step = table.pop(layer_idx, None)
    if step is not None and step.received(key, value):
        if fresh == layer_idx:
            table.fresh = None
        return table.taken(layer_idx, step)
    if step is not None:
        table[layer_idx] = step  # not for these keys: it stays (the layer's next update finds it untaken)
    last = table.get(fresh)
    if last is not None and last.key is key and last.value is value:  # handed at another index: its very tensors
        del table[fresh]
        table.fresh = None
        return table.taken(fresh, last)
    shared = table.shared(key, value)
    if shared is not None:
        return shared
    if fresh == layer_idx:
        table.fresh = None
    if step is None:
        step, owed = last, last is not None
    else:
        owed = fresh == layer_idx and step.key.shape == key.shape
    if owed and step.decode:
        raise RuntimeError("the 'kvcodec' attention did not receive the keys its cache layer handed out for this step "
                           "(the model changes K/V between cache.update and attention): attention on the stored form "
                           "cannot serve this model; build the cache with materialization_free=False")
    return None


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
    # a sliding_window keyword needs nothing: the delegates (sdpa, eager) read the window from the mask transformers
    # builds for the layer, and so does the stored form
    if kwargs.get("sinks") is not None:
        return "per-token sink logits (sinks=)"
    if query.shape[2] > 1 and mask is None:
        return "a multi-token step without an explicit mask"
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4):
        return f"a {type(mask).__name__} mask (needs a 4D bool or additive tensor)"
    held = step.keys.length
    if mask is not None and held is not None and mask.shape[3] < held:  # a mask built for other keys than the layer's
        return f"a mask over {mask.shape[3]} keys (the layer holds {held})"
    return None


def model_reads(step: AttentionStep | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: torch.Tensor | None, dropout: float, kwargs: dict,
                stacklevel: int = 5) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What the model's own attention reads for this call, or None: attend on the step's stored form. The call's
    own ``key`` / ``value`` (no step: another cache or a layer without a codec), the prompt's exact states, the
    stored tokens themselves (a raw stored form: lossless), or, for a call the stored form cannot serve, the decoded
    views (warned ``MaterializationFreeFallback``; ``strict=True`` raises ``NotImplementedError`` instead)."""
    if step is None:
        return key, value
    if not step.decode:  # the prompt attends on its exact states
        return step.key, step.value
    if step.views is not None:  # the stored form is the tokens themselves: the model reads it, exactly
        return step.views
    reason = _unsupported(query, mask, dropout, step, kwargs)
    if reason is None:
        return None
    if step.strict:
        if step.pending:
            step.append_now()
        raise NotImplementedError(f"attention on the stored form does not support {reason} (strict=True)")
    warnings.warn(f"attention on the stored form does not support {reason}: this step attends on the decoded view",
                  MaterializationFreeFallback, stacklevel=stacklevel)
    if step.pending:
        step.append_now()
    return step.decoded_views()


def _forward(delegate: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
             kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    run = _delegate(module, delegate)
    if kwargs.get("indices") is not None:  # sparse attention: the keys its indexer selected, as sdpa / eager get them
        keys = key.shape[2] if attention_mask is None else attention_mask.shape[-1]  # a codec layer's key: the step's
        attention_mask = index_mask(attention_mask, kwargs.pop("indices"), keys, query.dtype)
    step = None if dataflow() is COMPILED else take(module, key, value)
    if step is not None and step.latent is not None:
        return _latent_forward(run, module, query, key, value, attention_mask, dropout, scaling, step, kwargs)
    reads = model_reads(step, query, key, value, attention_mask, dropout, kwargs)
    if reads is not None:
        return run(module, query, *reads, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = stored_form_attention(query, step, _biased(attention_mask, kwargs, key.dtype), scaling,
                                softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None


def _biased(mask: torch.Tensor | None, kwargs: dict, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask the stored form attends with: ``mask`` with an additive ``position_bias`` (Inkling's relative logits,
    ``(B, Hq, T, L)`` over the mask's keys) folded in, as transformers' sdpa integration folds it (bool mask: the bias
    where True, the dtype's minimum elsewhere; additive: summed); the eager delegates add it to the scores alike."""
    bias = kwargs.get("position_bias")
    if bias is None:
        return mask
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, max(torch.finfo(dtype).min, torch.finfo(bias.dtype).min))
    return bias + mask


def index_mask(mask: torch.Tensor | None, indices: torch.Tensor, keys: int, dtype: torch.dtype) -> torch.Tensor:
    """``mask (B, 1, T, keys)`` (bool or additive; None: every key visible) with the keys a sparse-attention indexer
    did not select masked: ``indices (B, T, k)`` the selected key positions. What DeepSeek-V3.2-style attention modules
    (DeepSeek-V3.2, GLM-MoE-DSA, A.X K2, HY-V4, ...) do themselves for ``"sdpa"`` / ``"eager"``; under any other
    implementation name they pass ``indices=`` to the attention function instead."""
    b, t = indices.shape[:2]
    hidden = indices.new_ones((b, t, keys), dtype=torch.bool).scatter(-1, indices.long(), False).unsqueeze(1)
    if mask is None:
        return ~hidden
    if mask.dtype == torch.bool:
        return mask & ~hidden
    return mask.masked_fill(hidden, torch.finfo(dtype).min)


def _latent_forward(run: Callable, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, step: AttentionStep,
                    kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An MLA module's call (:mod:`flashcodec_fx.hf.mla_attention`): the prompt on the K/V the module expanded from
    its exact latents; ``lossless`` on the stored rows expanded by the module (its own arithmetic); decode steps in
    the absorbed form on the stored rows."""
    if not step.decode:
        return run(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    missing = missing_parts(module)
    if missing:
        raise NotImplementedError(f"attention on the stored latent needs an MLA module with {list(MODULE_PARTS)}; "
                                  f"{type(module).__name__} lacks {missing}")
    reads = model_reads(step, query, key, value, attention_mask, dropout, kwargs, stacklevel=6)
    if reads is not None:  # lossless or a fallback: the module expands the stored rows, as it does natively
        return run(module, query, *module.expand_kv(*reads), attention_mask, dropout=dropout, scaling=scaling,
                   **kwargs)
    return absorbed_attention(module, query, step, _biased(attention_mask, kwargs, query.dtype), scaling), None


def stored_form_attention(query: torch.Tensor, step: AttentionStep, mask: torch.Tensor | None, scaling: float | None,
                          softcap: float | None = None, sinks: torch.Tensor | None = None,
                          alibi: torch.Tensor | None = None) -> torch.Tensor:
    """``query (B, Hq, T, D)`` over the step's stored form, its own keys and values read exactly: ``(B, Hq, T, D)``; a
    pending step's keys and values appended to the streams by the same op call (``flashcodec::append_attention``:
    one op per layer and step).
    ``softcap`` (logit soft-capping), ``sinks`` (per query head sink logits), ``alibi`` (per query head slopes): as
    ``flashcodec::codec_attention`` takes them."""
    keys, values = step.keys, step.values
    op = torch.ops.flashcodec.append_attention if step.pending else torch.ops.flashcodec.codec_attention
    return op(query, keys.state, values.state, keys.spec, values.spec, step.key, step.value, mask, scaling,
              softcap=softcap, sinks=sinks, alibi=alibi)


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


for _delegate_name, _forward_fn in (("sdpa", flashcodec_attention_forward), ("eager", flashcodec_eager_attention_forward)):
    AttentionInterface.register(IMPLEMENTATIONS[_delegate_name], _forward_fn)
    AttentionMaskInterface.register(IMPLEMENTATIONS[_delegate_name], ALL_MASK_ATTENTION_FUNCTIONS[_delegate_name])


_PER_TOKEN_SINKS = "passes per-token sink logits (sinks=; the stored form takes one sink logit per head)"
NOT_SERVED: dict[str, str] = {
    "JetMoeAttention": "repeats its keys and values once per selected expert after cache.update",
    "DiffLlamaAttention": "splits its values in two and repeats each half after cache.update",
    "DogeAttention": "computes its dynamic mask from every value cache.update returns",
    **dict.fromkeys(("Inkling2SlidingAttention", "Inkling2FullAttention", "Inkling2LoopSlidingAttention",
                     "Inkling2LoopFullAttention"), _PER_TOKEN_SINKS),
}
"""Attention module class name -> what it does that attention on the stored form cannot take: K/V used beyond its
attention call (the update returns the step's tokens only; the module needs them all, or the attention call would
receive other tensors than the cache layer returned), or an argument ``codec_attention`` has no form for."""


def _not_served(model: torch.nn.Module) -> str | None:
    """Why an attention module of ``model`` cannot attend on the stored form (:data:`NOT_SERVED`), or None."""
    for module in model.modules():
        why = NOT_SERVED.get(type(module).__name__)
        if why is not None:
            return f"{type(module).__name__} {why}"
    return None


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
    it as its delegate); attention modules that call no attention function and have an adapter (BLOOM, MPT:
    :mod:`flashcodec_fx.hf.alibi`) are served by it, whether or not the model can switch implementations.

    The model must currently use ``"sdpa"`` or ``"eager"``, and its attention modules be ones the stored form serves
    (:data:`NOT_SERVED`): ValueError otherwise. Calling it again is a no-op.
    Layers whose cache is not a FlashCodecLayer keep computing exactly as before.
    """
    from . import alibi

    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    current_name = attn_implementation(model.config)
    if current_name in NAMES or hasattr(model, "_flashcodec_previous_attn"):
        return
    if current_name not in DELEGATES:
        raise ValueError(f"apply_codec_attention needs a model using attn_implementation in {DELEGATES}, got "
                         f"{current_name!r}")
    why = _not_served(model)
    if why is not None:
        raise ValueError(f"{type(model).__name__}: {why}")
    own = [(config, attn_implementation(config)) for config in _configs(model)]
    adapted = alibi.install(model)
    try:
        model.set_attn_implementation(IMPLEMENTATIONS[current_name])
    except ValueError:  # a model without the attention interface: its adapters serve it
        if not adapted:
            raise
    model._flashcodec_previous_attn = current_name
    if attn_implementation(model.config) != IMPLEMENTATIONS[current_name]:
        if adapted:
            return  # the modules that attend are served by their adapters; the implementation name stays
        remove_codec_attention(model)
        raise ValueError(f"{type(model).__name__} does not support switching its attention implementation")
    for config, was in own:
        if was in DELEGATES and was != current_name:
            config._attn_implementation = IMPLEMENTATIONS[was]


def remove_codec_attention(model: torch.nn.Module) -> None:
    """Undo :func:`apply_codec_attention`: the model's previous implementation is set back, and each sub-config's
    (no-op if not applied)."""
    from . import alibi

    previous = getattr(model, "_flashcodec_previous_attn", None)
    if previous is None:
        return
    alibi.uninstall(model)
    delegates = {name: delegate for delegate, name in IMPLEMENTATIONS.items()}
    own = [(config, delegates.get(attn_implementation(config))) for config in _configs(model)]
    if attn_implementation(model.config) != previous:
        model.set_attn_implementation(previous)
    for config, was in own:
        if was is not None and was != previous:
            config._attn_implementation = was
    del model._flashcodec_previous_attn
