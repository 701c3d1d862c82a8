"""`FlashCodecLayer`: one full-attention layer of a transformers 5.x KV cache whose K and V live in codec streams
(layer API shared by 5.17 .. 5.24).

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

import warnings
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from .. import _compat
from ..cache import CodecKVCache, CodecStream
from ..codecs import Codec
from .attention import MaterializationFreeFallback
from .handoff import COMPILED, STORED_FORM, AttentionStep, StepTable, StoredStream, dataflow
from .options import check_cache_switches, crop_count

HOST = torch.device("cpu")  # where transformers offloads a layer to


class FlashCodecLayer(CacheLayerMixin):
    """One full-attention layer whose K and V live in codec streams.

    ``key_codec``/``value_codec``: the two codecs. ``layout``: ``"dynamic"`` (grows) or ``"static"`` (preallocated for
    ``max_cache_len`` tokens, compileable). ``materialization_free``: attend on the stored form (default); ``False``
    attends on the decoded view. ``memoize``: keep that view as a memo (default: only when attending on the view).
    ``strict``: the stored-form path never falls back to the view. ``crop``: see :class:`~flashcodec_fx.CodecStream`.
    """

    is_sliding = False
    supports_early_init = True
    latent_width: int | None = None  # an MLA layer's (hf/mla_layer.py): its stored rows are [latent ; rotary key]

    def __init__(self, key_codec: Codec, value_codec: Codec | None = None, layout: str = "dynamic",
                 max_cache_len: int | None = None, memoize: bool | None = None, materialization_free: bool = True,
                 strict: bool = False, crop: str = "decode"):
        check_cache_switches(layout, max_cache_len, materialization_free, strict, memoize, crop)
        super().__init__()
        memoize = (not materialization_free) if memoize is None else memoize
        self.codec_cache = self._storage(key_codec, value_codec, layout, max_cache_len, memoize, crop)
        self.layout, self.max_cache_len = layout, max_cache_len
        self.is_compileable = layout == "static"
        self.materialization_free, self.strict = materialization_free, strict
        self._bound = False  # the "kvcodec" attention function took a step of this layer (or a loaded file says so)
        self._steps, self._index = StepTable(), 0  # where its steps go: a cache seats it at its index (`seat`)
        self._handed = False  # a step was handed out since the last reset, and not withdrawn
        self._marked_static = False
        self._offloaded: tuple[int, int] | None = None  # on the host: the archive groups (K, V) to restore on arrival

    def _storage(self, key_codec: Codec, value_codec: Codec | None, layout: str, max_cache_len: int | None,
                 memoize: bool, crop: str) -> CodecKVCache:
        """The layer's streams: one for the keys, one for the values."""
        return CodecKVCache(key_codec, value_codec, layout, max_cache_len, memoize, crop)

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
    def streams(self) -> tuple[CodecStream, ...]:
        """Each stream the layer holds, once: ``(keys, values)`` (an MLA layer's one latent stream serves both)."""
        return self.keys_stream, self.values_stream

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
            self._withdraw()  # a pending step's tokens appended first: the streams stay whole
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
        pending = flow is STORED_FORM and not first_fill and self.defers_appends
        if pending:  # attention appends them: one op per layer and step (flashcodec::append_attention)
            self.keys_stream.reserve(stored_k)
            self.values_stream.reserve(stored_v)
        else:
            self._store(stored_k, stored_v)
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
            self._hand_off(*out, decode=not first_fill, pending=pending)
        return out

    fused_append = True  # False: every update appends itself (an offloading cache; an MLA layer's one stream)

    @property
    def defers_appends(self) -> bool:
        """Whether a decode step's tokens are appended by the attention call that reads them (``AttentionStep.pending``:
        one op per layer and step) rather than by ``update``: a lossy codec attended on its stored form, both
        streams holding a codec state without a memo (:attr:`CodecStream.defers`), not offloaded."""
        return self.fused_append and not self.stores_raw and self.keys_stream.defers and self.values_stream.defers

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append the call's (checked) keys and values to the streams."""
        self.keys_stream.append(key_states, checked=True)
        self.values_stream.append(value_states, checked=True)

    def seat(self, steps: StepTable, index: int) -> None:
        """Hand steps to ``steps`` at ``index`` from now on (``FlashCodecCache.update``: the cache's table, this layer's
        index, the ``layer_idx`` of the attention module that reads it); a step pending at the old seat moves along."""
        if steps is self._steps and index == self._index:
            return
        pending = self._steps.pop(self._index, None)
        self._steps, self._index = steps, index
        if pending is not None:
            steps.hand(index, pending)

    def _hand_off(self, key: torch.Tensor, value: torch.Tensor, decode: bool, pending: bool = False) -> None:
        """Hand the attention call that follows this step: the returned ``key`` / ``value`` and the stored form
        (``pending``: before this call's tokens, which the attention call appends)."""
        stored = [StoredStream(*stream.op_state(), None if self.layout == "static" else stream.get_seq_length())
                  for stream in (self.keys_stream, self.values_stream)]
        views = self.read_view((key, value)) if decode and self.stores_raw else None
        self._bound = self._bound or self.attention_bound  # the step handed out before was taken
        self._handed = True
        self._steps.hand(self._index, AttentionStep(*self._step_tensors(key, value), *stored, views=views,
                                                    decode=decode, strict=self.strict, sliding=self.is_sliding,
                                                    latent=self.latent_width, pending=pending))

    def _step_tensors(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's keys and values as the step hands them to attention (as returned)."""
        return key, value

    def _withdraw(self) -> None:
        """Forget the step handed out last (taken or not); one nobody took that still owes its tokens to the streams
        appends them."""
        step = self._steps.pop(self._index, None)
        if step is not None and step.pending and self._handed:
            step.append_now()
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
        for stream in self.streams:
            stream.start_memo()

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        b, h, t, d = x.shape
        return torch.cat([x, x.new_zeros(b, h, self.capacity - t, d)], dim=2)

    def _mark_static(self) -> None:
        for stream in self.streams:
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

    @property
    def position(self) -> int:
        """The absolute position of the next token (tokens seen; a host int on every layout, no sync): what the
        prompt's padding mask is indexed by."""
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
        self._offloaded = tuple(stream.allocated_groups for stream in self.streams)
        for stream in self.streams:
            stream.move_to(HOST)
        self._marked_static = False

    def prefetch(self) -> None:
        """Move an offloaded layer back to its device, with the archive's capacity it had there."""
        if self._offloaded is None:
            return
        for stream, groups in zip(self.streams, self._offloaded, strict=True):
            stream.move_to(self.device, groups)
        self._offloaded = None

    def storage_breakdown(self) -> dict[str, int]:
        """Bytes held by both streams, by part (see :meth:`CodecStream.storage_breakdown`)."""
        return self.codec_cache.storage_breakdown()

    def storage_bytes(self) -> int:
        """Every byte both streams hold."""
        return self.codec_cache.storage_bytes()

    def stored_bits(self) -> int:
        return sum(stream.stored_bits() for stream in self.streams)

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
