"""`FlashCodecLayer` / `FlashCodecCache`: the codec as a transformers 5.x KV cache (layer API shared by 5.17 .. 5.24).

Each compressed layer owns a :class:`flashcodec_fx.cache.CodecKVCache` (K and V streams); every read and write of the
model goes through ``cache.update(k, v, layer_idx)``. What ``update`` returns:

- ``Dataflow.STORED_FORM`` (eager, the default ``materialization_free=True``): the call's new states, and the step is
  handed to the attention call that follows (:class:`~flashcodec_fx.hf.handoff.AttentionStep`: the stored form after
  the append, explicitly, in the cache's table at this layer's index); the ``"kvcodec"`` attention function attends
  on the prompt exactly (prefill) and on the stored form afterwards (the call's own tokens exact). If the model does
  not use that attention function (``apply_flash_codec`` / ``apply_codec_attention`` install it), the first decode
  step warns (``MaterializationFreeFallback``; ``strict=True`` raises) and the layer switches to the decoded view,
  kept as a memo;
- ``Dataflow.VIEW`` (eager, ``materialization_free=False``): the decoded view (a memo updated once per archived group;
  dynamic: ``L`` = stored length, static: ``L`` = capacity, positions past the length zero and masked), the
  prefill's exact states;
- ``Dataflow.COMPILED`` (under ``torch.compile``): ``torch.ops.flashcodec.read(state, spec, new)`` of each stream, the
  pattern the compile pass rewrites into ``flashcodec::codec_attention``.

:func:`~flashcodec_fx.hf.handoff.dataflow` chooses among them (see :mod:`flashcodec_fx.hf.handoff`).
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    STATIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
)

from .. import _compat
from ..cache import CROP_MODES, LAYOUTS, CodecKVCache, CodecOverflowError, CodecStream
from ..codecs import CODECS, Codec, codec_options
from ..codecs.base import check_choice, check_count
from ..config import CacheConfig, cache_config
from ..presets import PRESETS, preset_config
from .attention import MaterializationFreeFallback
from .handoff import COMPILED, STORED_FORM, AttentionStep, StepTable, StoredStream, dataflow

CODEC_LAYER_TYPES = ("full_attention", "sliding_attention")  # sliding: dynamic layout (static keeps them native)
CODEC_KEYWORDS = ("preset", "per_layer", "key_options", "value_options", "mode")  # besides each codec's options
HOST = torch.device("cpu")  # where transformers offloads a layer to
CACHE_SWITCHES = ("layout", "max_cache_len", "materialization_free", "strict", "memoize", "crop", "offloading",
                  "offload_only_non_sliding")


class StaticSlidingNative(UserWarning):
    """A static FlashCodecCache keeps a model's sliding-window layers native (uncompressed)."""


def check_cache_switches(layout: Any, max_cache_len: Any, materialization_free: Any, strict: Any, memoize: Any,
                         crop: Any = "decode") -> None:
    """Validate the cache-wide options (ValueError / TypeError naming the option), before anything is built."""
    check_choice("layout", layout, LAYOUTS)
    if layout == "static":
        if max_cache_len is None:
            raise ValueError("layout='static' needs max_cache_len (a positive int: the tokens each layer holds)")
        check_count("max_cache_len", max_cache_len, 1)
    elif max_cache_len is not None:
        raise ValueError(f"max_cache_len applies to layout='static' only, got max_cache_len={max_cache_len!r} with "
                         f"layout={layout!r}")
    for name, value in (("materialization_free", materialization_free), ("strict", strict)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    if memoize is not None and not isinstance(memoize, bool):
        raise TypeError(f"memoize must be None (automatic) or a bool, got {type(memoize).__name__} {memoize!r}")
    if strict and not materialization_free:
        raise ValueError("strict=True only applies with materialization_free=True (it turns its fallbacks into errors)")
    if memoize and materialization_free:
        raise ValueError("memoize=True keeps a decoded view that attention on the stored form never reads: set "
                         "materialization_free=False to attend on the view, or leave memoize unset")
    check_choice("crop", crop, CROP_MODES)


def crop_count(tokens_to_remove: Any) -> int:
    """``crop``'s argument as an int: an int, or a one-element integer tensor (transformers 5.17's assisted decoding
    passes one; reading it is a host sync, outside any decode step)."""
    value = tokens_to_remove
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"tokens_to_remove must be an int (or a one-element integer tensor), got "
                        f"{type(tokens_to_remove).__name__}")
    return value


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class FlashCodecLayer(CacheLayerMixin):
    """One full-attention layer whose K and V live in codec streams.

    ``key_codec``/``value_codec``: the two codecs. ``layout``: ``"dynamic"`` (grows) or ``"static"`` (preallocated for
    ``max_cache_len`` tokens, compileable). ``materialization_free``: attend on the stored form (default); ``False``
    attends on the decoded view. ``memoize``: keep that view as a memo (default: only when attending on the view).
    ``strict``: the stored-form path never falls back to the view. ``crop``: see :class:`~flashcodec_fx.CodecStream`.
    """

    is_sliding = False
    supports_early_init = True

    def __init__(self, key_codec: Codec, value_codec: Codec | None = None, layout: str = "dynamic",
                 max_cache_len: int | None = None, memoize: bool | None = None, materialization_free: bool = True,
                 strict: bool = False, crop: str = "decode"):
        check_cache_switches(layout, max_cache_len, materialization_free, strict, memoize, crop)
        super().__init__()
        memoize = (not materialization_free) if memoize is None else memoize
        self.codec_cache = CodecKVCache(key_codec, value_codec, layout, max_cache_len, memoize, crop)
        self.layout, self.max_cache_len = layout, max_cache_len
        self.is_compileable = layout == "static"
        self.materialization_free, self.strict = materialization_free, strict
        self._bound = False  # the "kvcodec" attention function took a step of this layer (or a loaded file says so)
        self._steps, self._index = StepTable(), 0  # where its steps go: a cache seats it at its index (`seat`)
        self._handed = False  # a step was handed out since the last reset, and not withdrawn
        self._marked_static = False
        self._offloaded: tuple[int, int] | None = None  # on the host: the archive groups (K, V) to restore on arrival

    def __repr__(self) -> str:
        k, v = self.keys_stream.codec, self.values_stream.codec
        return f"FlashCodecLayer(keys={k!r}, values={v!r}, layout={self.layout!r})"

    # transformers' CacheLayerMixin sets `keys` / `values` to None in __init__; here they are decoded views on access.
    @property
    def keys(self) -> torch.Tensor | None:
        """The stored keys ``(B, H, L, D)`` as attention reads them (one decode on access; never used by a decode
        step), None while empty."""
        return self.keys_stream.decoded() if self.keys_stream.is_initialized else None

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("FlashCodecLayer.keys is a decoded view of the codec state; it cannot be assigned")

    @property
    def values(self) -> torch.Tensor | None:
        """The stored values as attention reads them (see :attr:`keys`)."""
        return self.values_stream.decoded() if self.values_stream.is_initialized else None

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("FlashCodecLayer.values is a decoded view of the codec state; it cannot be assigned")

    @property
    def keys_stream(self) -> CodecStream:
        return self.codec_cache.keys

    @property
    def values_stream(self) -> CodecStream:
        return self.codec_cache.values

    @property
    def stores_raw(self) -> bool:
        """Both streams keep every token as given (the ``lossless`` preset): attention reads the stored form through
        the model's own implementation, the archive being the view (no copy), so tokens equal an uncompressed run's."""
        return self.keys_stream.codec.stores_raw and self.values_stream.codec.stores_raw

    @property
    def capacity(self) -> int:
        """Static layout: positions the views span (>= ``max_cache_len``)."""
        return self.keys_stream.positions

    @property
    def is_croppable(self) -> bool:
        """Whether ``crop`` succeeds at any depth (assisted and prompt-lookup decoding crop their rejected draft
        tokens, of any count): both streams :attr:`~flashcodec_fx.CodecStream.croppable`. True for every codec with
        ``crop="decode"`` (the default: a crop into an archived group reopens it with the values attention read;
        an exact rollback for per-token codecs, every preset, and png ``keep_ratio=1.0`` on 16-bit streams). With
        ``crop="exact"`` only where every crop is an exact rollback; a crop that would reopen another codec's group
        then raises, naming its depth, and changes nothing."""
        return self.keys_stream.croppable and self.values_stream.croppable

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate both streams for states shaped like these ``(B, H, T, D)`` (``T`` may be 0: transformers'
        ``early_initialization``); static layouts get their whole capacity, marked as static addresses; a dynamic
        stream holds a short prompt raw (:mod:`flashcodec_fx.raw_prefix`)."""
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys_stream.prepare(key_states)
        self.values_stream.prepare(value_states)
        self.is_initialized = True
        if self.layout == "static":
            self._mark_static()

    @property
    def batch_size(self) -> int:
        """Batch rows held. Like transformers' lazily initialized layers, the attribute does not exist before the
        layer is (``hasattr`` is False), so ``Cache.batch_size`` skips it."""
        tail = self.keys_stream.tail
        if tail is None:
            raise AttributeError("batch_size: this FlashCodecLayer holds no storage yet (first update or "
                                 "early_initialization allocates it)")
        return tail.shape[0]

    def _compiled_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.codec_cache.append(key_states, value_states)
        ks, vs = self.keys_stream, self.values_stream
        return (torch.ops.flashcodec.read(list(ks.state), ks.spec, key_states),
                torch.ops.flashcodec.read(list(vs.state), vs.spec, value_states))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, keep: torch.Tensor | None = None,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(B, H, T, D)`` keys and values; returns what attention reads (see the module docstring).

        ``keep``: optional ``(B, T)`` bool, False at padding positions; those K/V are stored as zeros (what the call
        itself reads stays as given: padding is masked anyway).
        """
        flow = dataflow(self.materialization_free)
        if flow is COMPILED:
            return self._compiled_update(key_states, value_states)
        if self.handed_out:
            raise RuntimeError("the attention function did not receive the keys this cache layer handed out at the "
                               "previous step (the model changes K/V between cache.update and attention, or does not "
                               "use the 'kvcodec' attention): build the cache with materialization_free=False")
        self._check_new(key_states, value_states)
        if self._offloaded is not None:  # not prefetched (a call outside Cache.update's order): bring it back now
            self.prefetch()
        first_fill = self.keys_stream.get_seq_length() == 0
        if self.unserved:
            fall_back_to_view([self])
            flow = dataflow(self.materialization_free)
        stored_k, stored_v = key_states, value_states
        if keep is not None:
            mask = keep[:, None, :, None]
            zero = torch.zeros((), dtype=key_states.dtype, device=key_states.device)
            stored_k, stored_v = torch.where(mask, key_states, zero), torch.where(mask, value_states, zero)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys_stream.append(stored_k, checked=True)
        self.values_stream.append(stored_v, checked=True)
        if self.layout == "static" and not self._marked_static:
            self._mark_static()  # after a batch reorder that reallocated
        if first_fill:  # the prompt attends on its exact states (static: padded to the views' capacity)
            out = (key_states, value_states) if self.layout == "dynamic" else (self._pad(key_states),
                                                                                self._pad(value_states))
        elif flow is STORED_FORM:
            out = (key_states, value_states)
        else:
            return self.read_view((key_states, value_states))
        if flow is STORED_FORM:
            self._hand_off(*out, decode=not first_fill)
        return out

    def seat(self, steps: StepTable, index: int) -> None:
        """Hand steps to ``steps`` at ``index`` from now on (``FlashCodecCache.update``: the cache's table, this layer's
        index, the ``layer_idx`` of the attention module that reads it); a step pending at the old seat moves along."""
        if steps is self._steps and index == self._index:
            return
        pending = self._steps.pop(self._index, None)
        self._steps, self._index = steps, index
        if pending is not None:
            steps.hand(index, pending)

    def _hand_off(self, key: torch.Tensor, value: torch.Tensor, decode: bool) -> None:
        """Hand the attention call that follows this step: the returned ``key`` / ``value`` and the stored form."""
        streams = (self.keys_stream, self.values_stream)
        stored = [StoredStream(*stream.op_state(), None if self.layout == "static" else stream.get_seq_length())
                  for stream in streams]
        views = self.read_view((key, value)) if decode and self.stores_raw else None
        self._bound = self._bound or self.attention_bound  # the step handed out before was taken
        self._handed = True
        self._steps.hand(self._index, AttentionStep(key, value, *stored, views=views, decode=decode, strict=self.strict,
                                                    sliding=self.is_sliding))

    def _withdraw(self) -> None:
        """Forget the step handed out last (taken or not)."""
        self._steps.pop(self._index, None)
        self._handed = False

    @property
    def attention_bound(self) -> bool:
        """The ``"kvcodec"`` attention function took a step of this layer since its last reset (its table no longer
        holds a step it handed out), or a loaded cache file says it did."""
        return self._bound or (self._handed and self._steps.get(self._index) is None)

    @attention_bound.setter
    def attention_bound(self, value: bool) -> None:
        self._bound = bool(value)

    @property
    def handed_out(self) -> bool:
        """A decode step was handed to attention and no attention call has taken it yet."""
        step = self._steps.get(self._index) if self._handed else None
        return step is not None and step.decode

    def _check_new(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Reject states this layer cannot take, before any state changes. Keys and values may have different head dims
        when attention reads the decoded view; attention on the stored form reads both with the queries' head dim."""
        if not self.materialization_free:
            self.codec_cache.check_new(key_states, value_states, same_head_dim=False)
            return
        if all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (key_states, value_states)) \
                and key_states.shape[3] != value_states.shape[3]:
            raise ValueError(f"keys have head_dim {key_states.shape[3]} and values {value_states.shape[3]}: attention "
                             f"on the stored form (materialization_free=True, the default) needs one head dim; build the "
                             f"cache with materialization_free=False to store them (attention then reads the decoded "
                             f"view)")
        self.codec_cache.check_new(key_states, value_states)

    @property
    def unserved(self) -> bool:
        """This layer was to attend on its stored form, holds tokens, and the ``"kvcodec"`` attention function did not
        serve its prefill: the model does not use that function (see :func:`fall_back_to_view`)."""
        return self.materialization_free and not self.attention_bound and self.keys_stream.get_seq_length() > 0

    def use_view(self) -> None:
        """Attend on the decoded view from now on, kept as a memo (a raw stored form is its own view: no memo)."""
        self.materialization_free = False
        self._withdraw()
        self.codec_cache.keys.start_memo()
        self.codec_cache.values.start_memo()

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        b, h, t, d = x.shape
        return torch.cat([x, x.new_zeros(b, h, self.capacity - t, d)], dim=2)

    def _mark_static(self) -> None:
        for stream in (self.keys_stream, self.values_stream):
            for t in (*stream.state, stream.memo):
                if t is not None:
                    _compat.mark_static_address(t)
        self._marked_static = True

    def read_view(self, new: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoded ``(B, H, L, D)`` views (the memo when kept, else one decode), ``new`` read exactly."""
        k_new, v_new = (None, None) if new is None else new
        return self.keys_stream.read(k_new), self.values_stream.read(v_new)

    def get_seq_length(self) -> int | torch.Tensor:
        """Stored tokens: a host int (dynamic; mirrored on the host, no sync) or, like transformers' StaticLayer, the
        0-dim device length tensor (static: compiled decode steps must not specialize on it)."""
        if self.layout == "static":
            length = self.keys_stream.length
            return 0 if length is None else length
        return self.keys_stream.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: dynamic ``stored + query_length``; static the views' capacity."""
        if self.layout == "static":
            return self.capacity, 0
        return self.keys_stream.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.max_cache_len if self.layout == "static" else -1

    def reset(self) -> None:
        """Forget every token (dynamic: storage released, the next update may bring another batch size; static:
        zeroed in place)."""
        self.codec_cache.reset()
        self._withdraw()
        self._bound = False
        if self.layout == "dynamic":
            self.is_initialized, self._offloaded = False, None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers 5.x: a negative int; ``max_length``-style positive
        ints keep that many tokens; past the start empties the layer, as DynamicLayer does). See
        :meth:`CodecStream.crop` for exactness."""
        tokens_to_remove = crop_count(tokens_to_remove)
        if tokens_to_remove == 0 or not self.keys_stream.is_initialized:
            return
        self.codec_cache.crop(tokens_to_remove)  # both streams or, refused, neither

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise where :meth:`crop` would (TypeError, ValueError), changing nothing."""
        tokens_to_remove = crop_count(tokens_to_remove)
        self.keys_stream.check_crop(tokens_to_remove)
        self.values_stream.check_crop(tokens_to_remove)

    def _batch_indices(self, indices: Any) -> torch.Tensor:
        device = self.keys_stream.tail.device
        idx = torch.as_tensor(indices, device=device)
        if idx.dtype == torch.bool:
            if idx.dim() != 1 or idx.shape[0] != self.batch_size:
                raise ValueError(f"a boolean batch mask must be ({self.batch_size},), got shape {tuple(idx.shape)}")
            return idx.nonzero().reshape(-1)
        return idx.to(torch.long).reshape(-1)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: every state tensor of both streams moves together."""
        if self.keys_stream.is_initialized:
            self.codec_cache.index_select(self._batch_indices(beam_idx))
            self._marked_static = False

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows ``indices`` (an index tensor or a ``(B,)`` bool mask)."""
        if self.keys_stream.is_initialized:
            self.codec_cache.index_select(self._batch_indices(indices))
            self._marked_static = False

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.keys_stream.is_initialized:
            self.codec_cache.repeat_interleave(repeats)
            self._marked_static = False

    def offload(self) -> None:
        """Move the stored form to the CPU (transformers' ``Cache(offloading=True)``: ``Cache.offload`` after this
        layer's update, ``Cache.prefetch`` before its next one; eager only): each stream's filled archive groups
        (codes, scales, zero points, png indices), raw sinks and tail, mean and lengths (and the memo's filled
        positions, where kept; :meth:`CodecStream.move_to`). The unused capacity stays behind and is allocated again
        on arrival: a compressed layer moves its compressed bytes, never a decoded view. A step handed to attention
        keeps the device tensors it was handed (``AttentionStep``): attention reads them after the move."""
        if self._offloaded is not None or not self.keys_stream.is_initialized:
            return
        streams = (self.keys_stream, self.values_stream)
        self._offloaded = tuple(stream.allocated_groups for stream in streams)
        for stream in streams:
            stream.move_to(HOST)
        self._marked_static = False

    def prefetch(self) -> None:
        """Move an offloaded layer back to its device, with the archive's capacity it had there."""
        if self._offloaded is None:
            return
        for stream, groups in zip((self.keys_stream, self.values_stream), self._offloaded, strict=True):
            stream.move_to(self.device, groups)
        self._offloaded = None

    def storage_breakdown(self) -> dict[str, int]:
        """Bytes held by both streams, by part (see :meth:`CodecStream.storage_breakdown`)."""
        return self.codec_cache.storage_breakdown()

    def storage_bytes(self) -> int:
        """Every byte both streams hold."""
        return self.codec_cache.storage_bytes()

    def stored_bits(self) -> int:
        return self.keys_stream.stored_bits() + self.values_stream.stored_bits()

    def cached_values(self) -> int:
        """Values the stored tokens stand for (K and V): ``2 * B * H * L * D``."""
        tail = self.keys_stream.tail
        return 0 if tail is None else 2 * tail.shape[0] * tail.shape[1] * tail.shape[3] * self.keys_stream.get_seq_length()

    def raw_equivalent_bytes(self) -> int:
        """Bytes the stored tokens would take uncompressed (K and V in the stream dtype, no padding to capacity; the
        raw rows of an fp32 stream may be stored narrower, the tokens given are not)."""
        dtype = self.keys_stream.dtype
        return 0 if dtype is None else self.cached_values() * dtype.itemsize


def fall_back_to_view(layers: list[FlashCodecLayer]) -> None:
    """``layers`` were to attend on their stored form, but the model does not use the ``"kvcodec"`` attention
    function: they attend on their decoded views from now on, with one ``MaterializationFreeFallback`` warning for
    all of them (the memory it costs, and the fix); ``strict=True`` raises instead, before anything changes."""
    coded = [layer for layer in layers if not layer.stores_raw]
    reason = (f"{len(coded)} FlashCodecCache layer(s) were to attend on the stored form, but the model does not use the "
              f"'kvcodec' attention function: install it with apply_flash_codec(model) or apply_codec_attention(model)")
    if any(layer.strict for layer in coded):
        raise RuntimeError(reason)
    if coded:
        warnings.warn(f"{reason}. They attend on the decoded view from now on, which each keeps as a full-precision "
                      f"memo beside its codes: this cache now holds more than an uncompressed DynamicCache",
                      MaterializationFreeFallback, stacklevel=4)
    for layer in layers:
        layer.use_view()


class FlashCodecSlidingLayer(FlashCodecLayer):
    """A sliding-window layer whose K and V live in codec streams, as a ring: archive groups that every later query
    has left behind (wholly before ``position - sliding_window + 1``) are dropped, so storage stays bounded by the
    window plus one group of each stream plus the tail, whatever the length. The dynamic layout only (a static
    FlashCodecCache keeps sliding layers native), codecs without sinks (sink tokens leave the window too). Positions
    are absolute to transformers (``get_seq_length``, ``get_mask_sizes``' offset), relative inside the streams.
    ``activate_past_recording()`` (transformers' assisted decoding calls it, as for its own sliding layers): nothing is
    dropped until the next ``crop``, which drops what leaves the window at the cropped length, so a rollback of any
    depth since the last crop finds every position it needs."""

    is_sliding = True

    def __init__(self, key_codec: Codec, value_codec: Codec | None = None, *, sliding_window: int,
                 layout: str = "dynamic", **layer_kwargs: Any):
        if layout != "dynamic":
            raise ValueError(f"a codec sliding-window layer needs layout='dynamic', got {layout!r}")
        value_codec = key_codec if value_codec is None else value_codec
        if key_codec.sinks or value_codec.sinks:
            raise ValueError(f"a codec sliding-window layer takes codecs without sinks, got sinks={key_codec.sinks} "
                             f"(keys), {value_codec.sinks} (values)")
        check_count("sliding_window", sliding_window, 1)
        super().__init__(key_codec, value_codec, layout, **layer_kwargs)
        self.sliding_window = sliding_window
        self.dropped = 0  # positions forgotten at the front (a multiple of the drop unit)
        self.record_past = False
        self._unit = math.lcm(key_codec.group, value_codec.group)

    def __repr__(self) -> str:
        return f"FlashCodecSlidingLayer(window={self.sliding_window}, keys={self.keys_stream.codec!r}, " \
               f"values={self.values_stream.codec!r})"

    def activate_past_recording(self, **_: Any) -> None:
        """Keep every position until the next :meth:`crop` (see the class docstring). Keywords transformers passes
        for recurrent layers (5.25's ``recurrent_states_to_keep``) are accepted and unused: a ring holds no
        recurrent state, and keeps every position while recording."""
        self.record_past = True

    def _drop_target(self) -> int:
        """Positions forgotten before the next call (none more while recording the past). ``get_mask_sizes`` (before
        ``update``) and ``update`` agree on it."""
        return self.dropped if self.record_past else self._window_target()

    def _window_target(self) -> int:
        """Whole units below the first position a later query can see, and archived in both streams."""
        seen = self.get_seq_length()
        visible = max(0, seen - self.sliding_window + 1)
        archived = self.dropped + min(self.keys_stream.archived_tokens, self.values_stream.archived_tokens)
        return max(self.dropped, min(visible, archived) // self._unit * self._unit)

    def get_seq_length(self) -> int:
        """Tokens seen (transformers' positions), dropped ones included."""
        return self.dropped + self.keys_stream.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the positions held after this call's drop, plus the query."""
        target = self._drop_target()
        return self.get_seq_length() - target + query_length, target

    def slide(self) -> None:
        """Drop the archive groups no later query can see (what ``update`` does before it appends)."""
        self._drop_to(self._drop_target())

    def _drop_to(self, target: int) -> None:
        if target > self.dropped:
            for stream in (self.keys_stream, self.values_stream):
                stream.drop_front(target - self.dropped)
            self.dropped = target

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if dataflow(self.materialization_free) is not COMPILED:
            self.codec_cache.check_new(key_states, value_states)  # a rejected call changes nothing
            self.slide()
        return super().update(key_states, value_states, *args, **kwargs)

    def _stream_crop(self, tokens_to_remove: int) -> int:
        """The streams' crop argument for ``crop(tokens_to_remove)`` (positions relative to the ring); raises where
        the ring has dropped positions that the crop would need back."""
        tokens_to_remove = crop_count(tokens_to_remove)
        if tokens_to_remove == 0:
            return 0
        seen = self.get_seq_length()
        keep = max(0, seen + tokens_to_remove) if tokens_to_remove < 0 else min(tokens_to_remove, seen)
        if keep < self.dropped:
            raise ValueError(f"crop to {keep} tokens: this sliding-window layer has dropped positions 0.."
                             f"{self.dropped - 1} (outside its window of {self.sliding_window}); crop to at least "
                             f"{self.dropped}")
        return keep - seen if keep < seen else 0

    def crop(self, tokens_to_remove: int) -> None:
        """As :meth:`FlashCodecLayer.crop`; positions the ring has dropped cannot come back (ValueError). While
        recording the past, the ring then drops what the cropped length leaves outside the window."""
        super().crop(self._stream_crop(tokens_to_remove))
        if self.record_past:
            self._drop_to(self._window_target())

    def check_crop(self, tokens_to_remove: int) -> None:
        super().check_crop(self._stream_crop(tokens_to_remove))

    def reset(self) -> None:
        super().reset()
        self.dropped = 0


class FlashCodecCache(Cache):
    """A transformers ``Cache`` whose attention layers store K and V through the flashcodec codecs.

    ``codecs``: a :class:`~flashcodec_fx.config.CacheConfig` (``flashcodec_fx.PRESETS`` holds some), a preset name, or
    a ``CacheConfig.spec`` string. Or keyword options (:func:`~flashcodec_fx.config.cache_config`): ``preset`` and
    codec options over it, ``key_options`` / ``value_options`` (one stream), ``per_layer`` (``{layer_idx: options
    dict | preset name | None}``; ``None`` keeps the layer native); without any, ``DEFAULT_PRESET`` (``"int8"``).
    Codec options (docs/hf.md): ``mode`` ``"jpeg"`` (default) or ``"png"``; ``block_size`` (8); jpeg ``keep_freqs``
    (all), ``quant_bits`` (8; an int, a per-frequency table, or ``None``: unquantized), ``levels``, ``scale_axis``,
    ``group``, ``scale_search``, ``rotate``, ``center``; png ``keep_ratio`` (1.0 = exact); ``sinks`` / ``window``
    (raw first / newest tokens). Cache options: ``layout`` ``"dynamic"`` / ``"static"`` (needs ``max_cache_len``),
    ``materialization_free``, ``memoize``, ``strict``, ``crop``, ``offloading``, ``offload_only_non_sliding``.

    Layers: with ``config`` (or :meth:`from_config`), one per model layer: codec layers on full-attention layers and,
    on the dynamic layout, codec rings on sliding-window layers (the static layout keeps those native, and warns);
    every other layer type (chunked, linear attention, ...) keeps its native transformers layer. With ``num_layers``,
    that many codec layers. With neither, codec layers are created as the model asks for them (``per_layer`` then
    needs ``num_layers`` or ``config``).
    """

    def __init__(self, codecs: CacheConfig | str | None = None, *, layout: str = "dynamic",
                 max_cache_len: int | None = None, materialization_free: bool = True, strict: bool = False,
                 memoize: bool | None = None, crop: str = "decode", offloading: bool = False,
                 offload_only_non_sliding: bool = True, config: Any = None, num_layers: int | None = None,
                 **options: Any):
        _compat.warn_untested_transformers()
        check_cache_switches(layout, max_cache_len, materialization_free, strict, memoize, crop)
        for name, value in (("offloading", offloading), ("offload_only_non_sliding", offload_only_non_sliding)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        codec_config = resolve_codecs(codecs, options)
        layer_kwargs = dict(layout=layout, max_cache_len=max_cache_len, memoize=memoize,
                            materialization_free=materialization_free, strict=strict, crop=crop)
        if config is not None and not is_model_config(config):
            raise TypeError(f"config must be None or a transformers PreTrainedConfig (model.config), got "
                            f"{type(config).__name__}")
        if config is not None and num_layers is not None:
            raise ValueError("pass either config or num_layers, not both")
        if config is not None:
            layer_types, native_kwargs = _compat.layer_types_and_kwargs(config)
        elif num_layers is not None:
            check_count("num_layers", num_layers, 1)
            layer_types, native_kwargs = ["full_attention"] * num_layers, [{}] * num_layers
        else:
            layer_types = native_kwargs = None
            if codec_config.per_layer:
                raise ValueError("per_layer needs the layer count: use FlashCodecCache.from_config(config, per_layer=...) "
                                 "or pass num_layers=")

        self.codec_config = codec_config
        self.options = {"codecs": codec_config.spec, **layer_kwargs, "offloading": offloading}
        self._padding_mask: torch.Tensor | None = None
        self.step_table = StepTable()  # the steps its codec layers hand attention, by layer index (hf/handoff.py)
        self.source_config = config  # what save() fingerprints (hf/cache_file.py)
        offload = dict(offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)
        if layer_types is None:
            super().__init__(layer_class_to_replicate=_LayerFactory(codec_config, layer_kwargs), **offload)
            return
        layers = _layers(codec_config, layer_types, native_kwargs, layer_kwargs, _head_dim(config))
        super().__init__(layers=layers, **offload)

    def __deepcopy__(self, memo: dict) -> FlashCodecCache:
        """A deep copy of every layer; the offloading prefetch stream (a device queue, not data) is shared."""
        stream = vars(self).get("prefetch_stream")
        if stream is not None:
            memo[id(stream)] = stream
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for name, value in vars(self).items():
            setattr(clone, name, copy.deepcopy(value, memo))
        return clone

    @classmethod
    def from_config(cls, config: Any, **options: Any) -> FlashCodecCache:
        """One layer per model layer of ``config`` (its decoder text config): codec layers on full-attention layers,
        native transformers layers elsewhere. ``options``: as for the constructor (``preset=`` included)."""
        if not is_model_config(config):
            raise TypeError(f"config must be a transformers PreTrainedConfig (model.config), got "
                            f"{type(config).__name__}")
        return cls(config=config, **options)

    def check_model(self, config: Any) -> None:
        """Raise ``ValueError`` (naming both layer counts) when this cache holds another number of layers than the model
        of ``config`` runs; a cache built without a layer count grows to any model."""
        if self.layer_class_to_replicate is not None:
            return
        want = len(_compat.layer_types_and_kwargs(config)[0])
        if want != len(self.layers):
            raise ValueError(f"this FlashCodecCache holds {len(self.layers)} layers, the model runs {want}: build the "
                             f"cache from this model's config (FlashCodecCache.from_config(model.config, ...))")

    def save(self, path: Any, compression: str = "ppmd", model_or_config: Any = None) -> Any:
        """Write this cache to ``path`` (safetensors, exact bitwise; ``compression`` ``"raw"``, ``"zstd"`` or
        ``"ppmd"``): see :mod:`flashcodec_fx.hf.cache_file`. Returns the path."""
        from .cache_file import save

        return save(self, path, compression, model_or_config)

    @classmethod
    def load(cls, path: Any, model_or_config: Any, device: Any = None) -> FlashCodecCache:
        """The cache saved at ``path`` for ``model_or_config`` (checked; ``ValueError`` naming what differs)."""
        from .cache_file import load

        return load(path, model_or_config, device)

    def fork(self) -> FlashCodecCache:
        """A cache continuing from this one's tokens that shares its archives until either writes them
        (copy-on-append, :mod:`flashcodec_fx.persist.fork`): the prompt-cache recipe without copying the prompt."""
        from .fork import fork_cache

        return fork_cache(self)

    @property
    def codec_layers(self) -> list[int]:
        """Indices of the layers that carry a codec."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, FlashCodecLayer)]

    def set_padding_mask(self, attention_mask: torch.Tensor | None) -> None:
        """Declare the 2D ``(B, P)`` padding mask (1 = token, 0 = padding) of the tokens at positions ``0..P-1``:
        their K/V are stored as zeros at padding positions, so padding cannot inflate quantization scales or
        blocks' energy. ``None`` clears it. ``apply_flash_codec`` / ``compress_kv`` call this from ``generate``."""
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(f"attention_mask must be a (B, P) tensor or None, got {type(attention_mask).__name__}")
            if attention_mask.dim() != 2:
                raise ValueError(f"attention_mask must be a (B, P) tensor or None, got shape {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.bool()
        self._padding_mask = attention_mask

    def _keep_mask(self, layer: FlashCodecLayer, key_states: torch.Tensor) -> torch.Tensor | None:
        mask = self._padding_mask
        start, t = layer.keys_stream.get_seq_length(), key_states.shape[2]
        if mask is None or start >= mask.shape[1]:
            return None
        if mask.shape[0] != key_states.shape[0]:
            raise ValueError(f"padding mask batch {mask.shape[0]} does not match the cache batch {key_states.shape[0]}")
        keep = mask[:, start: start + t].to(key_states.device)
        if keep.shape[1] < t:
            keep = torch.cat([keep, keep.new_ones(keep.shape[0], t - keep.shape[1])], dim=1)
        return keep

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``Cache.update``: the layer's update, with the padding mask (codec layers) and, when offloading, the next
        offloaded layer prefetched before and this one offloaded after (stream-ordered on CUDA, in order elsewhere)."""
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        if layer_idx >= len(self.layers):
            raise ValueError(f"update(layer_idx={layer_idx}): this FlashCodecCache holds {len(self.layers)} layers (built "
                             f"for a model with {len(self.layers)}); the model calling it has more: build the cache from "
                             f"this model's config (FlashCodecCache.from_config(model.config, ...))")
        layer = self.layers[layer_idx]
        compiling = dataflow() is COMPILED
        if isinstance(layer, FlashCodecLayer) and not compiling:  # host state: never traced
            layer.seat(self.step_table, layer_idx)
            if layer.unserved:
                fall_back_to_view([other for other in self.layers
                                   if isinstance(other, FlashCodecLayer) and other.unserved])
            if self._padding_mask is not None:
                kwargs = {**kwargs, "keep": self._keep_mask(layer, key_states)}
        if not self.offloading:
            return layer.update(key_states, value_states, *args, **kwargs)
        if compiling:
            raise RuntimeError("FlashCodecCache offloading runs eagerly only: compile the model without offloading, "
                               "or offload without torch.compile")
        if isinstance(layer, FlashCodecLayer):
            layer._check_new(key_states, value_states)  # refused before the prefetch moves anything
        if key_states.device.type == "cuda":  # as transformers' Cache.update
            torch.cuda.default_stream(key_states.device).wait_stream(self.prefetch_stream)
            self.prefetch_stream.wait_stream(torch.cuda.default_stream(key_states.device))
        self.prefetch(layer_idx + 1, self.only_non_sliding)
        out = layer.update(key_states, value_states, *args, **kwargs)
        self.offload(layer_idx, self.only_non_sliding)
        return out

    def crop(self, tokens_to_remove: int) -> None:
        """``Cache.crop`` on every layer: a negative int drops that many tokens (past the start: empty, as
        DynamicLayer); a positive int keeps that many (transformers < 5.18's convention, on native layers too). A crop
        that a codec layer refuses (see :meth:`flashcodec_fx.CodecStream.crop`) raises before any layer changes."""
        tokens_to_remove = crop_count(tokens_to_remove)
        if tokens_to_remove > 0:
            tokens_to_remove = min(0, tokens_to_remove - int(self.get_seq_length()))
        for layer in self.layers:
            if isinstance(layer, FlashCodecLayer) and layer.keys_stream.is_initialized:
                layer.check_crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    def storage_breakdown(self, per_layer: bool = False) -> dict[str, int] | dict[int, dict[str, int]]:
        """Every byte the cache holds, by part, summed over layers: the codec parts of
        :meth:`flashcodec_fx.CodecStream.storage_breakdown` (``archive``, ``scales``, ``sinks``, ``tail``, ``mean``,
        ``norm``, ``memo``; not in ``total``: ``archive_held`` / ``archive_used``, allocated / filled groups with their scales,
        and ``stored``, the tokens as stored),
        ``native``: tensors of the layers without a codec, ``total``. ``raw_equivalent``: what the codec layers'
        stored tokens would take uncompressed (not in ``total``). ``per_layer=True``: ``{layer_idx: dict}`` instead."""
        rows = {}
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, FlashCodecLayer):
                row = dict(layer.storage_breakdown(), native=0, raw_equivalent=layer.raw_equivalent_bytes())
            else:
                native = _tensor_bytes([v for k, v in vars(layer).items() if k != "device"])
                row = {**dict.fromkeys(("archive", "archive_held", "archive_used", "stored", "scales", "sinks", "tail",
                                        "mean", "norm", "memo", "raw_equivalent"), 0), "native": native,
                       "total": native}
            rows[idx] = row
        if per_layer:
            return rows
        parts = next(iter(rows.values())).keys() if rows else ("total",)
        return {part: sum(row.get(part, 0) for row in rows.values()) for part in parts}

    def storage_bytes(self) -> int:
        """Every byte the cache holds (codec layers and native layers; see :meth:`storage_breakdown`): the ``stored``
        part that :meth:`bits_per_value` counts, plus spare capacity (archive groups allocated and not filled, sink and
        tail rows not holding a token, the length counters) and the memo. Capacity grows in steps that depend on the
        calls (a multi-token verification call, a crop, which keeps it): two caches of one length can hold other
        bytes."""
        return self.storage_breakdown()["total"]

    def bits_per_value(self) -> float:
        """Stored bits per cached K/V value of the codec layers, as stored: filled archive groups with their scales
        and zero points, raw sinks and tail rows, the mean and channel exponents; no unused capacity, no memo:
        ``8 * storage_breakdown()["stored"]`` over the values (K and V) the stored tokens stand for. A bf16 raw cache is
        16. After a crop (speculative decoding) the raw window can hold fewer tokens than ``window`` until new ones
        refill it (the tokens a rejected draft pushed into the archive stay archived), so fewer bits at one length."""
        layers = [layer for layer in self.layers if isinstance(layer, FlashCodecLayer)]
        bits = sum(layer.stored_bits() for layer in layers)
        return bits / max(1, sum(layer.cached_values() for layer in layers))


class _LayerFactory:
    """``layer_class_to_replicate`` of a cache built without a layer count: the next codec layer, seeded by its index
    (``rotate=True``). A plain object rather than a closure over the cache, so a deep copy of the cache stays
    independent of the original."""

    def __init__(self, codec_config: CacheConfig, layer_kwargs: dict):
        self.codec_config, self.layer_kwargs, self.made = codec_config, layer_kwargs, 0

    def __call__(self) -> FlashCodecLayer:
        key, value = self.codec_config.layers.build(self.made)
        self.made += 1
        return FlashCodecLayer(key, value, **self.layer_kwargs)


def resolve_codecs(codecs: CacheConfig | str | None, options: dict[str, Any]) -> CacheConfig:
    """The configuration ``FlashCodecCache(codecs, **options)`` asks for (see its docstring); raises naming what is
    wrong before anything is built."""
    if codecs is not None and not isinstance(codecs, (CacheConfig, str)):
        raise TypeError(_codecs_type_error(codecs))
    unknown = sorted(set(options) - set(CODEC_KEYWORDS) - {n for name in CODECS for n in codec_options(name)})
    if unknown:
        allowed = sorted(set(CODEC_KEYWORDS) | {n for name in CODECS for n in codec_options(name)})
        raise ValueError(f"unknown option(s) {unknown}; allowed: {allowed} and the cache options of FlashCodecCache")
    if codecs is None:
        return cache_config(**options)
    if options:
        raise ValueError(f"pass either codecs= or codec options, not both (got codecs and {sorted(options)})")
    if isinstance(codecs, CacheConfig):
        return codecs
    if isinstance(codecs, str):
        return preset_config(codecs) if codecs in PRESETS else CacheConfig.from_spec(codecs)
    return codecs


def is_model_config(value: Any) -> bool:
    """Whether ``value`` looks like a transformers model config (``PreTrainedConfig``: ``to_dict`` and
    ``model_type``), without importing its class."""
    return hasattr(value, "to_dict") and hasattr(value, "model_type")


def _codecs_type_error(codecs: Any) -> str:
    """The message for a ``codecs`` argument of another type, naming the usual mistake: a model's config (or the
    model) passed as the first positional argument."""
    wanted = "codecs (FlashCodecCache's first positional argument) must be a CacheConfig, a preset name or a " \
             "CacheConfig.spec string"
    if is_model_config(codecs) or is_model_config(getattr(codecs, "config", None)):
        what = "a model config" if is_model_config(codecs) else "a model"
        return (f"{wanted}, got {what} ({type(codecs).__name__}): a cache for a model's layers is built with "
                f"FlashCodecCache.from_config(model.config, preset=...) (or FlashCodecCache(config=model.config, "
                f"preset=...))")
    return f"{wanted}, got {type(codecs).__name__}"


def _layers(codec_config: CacheConfig, layer_types: list[str], native_kwargs: list[dict], layer_kwargs: dict,
            head_dim: int | None) -> list:
    """One cache layer per model layer (see :class:`FlashCodecCache`); checks the overrides and head_dim first."""
    layout, n = layer_kwargs["layout"], len(layer_types)
    carries = [kind == "full_attention" or (kind == "sliding_attention" and layout == "dynamic") for kind in layer_types]
    for idx in codec_config.overrides:
        if idx >= n:
            raise ValueError(f"per_layer: layer index {idx} out of range; the model has {n} layers")
        if not carries[idx]:
            allowed = CODEC_LAYER_TYPES if layout == "dynamic" else ("full_attention",)
            raise ValueError(f"per_layer: layer {idx} is a {layer_types[idx]!r} layer; with layout={layout!r} only "
                             f"{allowed} layers carry a codec")
    layers, native_sliding = [], []
    for idx, (kind, kwargs) in enumerate(zip(layer_types, native_kwargs, strict=True)):
        layer_config = codec_config.layer(idx) if carries[idx] else None
        if layer_config is None:
            if kind == "sliding_attention":
                native_sliding.append(idx)
            mapping = STATIC_LAYER_TYPE_MAPPING if layout == "static" else DYNAMIC_LAYER_TYPE_MAPPING
            layers.append(mapping[kind](**({"max_cache_len": layer_kwargs["max_cache_len"]} if layout == "static"
                                           else {}), **kwargs))
            continue
        if kind == "sliding_attention":
            layer_config = layer_config.without_sinks()
        key, value = layer_config.build(idx)
        if head_dim is not None:
            for stream, codec in (("keys", key), ("values", value)):
                try:
                    codec.check_head_dim(head_dim)
                except ValueError as err:
                    raise ValueError(f"layer {idx} ({stream}): {err}") from None
        if kind == "sliding_attention":
            layers.append(FlashCodecSlidingLayer(key, value, sliding_window=kwargs["sliding_window"], **layer_kwargs))
        else:
            layers.append(FlashCodecLayer(key, value, **layer_kwargs))
    if layout == "static" and native_sliding and any(carries):
        warnings.warn(f"layout='static' keeps the {len(native_sliding)} sliding-window layer(s) {native_sliding} native "
                      f"(uncompressed): codec rings need the dynamic layout", StaticSlidingNative, stacklevel=4)
    return layers


def _head_dim(config: Any) -> int | None:
    """The attention head dim of ``config`` (its decoder text config), None where the config does not say."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None and getattr(text, "hidden_size", None) and getattr(text, "num_attention_heads", None):
        head_dim = text.hidden_size // text.num_attention_heads
    return head_dim if isinstance(head_dim, int) else None


__all__ = ["CODEC_LAYER_TYPES", "CodecOverflowError", "FlashCodecCache", "FlashCodecLayer", "FlashCodecSlidingLayer",
           "MaterializationFreeFallback", "StaticSlidingNative"]
