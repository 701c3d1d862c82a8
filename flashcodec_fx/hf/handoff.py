"""What a codec layer's ``update`` hands the attention call that follows, where they meet, and which dataflow runs.

A step runs one of three dataflows, chosen in one place (:func:`dataflow`):

- ``STORED_FORM`` (eager, ``materialization_free=True``, the default): the update returns the call's own keys and
  values and hands the attention call an :class:`AttentionStep` (those tensors and both streams' stored form after
  the append); the ``"kvcodec"`` attention function attends on it (``hf/attention.py``);
- ``VIEW`` (eager, ``materialization_free=False``): the update returns the decoded view (kept as a memo, or one
  decode a step: ``memoize``) and the model's own attention reads it; nothing is handed over;
- ``COMPILED`` (traced by ``torch.compile``, whatever the switch): the update returns ``flashcodec.read`` views that
  the compile pass rewrites, with the SDPA call over them, into ``flashcodec.codec_attention``; nothing is handed over
  (nothing host-side is read while tracing).

Where they meet: a :class:`StepTable`, keyed by layer index. ``FlashCodecCache.update(k, v, layer_idx)`` seats the
codec layer at ``layer_idx`` of the cache's table (a layer used on its own has a table of its own, index 0); its
update puts the step there, and the attention call of the module whose ``layer_idx`` it is takes it out. transformers
passes attention functions the module (so its ``layer_idx``), not the cache: the table a layer handed a step to last
is the current one of this context (``_FORWARD``, a ``ContextVar``: per thread and asyncio task, as vLLM's forward
context). It is ``hf``'s one piece of module-level state: a reference to a table, nothing keyed by object ids. The
layer learns whether its step was taken by looking at the table (taken: no longer there), never from a flag attention
writes back.

A model that calls ``cache.update`` with another index than its attention module's ``layer_idx`` (a cache offset, as
looped models and shared attention blocks do: HRM, Dory, Zamba) hands its attention call the very key tensor the
update returned: the attention call takes the step handed last when it receives that tensor (never another step). A
layer that attends on another layer's K/V (KV sharing: Gemma 3n, Gemma 4) receives the tensor the other layer's update
returned: a decode step stays readable by that identity after it was taken (:attr:`StepTable.kept`), until its layer
hands the next one.
"""

from __future__ import annotations

import dataclasses
import enum
from contextvars import ContextVar
from dataclasses import dataclass

import torch


class Dataflow(enum.Enum):
    """How one step's attention reads a codec layer (see the module docstring)."""

    STORED_FORM = "stored_form"
    VIEW = "view"
    COMPILED = "compiled"


# The members as module constants, for the decode path: reading ``Dataflow.X`` costs about 0.3 us on Python 3.11.
STORED_FORM, VIEW, COMPILED = Dataflow


def dataflow(materialization_free: bool = True) -> Dataflow:
    """The dataflow of a step now: ``COMPILED`` while ``torch.compile`` traces, else ``STORED_FORM`` or ``VIEW`` by the
    layer's ``materialization_free`` (the attention function asks with the default: it only serves the stored form)."""
    if torch.compiler.is_compiling():
        return COMPILED
    return STORED_FORM if materialization_free else VIEW


@dataclass(frozen=True)
class StoredStream:
    """One stream's stored form as ``torch.ops.flashcodec`` reads it: ``state`` (the tensors of
    :class:`~flashcodec_fx.ops.StreamState`, in its field order), ``spec``, and ``length`` (stored tokens, host int;
    None: static layout, whose views span the capacity)."""

    state: list[torch.Tensor]
    spec: str
    length: int | None

    def view(self, new: torch.Tensor) -> torch.Tensor:
        """The decoded ``(B, H, L, D)`` view, this call's tokens ``new (B, H, T, D)`` read exactly."""
        view = torch.ops.flashcodec.read(self.state, self.spec, new)
        return view if self.length is None else view[:, :, : self.length]


@dataclass(frozen=True)
class AttentionStep:
    """What one codec layer's update hands its attention call.

    ``key`` / ``value``: the ``(B, H, T, D)`` tensors the update returned (the call's exact states); ``keys`` /
    ``values``: the streams' stored form after the append; ``views``: the ``(B, H, L, D)`` views to attend on when the
    stored form is the tokens themselves (lossless: zero-copy), else None; ``decode``: False for the prompt (the layer
    was empty), which attends on its exact states; ``strict``: no fallback to the decoded view; ``sliding``: a codec
    ring (the mask transformers passes bounds its window); ``latent``: an MLA layer's latent width (``key`` and
    ``value`` are then its stored rows ``[c ; k_rot]``, ``views`` the decoded ``(c, k_rot)``, ``keys is values``),
    else None."""

    key: torch.Tensor
    value: torch.Tensor
    keys: StoredStream
    values: StoredStream
    views: tuple[torch.Tensor, torch.Tensor] | None
    decode: bool
    strict: bool
    sliding: bool
    latent: int | None = None
    pending: bool = False

    def append_now(self) -> None:
        """Append a pending step's ``key`` / ``value`` to its streams, as ``flashcodec::append_attention`` would (the
        stream mirrors already count them: ``CodecStream.reserve``)."""
        torch.ops.flashcodec.append(self.keys.state, self.key, self.keys.spec, None)
        torch.ops.flashcodec.append(self.values.state, self.value, self.values.spec, None)

    def received(self, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether ``key`` / ``value`` are what attention should receive of this step: the very tensors the update
        returned; for an MLA step, the module's per-head expansion of the same tokens (``(B, H, T, .)`` of the step's
        ``B`` and ``T``)."""
        if key is self.key:
            return value is self.value
        return self.latent is not None and key.dim() == 4 and key.shape[0] == self.key.shape[0] \
            and key.shape[2] == self.key.shape[2]

    def decoded_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoded views of both streams, this call's tokens exact (one decode: the fallback path); an MLA
        step's ``(c, k_rot)`` of its one stream."""
        if self.latent is not None:
            row = self.keys.view(self.key)
            return row[..., : self.latent], row[..., self.latent:]
        return self.keys.view(self.key), self.values.view(self.value)


class StepTable(dict[int, AttentionStep]):
    """The steps handed to attention and not taken yet, by layer index (one per FlashCodecCache): ``get`` looks,
    ``pop`` takes.

    Only the table and the attention call hold a step, so its snapshot lives for one call: an offload right after the
    update moves the streams while attention still reads the step's device tensors, freed when it returns.

    ``fresh``: the layer index handed to last, until the attention call of that index comes (None: it came), so that
    an attention call tells the step a layer just handed out from one a forward left behind (an exception between
    update and attention, then a model on another cache in the same context): only the fresh step can be owed.

    ``kept``: the decode steps taken, by layer index, until their layer hands the next (their tokens are in the streams
    by then: no longer pending); a later attention call that receives one's key tensor reads the same stored form (KV
    sharing). Decode steps only: their key and value are the step's few tokens; a prompt's full states are not held
    (a layer that shares them receives them whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.fresh: int | None = None
        self.kept: dict[int, AttentionStep] = {}

    def hand(self, layer_idx: int, step: AttentionStep) -> None:
        """Put ``step`` at ``layer_idx`` (replacing what is there) and make this the context's current table."""
        self[layer_idx] = step
        self.kept.pop(layer_idx, None)
        self.fresh = layer_idx
        if _FORWARD.get() is not self:
            _FORWARD.set(self)

    def taken(self, layer_idx: int, step: AttentionStep) -> AttentionStep:
        """``step``, taken by an attention call: a decode step is kept (see the class docstring)."""
        if step.decode:
            self.kept[layer_idx] = step
        return step

    def shared(self, key: torch.Tensor, value: torch.Tensor) -> AttentionStep | None:
        """The kept step whose key and value tensors ``key`` / ``value`` are (another attention call reads a layer's
        K/V again), its tokens already appended; None where there is none."""
        for step in self.kept.values():
            if step.key is key and step.value is value:
                return dataclasses.replace(step, pending=False) if step.pending else step
        return None


_FORWARD: ContextVar[StepTable | None] = ContextVar("flashcodec_step_table", default=None)


current_table = _FORWARD.get  # () -> the table a codec layer handed a step to last in this context, None before any
