"""The transformers Cache contract, explored by a stateful fuzzer (issue 11).

A hypothesis ``RuleBasedStateMachine`` drives a two-layer ``FlashCodecCache`` next to transformers' ``DynamicCache``
(dynamic layout) or ``StaticCache`` (static layout) through random sequences of the calls transformers makes: ``update``
(T = 1..40, batch 1..3; every update is followed by the layer's attention, as in a model: the ``"kvcodec"`` function on
the stored form, or nothing on the decoded view), ``crop`` (negative and positive), ``reorder_cache``,
``batch_select_indices`` (indices and bool masks), ``batch_repeat_interleave``, ``reset`` (then another batch size),
``early_initialization``, deepcopy, and calls that must be refused. Each example draws the layers' tiers (png, lossy
tiers with the quantization stage: per-frequency bit tables, channel / token scales, Lloyd-Max levels, sinks, windows),
the dtype, the crop mode, the attention path and offloading (both layouts).

Invariants after every step:

- every codec layer's decoded ``keys`` / ``values`` equal, bitwise, a reference model of its codec: the history's raw
  sinks and tail and, for the archive, the stateless codec's ``decode(encode(group))`` of the same tokens
  (``StreamModel``; a dynamic stream's first tokens are its history itself, until its raw prefix converts, the mean
  then taken from the first call past the sinks); png layers equal the native cache's ``keys`` / ``values`` bitwise
  (grid data, bf16 and fp32);
- ``update`` returns the exact prompt on a first fill, the reference view on the decoded-view path; attention on the
  stored form equals attention over the reference view (the call's own tokens exact) to fp tolerance;
- ``get_seq_length`` / ``get_mask_sizes`` match the native cache (static: the views' capacity), ``is_croppable`` the
  contract (lossless 16-bit png or ``crop="decode"``), ``batch_size`` the rows held;
- ``storage_bytes()`` is an int equal to the ``storage_breakdown()`` parts and to the bytes of every tensor the layers
  hold; ``stored`` / ``archive_used`` / ``raw_equivalent`` equal what the reference model holds (``archive_used`` at
  most ``archive_held``, the allocated groups with their scales); an offloaded layer holds only its filled groups;
- a sliding-window ring (``SlidingContract``) drops the whole units no later query sees, as its reference model
  does, and reads the kept positions; its ``get_mask_sizes`` offset says where they start;
- a refused call (a crop reopening a lossy group, bad shapes or dtypes, a wrong bool mask, static overflow) raises the
  documented error and changes no state.

Budget: a bounded number of examples in CI; ``HYPOTHESIS_PROFILE=long`` runs the long profile (many more and longer
examples, minutes): ``HYPOTHESIS_PROFILE=long python -m pytest tests/hf/test_cache_contract_fuzz.py``.
"""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("hypothesis")

from cache_state import same, snapshot  # noqa: E402
from codec_tiers import grid_data as grid  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402
from transformers.cache_utils import DynamicCache, StaticCache  # noqa: E402

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx import CodecOverflowError  # noqa: E402
from flashcodec_fx.codecs import Codec  # noqa: E402
from flashcodec_fx.hf import FlashCodecLayer  # noqa: E402
from flashcodec_fx.hf.attention import MaterializationFreeFallback, flashcodec_attention_forward  # noqa: E402
from flashcodec_fx.hf.sliding_layer import FlashCodecSlidingLayer  # noqa: E402
from flashcodec_fx.raw_prefix import prefix_length  # noqa: E402

H, D, GQA = 2, 16, 2  # kv heads, head dim (a power of two: the rotation is a Walsh-Hadamard transform), q heads per kv
PROFILES = {
    "ci": settings(max_examples=25, stateful_step_count=16, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
    "long": settings(max_examples=400, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
}
FUZZ = PROFILES["long" if os.environ.get("HYPOTHESIS_PROFILE") == "long" else "ci"]

# Layer tiers (FlashCodecCache per-layer options): small versions of the presets' recipes (tests/codec_tiers.py).
_TABLE_KEYS = dict(mode="jpeg", block_size=8, quant_bits=(5, 3, 3, 2, 2, 2, 2, 2), levels=("uniform", "midrise"),
                   scale_axis="channel", group=16, scale_search=True, rotate=True, sinks=2)
TIERS = {
    "png": dict(mode="png"),
    "png-window": dict(mode="png", sinks=1, window=4),
    "int8": dict(mode="jpeg", block_size=8, quant_bits=8),
    "jpeg-k4": dict(mode="jpeg", block_size=8, keep_freqs=4, quant_bits=None),
    "png-half": dict(mode="png", keep_ratio=0.5),
    "3bit-small": dict(key_options=_TABLE_KEYS, value_options=dict(
        mode="jpeg", block_size=1, quant_bits=2, levels="lloyd", rotate=True, center=True, scale_search=True, sinks=2,
        window=3)),
    "4bit-small": dict(key_options=dict(mode="jpeg", block_size=1, quant_bits=4, levels="uniform",
                                        scale_axis="channel", group=8, scale_search=True, sinks=2),
                       value_options=dict(mode="jpeg", block_size=4, quant_bits=4, levels="midrise", center=True,
                                          rotate=5, sinks=2, window=2)),
}
EXACT_TIERS = ("png", "png-window")  # lossless: equal to the native cache


def lossless(codec: Codec, dtype: torch.dtype) -> bool:
    """The contract's exact tier: png keeping every delta, on a 16-bit stream."""
    return getattr(codec, "kept_deltas", -1) == codec.block_size - 1 and dtype in (torch.float16, torch.bfloat16)


class StreamModel:
    """Reference model of one codec stream: the history (B, H, n, D) and the archive's end, kept by the contract's
    rules; the view is the raw sinks and tail and the stateless codec's decode(encode(...)) of the archived groups.
    A dynamic stream holds its history raw (``raw``) until ``until`` tokens; then the archive's end is where the
    appends of every token would have moved it, and the mean that of the first call past the sinks (``first``). Tokens
    in the codec's state are held as stored: rounded to the raw rows' dtype (bf16 raw rows of an fp32 stream of a
    lossy per-token codec, ``Codec.resolved``), the tokens held raw as given."""

    def __init__(self, codec: Codec, dtype: torch.dtype, layout: str = "dynamic"):
        self.codec, self.dtype = codec, dtype
        self.hist: torch.Tensor | None = None
        self.start, self.mean = codec.sinks, None
        self.until = prefix_length(codec, D, dtype) if layout == "dynamic" else 0
        self.raw, self.first = False, None
        self.raw_dtype = codec.resolved(dtype).raw_rows_dtype(dtype)

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens ``x`` as the codec's state takes them in (rounded to the raw rows' dtype)."""
        return x.to(self.raw_dtype).to(x.dtype)

    @property
    def n(self) -> int:
        return 0 if self.hist is None else self.hist.shape[2]

    def archived(self) -> int:
        """Positions held by the sinks and the archive (none while raw)."""
        return 0 if self.raw else min(self.start, self.n)

    def _set_mean(self, x: torch.Tensor, at: int) -> None:
        """The mean of the tokens ``x`` of a call at position ``at`` past the sinks (the op's formula)."""
        counted = ((at + torch.arange(x.shape[2])) >= self.codec.sinks).float()
        self.mean = (x.float() * counted.view(1, 1, -1, 1)).sum(2) / counted.sum().clamp_min(1)

    def append(self, x: torch.Tensor) -> None:
        codec, n, t = self.codec, self.n, x.shape[2]
        if self.hist is None:
            self.hist = x[:, :, :0]
            self.mean = torch.zeros(x.shape[0], H, D) if codec.center else None
            self.raw = t < self.until
        if self.raw:
            self.first = (n, n + t) if self.first is None and n <= codec.sinks < n + t else self.first
            self.hist = torch.cat([self.hist, x], dim=2)
            if n + t < self.until:
                return
            self.raw, (lo, hi), self.first = False, self.first or (n, n + t), None  # converts
            self.hist = self.stored(self.hist)
            if codec.center and lo <= codec.sinks < hi:
                self._set_mean(self.hist[:, :, lo:hi], lo)
            behind = n + t - codec.sinks - codec.window
            self.start = codec.sinks + max(0, behind) // codec.group * codec.group
            return
        x = self.stored(x)
        if codec.center and n <= codec.sinks < n + t:  # the mean of the first append's tokens past the sinks
            self._set_mean(x, n)
        self.hist = torch.cat([self.hist, x], dim=2)
        behind = n + t - self.start - codec.window  # archive whole groups while the tail would hold window + G
        self.start += max(0, behind) // codec.group * codec.group

    def drop_front(self, tokens: int) -> None:
        """Forget the oldest ``tokens`` positions (whole archived groups of a ring; positions renumber from 0)."""
        self.hist = self.hist[:, :, tokens:]
        self.start -= tokens

    def view(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """What the stream reads, in ``dtype`` (default: the stream's; the archive decoded straight into it)."""
        codec, view = self.codec, self.hist.to(dtype or self.dtype, copy=True)
        end = self.archived()
        if end > codec.sinks:
            enc = codec.encode(self.hist[:, :, codec.sinks:end], self.mean)
            view[:, :, codec.sinks:end] = codec.decode(enc, view.dtype, self.mean)
        return view

    def reopened(self, keep: int) -> int:
        return self.codec.sinks + max(0, keep - self.codec.sinks) // self.codec.group * self.codec.group

    def crop_allowed(self, keep: int, mode: str) -> bool:
        return keep >= self.archived() or keep <= self.reopened(keep) or mode == "decode" \
            or lossless(self.codec, self.dtype)

    def crop(self, keep: int) -> None:
        if self.hist is None or keep >= self.n:
            return
        if self.raw or (keep == 0 and self.until):  # held raw, or emptied: raw again (the first call forgotten)
            self.hist = self.hist[:, :, :keep]
            self.raw, self.start = True, self.codec.sinks
            self.first = None if keep <= self.codec.sinks else self.first
            if self.codec.center and keep <= self.codec.sinks:
                self.mean = torch.zeros_like(self.mean)
            return
        if keep < self.start:
            reopened = self.reopened(keep)
            if keep > reopened:  # reopened tokens come back as the values attention read
                self.hist[:, :, reopened:keep] = self.view()[:, :, reopened:keep]
            self.start = reopened
        self.hist = self.hist[:, :, :keep]
        if self.codec.center and keep <= self.codec.sinks:
            self.mean = torch.zeros_like(self.mean)

    def select(self, rows: torch.Tensor) -> None:
        if self.hist is not None:
            self.hist = self.hist[rows]
            self.mean = None if self.mean is None else self.mean[rows]

    def repeat(self, repeats: int) -> None:
        if self.hist is not None:
            self.hist = self.hist.repeat_interleave(repeats, dim=0)
            self.mean = None if self.mean is None else self.mean.repeat_interleave(repeats, dim=0)

    def stored_bits(self, batch: int) -> int:
        """Bits the stored tokens take as stored: filled groups, raw sinks and tail rows holding tokens, the mean."""
        codec, n = self.codec, self.n
        if self.raw:  # the tokens and nothing else
            return 8 * batch * H * n * D * self.dtype.itemsize
        groups = max(0, min(n, self.start) - codec.sinks) // codec.group
        raw = min(n, codec.sinks) + max(0, n - max(self.start, codec.sinks))
        mean = batch * H * D * 4 if codec.center else 0
        return 8 * (batch * H * (groups * codec.group_bytes(D, self.dtype) + raw * D * self.raw_dtype.itemsize) + mean)

    def archive_bytes(self, batch: int) -> int:
        """Bytes of the filled archive groups."""
        codec = self.codec
        groups = max(0, self.archived() - codec.sinks) // codec.group
        return batch * H * groups * codec.group_bytes(D, self.dtype)

    def covering_bytes(self, batch: int) -> int:
        """Bytes of the fewest archive groups spanning the stored tokens' positions (none while raw)."""
        codec = self.codec
        groups = 0 if self.raw else -(-max(0, self.n - codec.sinks) // codec.group)
        return batch * H * groups * codec.group_bytes(D, self.dtype)


class LayerModel:
    """Reference model of one codec layer: its K and V :class:`StreamModel` (iterating gives both), the positions
    ``seen`` and, for a ring, how many it ``dropped`` at the front (0 for a full layer)."""

    dropped = 0

    def __init__(self, layer: FlashCodecLayer, dtype: torch.dtype):
        self.streams = tuple(StreamModel(s.codec, dtype, s.layout) for s in (layer.keys_stream, layer.values_stream))
        self.layout = layer.layout

    def __iter__(self):
        return iter(self.streams)

    def reset(self) -> None:
        """``reset()``: every token forgotten (a ring keeps recording the past once asked to, as transformers' own
        sliding layers do)."""
        self.streams = tuple(StreamModel(m.codec, m.dtype, self.layout) for m in self.streams)
        self.dropped = 0

    def __getitem__(self, i: int) -> StreamModel:
        return self.streams[i]

    @property
    def seen(self) -> int:
        return self.dropped + self.streams[0].n

    def target(self) -> int:
        """Positions dropped once the next call's update has slid (``get_mask_sizes``' offset)."""
        return self.dropped

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        for model, new in zip(self.streams, (k, v), strict=True):
            model.append(new)

    def crop_allowed(self, keep: int, mode: str) -> bool:
        return keep >= self.dropped and all(m.crop_allowed(keep - self.dropped, mode) for m in self.streams)

    def crop(self, keep: int) -> None:
        for m in self.streams:
            m.crop(keep - self.dropped)

    def select(self, rows: torch.Tensor) -> None:
        for m in self.streams:
            m.select(rows)

    def repeat(self, repeats: int) -> None:
        for m in self.streams:
            m.repeat(repeats)

    def visible(self, past: int, t: int, kv_length: int, offset: int) -> torch.Tensor:
        """``(T, kv_length)`` bool: key ``offset + j`` visible to query ``past + i`` (causal)."""
        return (offset + torch.arange(kv_length))[None] <= past + torch.arange(t)[:, None]


class RingModel(LayerModel):
    """A sliding-window codec layer (``FlashCodecSlidingLayer``): before each call it drops the whole units
    (``lcm`` of both groups) that are archived in both streams and below the first position a later query sees;
    nothing while recording the past (assisted decoding), until the next crop."""

    def __init__(self, layer: FlashCodecLayer, dtype: torch.dtype, window: int):
        super().__init__(layer, dtype)
        self.window, self.dropped, self.record = window, 0, False
        self.unit = math.lcm(*(m.codec.group for m in self.streams))

    def window_target(self) -> int:
        visible = max(0, self.seen - self.window + 1)
        archived = self.dropped + min(m.archived() for m in self.streams)
        return max(self.dropped, min(visible, archived) // self.unit * self.unit)

    def target(self) -> int:
        return self.dropped if self.record else self.window_target()

    def drop_to(self, target: int) -> None:
        if target > self.dropped:
            for m in self.streams:
                m.drop_front(target - self.dropped)
            self.dropped = target

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.drop_to(self.target())
        super().append(k, v)

    def crop(self, keep: int) -> None:
        super().crop(keep)
        if self.record:
            self.drop_to(self.window_target())

    def visible(self, past: int, t: int, kv_length: int, offset: int) -> torch.Tensor:
        """Causal and inside the window: ``0 <= (past + i) - (offset + j) < window``."""
        behind = past + torch.arange(t)[:, None] - (offset + torch.arange(kv_length))[None]
        return (behind >= 0) & (behind < self.window)


class _Attention(torch.nn.Module):
    """What transformers' sdpa function reads from an attention module, and the layer index it passes the cache."""

    num_key_value_groups, is_causal = GQA, True

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx


class CacheContract(RuleBasedStateMachine):
    """Shared rules; subclasses choose the layout and the native cache."""

    layout = "dynamic"

    def build(self, tiers: tuple[str, str], dtype: torch.dtype, crop: str, stored_form: bool, batch: int,
              offloading: bool = False) -> None:
        self.tiers, self.dtype, self.crop_mode, self.stored_form, self.batch = tiers, dtype, crop, stored_form, batch
        static = dict(layout="static", max_cache_len=self.max_len) if self.layout == "static" else {}
        self.cache = fx.FlashCodecCache(per_layer={i: TIERS[t] for i, t in enumerate(tiers)}, crop=crop,
                                        materialization_free=stored_form, offloading=offloading, **static,
                                        **self.layers_of())
        self.models = self.new_models()
        self.native = self.new_native()
        self.modules = [_Attention(idx) for idx in range(len(self.cache.layers))]

    def layers_of(self) -> dict:
        """The cache's layer arguments: two full-attention layers."""
        return {"num_layers": 2}

    def new_models(self) -> list[LayerModel]:
        return [RingModel(layer, self.dtype, layer.sliding_window) if isinstance(layer, FlashCodecSlidingLayer)
                else LayerModel(layer, self.dtype) for layer in self.cache.layers]

    def new_native(self):
        return DynamicCache()

    # --- helpers -------------------------------------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self.models[0].seen

    def states(self, t: int, seed: int, batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batch if batch is None else batch
        return grid((b, H, t, D), self.dtype, seed), grid((b, H, t, D), self.dtype, seed + 1)

    def mask(self, idx: int, past: int, t: int, kv_length: int, offset: int) -> torch.Tensor:
        """Layer ``idx``'s bool mask (B, 1, T, kv_length) of a call of ``t`` tokens after ``past``, its keys at
        positions ``offset ..`` (causal; a ring's within its window)."""
        return self.models[idx].visible(past, t, kv_length, offset).expand(self.batch, 1, t, kv_length)

    def step(self, cache, k: torch.Tensor, v: torch.Tensor, seed: int, past: int, check: bool) -> None:
        """One model step of ``t`` tokens after ``past`` through both layers of ``cache``: update, then attention as the
        model would run it. ``check``: compare with the reference models (already holding these tokens)."""
        t = k.shape[2]
        for idx, layer in enumerate(cache.layers):
            kv_length, offset = cache.get_mask_sizes(t, idx)
            first = int(layer.get_seq_length()) == 0
            with warnings.catch_warnings():
                warnings.simplefilter("error", MaterializationFreeFallback)
                out_k, out_v = cache.update(k, v, idx)
                if not self.stored_form:
                    if check:
                        self.check_returned(idx, out_k, out_v, k, v, first)
                    continue
                q = grid((self.batch, H * GQA, t, D), self.dtype, seed + 7 + idx) / 16
                mask = self.mask(idx, past, t, kv_length, offset)
                window = {"sliding_window": layer.sliding_window} if layer.is_sliding else {}
                attn, _ = flashcodec_attention_forward(self.modules[idx], q, out_k, out_v, mask, scaling=0.25, **window)
            if check:
                self.check_attention(idx, q, attn, k, v, past, offset)

    def check_returned(self, idx: int, out_k, out_v, k, v, first: bool) -> None:
        """The decoded-view path returns the exact prompt on a first fill, else the reference view with the call's own
        tokens exact (issue 22: whatever the window, the call reads its own states)."""
        for out, new, model in zip((out_k, out_v), (k, v), self.models[idx], strict=True):
            want = new if first else model.view()
            n, t = want.shape[2], new.shape[2]
            want[:, :, n - t:] = new
            assert torch.equal(out[:, :, :n], want), f"layer {idx}: update returned something else than the view"
            assert not out[:, :, n:].any()  # static: zeros past the length

    def check_attention(self, idx: int, q, attn, k, v, past: int, offset: int) -> None:
        """Attention on the stored form equals attention over the reference view (positions ``offset ..``), the call's
        own tokens exact (in fp32: the stored form is read without rounding the decoded archive to the stream dtype)."""
        t = k.shape[2]
        views = []
        for model, new in zip(self.models[idx], (k, v), strict=True):
            view = model.view(torch.float32)
            view[:, :, past - offset:past - offset + t] = new.float()
            views.append(view.repeat_interleave(GQA, dim=1))
        mask = self.mask(idx, past, t, past + t - offset, offset)
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), *views, attn_mask=mask, scale=0.25)
        tol = 1e-4 if self.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(attn.float(), want.transpose(1, 2), rtol=tol, atol=tol)

    # --- rules ---------------------------------------------------------------------------------------------------

    @rule(t=st.integers(1, 40), seed=st.integers(0, 2**20))
    def update(self, t, seed):
        if self.layout == "static":
            t = min(t, self.max_len - self.length)
            if t == 0:
                return
        k, v = self.states(t, seed)
        past = self.length
        for model in self.models:
            model.append(k, v)
        self.step(self.cache, k, v, seed, past, check=True)
        self.native_update(k, v)

    def native_update(self, k: torch.Tensor, v: torch.Tensor) -> None:
        for idx in range(2):
            self.native.update(k, v, idx)

    @rule(depth=st.integers(-45, 45))
    def crop(self, depth):
        """``depth < 0`` drops -depth tokens (past the start: empty); ``depth > 0`` keeps ``depth`` tokens; 0: no-op."""
        n = self.length
        keep = max(0, n + depth) if depth < 0 else min(depth or n, n)
        allowed = all(m.crop_allowed(keep, self.crop_mode) for m in self.models)
        before = snapshot(self.cache)
        if not allowed:
            with pytest.raises(ValueError, match="would reopen archived tokens|has dropped positions"):
                self.cache.crop(depth)
            assert same(snapshot(self.cache), before), "a refused crop changed the cache"
            return
        self.cache.crop(depth)
        for model in self.models:
            model.crop(keep)
        if keep < n:
            self.native_crop(keep - n)

    def native_crop(self, tokens_to_remove: int) -> None:
        if all(hasattr(layer, "crop") for layer in self.native.layers):
            self.native.crop(tokens_to_remove)
            return
        self.native = self.new_native()  # transformers 5.17's StaticLayer has no crop: refilled with what is kept
        if self.length:
            for idx, (keys, values) in enumerate(self.models):
                self.native.update(keys.hist, values.hist, idx)

    @precondition(lambda self: self.length > 0)
    @rule(data=st.data())
    def reorder_cache(self, data):
        beams = torch.tensor(data.draw(st.lists(st.integers(0, self.batch - 1), min_size=self.batch,
                                                max_size=self.batch)))
        self.cache.reorder_cache(beams)
        self.native.reorder_cache(beams)
        for model in self.models:
            model.select(beams)

    @rule(t=st.integers(1, 3), kind=st.sampled_from(["batch", "head_dim", "dtype", "kv", "empty", "int"]),
          seed=st.integers(0, 2**20))
    def refused_update(self, t, kind, seed):
        """Bad states raise the documented error before anything changes (the batch, head dim and dtype are fixed
        once the layer holds storage)."""
        k, v = self.states(t, seed)
        error = TypeError if kind == "int" else ValueError
        if kind in ("batch", "head_dim", "dtype") and not self.cache.layers[0].keys_stream.is_initialized:
            return
        if kind == "batch":
            k, v = self.states(t, seed, batch=self.batch + 1)
        elif kind == "head_dim":
            k, v = k[..., :8], v[..., :8]
        elif kind == "dtype":
            other = torch.float32 if self.dtype == torch.bfloat16 else torch.bfloat16
            k, v = k.to(other), v.to(other)
        elif kind == "kv":
            v = torch.cat([v, v], dim=2)
        elif kind == "empty":
            k, v = k[:, :, :0], v[:, :, :0]
        else:
            k, v = k.to(torch.int64), v.to(torch.int64)
        before = snapshot(self.cache)
        with pytest.raises(error):
            self.cache.update(k, v, 0)
        assert same(snapshot(self.cache), before), f"a refused update ({kind}) changed the cache"

    @rule(seed=st.integers(0, 2**20))
    def deepcopy(self, seed):
        """A deep copy reads the same and is independent: stepping it leaves the original as it was."""
        before = snapshot(self.cache)
        clone = copy.deepcopy(self.cache)
        for ours, theirs in zip(self.cache.layers, clone.layers, strict=True):
            assert self.same_views(ours, theirs)
        if self.layout == "dynamic" or self.length < self.max_len:
            self.step(clone, *self.states(1, seed), seed, self.length, check=False)
        assert same(snapshot(self.cache), before), "stepping a deep copy changed the original"
        self.cache = copy.deepcopy(self.cache)  # go on with a copy

    @staticmethod
    def same_views(a: FlashCodecLayer, b: FlashCodecLayer) -> bool:
        if a.keys is None or b.keys is None:
            return a.keys is None and b.keys is None
        return torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)

    # --- invariants ----------------------------------------------------------------------------------------------

    @invariant()
    def matches_the_reference(self):
        if not hasattr(self, "cache"):
            return
        n = self.length
        assert int(self.cache.get_seq_length()) == n == int(self.native.get_seq_length())
        for idx, (layer, models) in enumerate(zip(self.cache.layers, self.models, strict=True)):
            assert int(layer.get_seq_length()) == n == models.seen
            if models[0].hist is None:
                assert layer.keys is None or layer.keys.shape[2] == 0
                continue
            for got, model, name in ((layer.keys, models[0], "keys"), (layer.values, models[1], "values")):
                assert torch.equal(got, model.view()), f"layer {idx} ({self.tiers[idx]}) {name} differ from the reference"
            if self.tiers[idx] in EXACT_TIERS and n:
                native, kept = self.native.layers[idx], slice(models.dropped, n)
                assert torch.equal(layer.keys, native.keys[:, :, kept]) and torch.equal(layer.values,
                                                                                       native.values[:, :, kept])
            assert layer.batch_size == self.batch
        if all(layer.keys_stream.is_initialized for layer in self.cache.layers):  # the dtype is known from then on
            croppable = all(self.crop_mode == "decode" or lossless(m.codec, self.dtype) or m.codec.group == 1
                            for ms in self.models for m in ms)  # per-token groups: every crop ends at a group boundary
            assert self.cache.is_croppable == croppable
        self.check_mask_sizes()
        self.check_storage()

    def check_mask_sizes(self):
        for idx, model in enumerate(self.models):
            if isinstance(model, RingModel):  # the ring holds more than the native window: its offset says where from
                assert self.cache.get_mask_sizes(3, idx) == (model.seen - model.target() + 3, model.target())
            else:
                assert self.cache.get_mask_sizes(3, idx) == self.native.get_mask_sizes(3, idx)

    def check_storage(self):
        total = 0
        for layer, models in zip(self.cache.layers, self.models, strict=True):
            parts = layer.storage_breakdown()
            held = sum(t.nbytes for s in (layer.keys_stream, layer.values_stream) if s.is_initialized
                       for t in (*(s.state if s.state is not None else [s.tail]), *([] if s.memo is None else [s.memo])))
            summed = sum(parts[p] for p in ("archive", "scales", "sinks", "tail", "mean", "memo"))
            assert type(layer.storage_bytes()) is int and layer.storage_bytes() == parts["total"] == summed == held
            total += parts["total"]
            if models[0].hist is None:
                continue
            b = self.batch
            assert layer.stored_bits() == sum(m.stored_bits(b) for m in models)
            assert parts["archive_used"] == sum(m.archive_bytes(b) for m in models)
            assert parts["archive_used"] <= parts["archive_held"] == parts["archive"] + parts["scales"]
            assert parts["memo"] == 0 if self.stored_form else (parts["memo"] > 0) == any(not m.raw for m in models)
            if layer._offloaded is not None:  # on the host: the groups spanning the length at offload time
                assert parts["archive"] + parts["scales"] >= sum(m.covering_bytes(b) for m in models)
        breakdown = self.cache.storage_breakdown()
        assert self.cache.storage_bytes() == breakdown["total"] == total
        item = torch.empty((), dtype=self.dtype).element_size()
        held = sum(model[0].n for model in self.models)  # positions the layers hold (a ring: its kept ones)
        assert breakdown["raw_equivalent"] == 2 * self.batch * H * held * D * item


_TIER_PAIRS = st.tuples(st.sampled_from(sorted(TIERS)), st.sampled_from(sorted(TIERS)))
_DTYPES = st.sampled_from([torch.bfloat16, torch.float32])


class DynamicContract(CacheContract):
    """The dynamic layout next to a DynamicCache, with offloading on or off."""

    @initialize(tiers=_TIER_PAIRS, dtype=_DTYPES, crop=st.sampled_from(["exact", "decode"]), stored_form=st.booleans(),
                batch=st.integers(1, 3), offloading=st.booleans())
    def start(self, tiers, dtype, crop, stored_form, batch, offloading):
        self.build(tiers, dtype, crop, stored_form, batch, offloading)

    @precondition(lambda self: self.length > 0)
    @rule(data=st.data(), as_mask=st.booleans())
    def batch_select_indices(self, data, as_mask):
        if as_mask:
            keep = data.draw(st.lists(st.booleans(), min_size=self.batch, max_size=self.batch).filter(any))
            indices, rows = torch.tensor(keep), torch.tensor(keep).nonzero().flatten()
        else:
            picked = data.draw(st.lists(st.integers(0, self.batch - 1), min_size=1, max_size=3))
            indices = rows = torch.tensor(picked)
        self.cache.batch_select_indices(indices)
        self.native.batch_select_indices(indices)
        self.batch = rows.numel()
        for model in self.models:
            model.select(rows)

    @precondition(lambda self: self.length > 0 and self.batch <= 2)
    @rule(repeats=st.integers(1, 2))
    def batch_repeat_interleave(self, repeats):
        self.cache.batch_repeat_interleave(repeats)
        self.native.batch_repeat_interleave(repeats)
        self.batch *= repeats
        for model in self.models:
            model.repeat(repeats)

    @precondition(lambda self: self.length > 0)
    @rule(length=st.integers(1, 3))
    def refused_mask(self, length):
        """A bool mask of another length than the batch raises and changes nothing."""
        length += self.batch if length == self.batch else 0
        before = snapshot(self.cache)
        with pytest.raises(ValueError, match="boolean batch mask"):
            self.cache.batch_select_indices(torch.ones(length, dtype=torch.bool))
        assert same(snapshot(self.cache), before)

    @rule(batch=st.integers(1, 3))
    def reset(self, batch):
        """reset() forgets everything and releases the storage: the next update may bring another batch size."""
        self.cache.reset()
        self.native = self.new_native()  # DynamicCache.reset: 5.2x drops the layers' tensors, 5.17 zeroes them in place
        assert not self.cache.is_initialized and self.cache.storage_bytes() == 0
        self.batch = batch
        for model in self.models:
            model.reset()


class SlidingContract(DynamicContract):
    """A Gemma-3-shaped pair, a sliding-window layer (a codec ring, its tier without sinks) then a full one, next to
    a DynamicCache of full layers (the ring's kept positions are compared with the native ones they stand for)."""

    @initialize(tiers=_TIER_PAIRS, dtype=_DTYPES, crop=st.sampled_from(["exact", "decode"]), stored_form=st.booleans(),
                batch=st.integers(1, 3), offloading=st.booleans(), window=st.integers(3, 24))
    def start(self, tiers, dtype, crop, stored_form, batch, offloading, window):
        self.window = window
        self.build(tiers, dtype, crop, stored_form, batch, offloading)
        assert isinstance(self.models[0], RingModel) and not isinstance(self.models[1], RingModel)

    def layers_of(self) -> dict:
        from transformers import Gemma3TextConfig

        return {"config": Gemma3TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                           sliding_window=self.window, num_attention_heads=H * GQA,
                                           num_key_value_heads=H, head_dim=D, hidden_size=H * GQA * D)}

    @rule()
    def activate_past_recording(self):
        """What assisted decoding calls before drafting: the ring keeps every position until the next crop."""
        self.cache.layers[0].activate_past_recording()
        self.models[0].record = True


class StaticContract(CacheContract):
    """The static layout next to a StaticCache (the calls transformers makes on a static cache), with offloading on
    or off."""

    layout = "static"

    @initialize(tiers=_TIER_PAIRS, dtype=_DTYPES, crop=st.sampled_from(["exact", "decode"]), stored_form=st.booleans(),
                batch=st.integers(1, 3), max_len=st.integers(24, 120), early=st.booleans(), offloading=st.booleans())
    def start(self, tiers, dtype, crop, stored_form, batch, max_len, early, offloading):
        self.max_len = max_len
        self.build(tiers, dtype, crop, stored_form, batch, offloading)
        if early:  # transformers' chunked-prefill / export path
            for cache in (self.cache, self.native):
                cache.early_initialization(batch_size=batch, num_heads=H, head_dim=D, dtype=dtype, device="cpu")
            assert self.cache.is_initialized and self.cache.batch_size == batch

    def new_native(self):
        return _static_native(self.max_len)

    def check_mask_sizes(self):
        """Static views span the capacity: the smallest count >= max_cache_len both archives tile."""
        for idx, layer in enumerate(self.cache.layers):
            capacity, codecs = layer.capacity, (layer.keys_stream.codec, layer.values_stream.codec)
            assert self.cache.get_mask_sizes(3, idx) == (capacity, 0)
            step = math.lcm(*(c.group for c in codecs))
            assert self.max_len <= capacity < self.max_len + step and (capacity - codecs[0].sinks) % step == 0

    @rule(extra=st.integers(1, 5), seed=st.integers(0, 2**20))
    def overflow(self, extra, seed):
        """More tokens than max_cache_len: CodecOverflowError (an IndexError, as StaticCache's callers expect)."""
        k, v = self.states(self.max_len - self.length + extra, seed)
        before = snapshot(self.cache)
        with pytest.raises(IndexError, match="max_length"):
            self.cache.update(k, v, 0)
        assert same(snapshot(self.cache), before)
        assert issubclass(CodecOverflowError, ValueError)

    @rule()
    def reset(self):
        """Static reset zeroes in place (stable addresses); the batch stays."""
        self.cache.reset()
        self.native.reset()
        for model in self.models:
            model.reset()


def _static_native(max_len: int) -> StaticCache:
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=H * GQA, num_key_value_heads=H, head_dim=D,
                         hidden_size=H * GQA * D)
    return StaticCache(config=config, max_cache_len=max_len)


TestDynamicContract = DynamicContract.TestCase
TestDynamicContract.settings = FUZZ
TestSlidingContract = SlidingContract.TestCase
TestSlidingContract.settings = FUZZ
TestStaticContract = StaticContract.TestCase
TestStaticContract.settings = FUZZ
