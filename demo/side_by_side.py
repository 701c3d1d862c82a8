"""The model side of the demo app (demo/app.py): tiers, streamed side-by-side turns, the every-tier comparison.

Importable without Gradio. One :class:`Engine` holds the model (loaded once), its tokenizer and a lock: every turn
and every comparison runs under the lock, so two browser sessions never interleave steps or attention patching.

What is measured, per panel and turn:

- KV footprint, from the cache's own byte accounting (``storage_breakdown()``): ``kept`` (what the cache stores
  for its tokens: filled archive blocks with scales and indices + raw tails; for a native cache its K/V tensors),
  ``view`` (the materialized full-precision memo an eager memoized decode keeps; 0 materialization-free or
  compiled), ``held`` (every byte the cache holds: kept + view + allocated capacity), bits per stored value
  (``cache.bits_per_value()`` when the cache has it, else ``8 * kept / values stored``; a native fp32 cache is 32).
- memory: ``peak`` / ``steady`` held cache bytes (the largest ``held`` after any step, and ``held`` at the end).
  This is byte accounting of the cache's tensors, not the process RSS: transient buffers inside a step (e.g. the
  CPU reference op's per-step dequantized copy) are not in it. On CUDA the allocator's peak and end-of-turn
  allocation above what was allocated before the panel ran (weights excluded, activations included) are added; the
  two panels then run one after the other so that each allocator peak is the panel's own.
- latency: prefill seconds, then every decode step (wall time until the token is on the host).
- token match of a panel against the left (native) panel: fraction of identical tokens over the common length and
  the matching prefix.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from flashcodec_fx.evaluate import (
    RAW,
    Tier,
    bits_per_value,
    cache_bytes,
    cache_kwarg,
    greedy,
    greedy_and_forced,
    main_tiers,
    make_cache,
    mean_kl,
    nll,
    prepared,
    token_match,
)

MATERIALIZATION_FREE = {"materialization_free": True, "memoize": False, "strict": True}
DECODED_VIEW = {"materialization_free": False, "memoize": True}  # the switch off: attention on a memoized view
CAPACITY_STEP = 256  # compiled turns use static caches of a multiple of this many tokens: few distinct shapes
MAX_NEW_TOKENS = 512


class RequestError(ValueError):
    """A request the demo refuses with a message for the user (too long, empty)."""


def codec_tiers() -> list[Tier]:
    """Every compressed tier the package offers, read at call time: each ``flashcodec_fx.PRESETS`` entry (when the
    package has presets; built with ``preset=NAME``), then the main job's named tiers (``main_tiers``: png lossless,
    jpeg K=8 float and int8, K=4 int8, K=2 int8) whose options no preset already has."""
    import flashcodec_fx

    presets = getattr(flashcodec_fx, "PRESETS", None) or {}
    tiers = [Tier(str(name), {"preset": name}, note=_config_text(config)) for name, config in presets.items()]
    known = list(presets.values())
    for tier in main_tiers(view=False):
        if not tier.is_raw and flashcodec_fx.cache_config(**tier.options) not in known:
            tiers.append(Tier(tier.name, tier.options, note=_options_text(tier.options)))
    return tiers


def _options_text(options: Any) -> str:
    return ", ".join(f"{key}={value}" for key, value in dict(options).items())


def _config_text(config: Any) -> str:
    """``key: jpeg block_size=1, ...; value: ...`` (one stream when keys and values are stored alike)."""
    key, value = config.layers.key, config.layers.value
    streams = [("", key)] if key == value else [("key: ", key), ("value: ", value)]
    return "; ".join(f"{label}{stream.codec} {_options_text(stream.as_dict)}".strip() for label, stream in streams)


def with_switches(tier: Tier, materialization_free: bool = False, capacity: int | None = None) -> Tier:
    """``tier`` decoding materialization-free (attention on the stored coefficients, no view), on its decoded view
    (a memo; the switch off), or, with ``capacity``, in the static unmemoized layout a compiled decode step reads.
    The raw tier is returned unchanged."""
    if tier.is_raw or tier.factory is not None:
        return tier
    options = dict(tier.options)
    if capacity is not None:
        options.update(layout="static", max_cache_len=capacity, memoize=False)
        return Tier(f"{tier.name} compiled", options, note=tier.note)
    if materialization_free:
        options.update(MATERIALIZATION_FREE)
        return Tier(f"{tier.name} mat-free", options, note=tier.note)
    options.update(DECODED_VIEW)
    return Tier(tier.name, options, note=tier.note)


def footprint(cache: Any, dtype: torch.dtype) -> dict[str, float]:
    """Bytes of ``cache`` by role (see the module docstring) and bits per stored value; ``dtype``: the model's
    (what one uncompressed value takes)."""
    held = cache_bytes(cache)["held"]
    breakdown = getattr(cache, "storage_breakdown", None)
    if callable(breakdown):
        parts, kept = breakdown(), cache_bytes(cache)["kv"]
        values = (parts["raw_equivalent"] + parts["native"]) // torch.empty((), dtype=dtype).element_size()
        own = getattr(cache, "bits_per_value", None)
        bits = float(own()) if callable(own) else bits_per_value(kept, values) if values else math.nan
        return {"kept": kept, "archive": parts["archive_used"], "tail": parts["tail"], "view": parts["memo"],
                "held": held, "bits_per_value": bits}
    kept = values = 0
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if not getattr(layer, "is_initialized", False) or not isinstance(keys, torch.Tensor) or keys.dim() < 2:
            continue
        share = min(1.0, int(layer.get_seq_length()) / max(keys.shape[-2], 1))  # a static layer holds its capacity
        kept += round(share * (keys.nbytes + layer.values.nbytes))
        values += round(share * (keys.numel() + layer.values.numel()))
    return {"kept": kept, "archive": 0, "tail": 0, "view": 0, "held": held,
            "bits_per_value": bits_per_value(kept, values) if values else math.nan}


class Memory:
    """Peak / steady memory of one panel's turn: held cache bytes sampled after every step; on CUDA also the
    allocator's peak and final allocation above the allocation when the meter started."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.peak_held = 0
        if self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
        self.device = device

    def sample(self, cache: Any) -> None:
        self.peak_held = max(self.peak_held, cache_bytes(cache)["held"])

    def result(self, cache: Any) -> dict[str, float]:
        out = {"peak_held": self.peak_held, "steady_held": cache_bytes(cache)["held"]}
        if self.cuda:
            torch.cuda.synchronize(self.device)
            out["cuda_peak"] = torch.cuda.max_memory_allocated(self.device) - self.base
            out["cuda_steady"] = torch.cuda.memory_allocated(self.device) - self.base
        return out


@dataclass
class PanelRun:
    """One panel's turn: exact prefill of ``ids (1, P)``, then greedy decoding token by token until EOS or
    ``max_new`` tokens. ``step``: the callable running decode steps (the model, or its compiled form);
    ``compiled``: the static capacity of a compiled run (None: eager)."""

    engine: Engine
    tier: Tier
    ids: torch.Tensor
    max_new: int
    step: Callable[..., Any]
    compiled: int | None = None
    tokens: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    prefill_seconds: float = math.nan
    done: bool = False

    def __post_init__(self) -> None:
        self.cache = make_cache(self.engine.model, self.tier)
        self.memory = Memory(self.engine.device)
        self.final_memory: dict[str, float] | None = None

    @property
    def _compiled_key(self) -> tuple[bool, int | None]:
        return self.tier.is_raw or self.tier.factory is not None, self.compiled

    @property
    def compiles_next(self) -> bool:
        """The next step is the first compiled step for this kind of cache and capacity: it compiles."""
        return (self.compiled is not None and bool(self.tokens) and not self.step_seconds
                and self._compiled_key not in self.engine.warm)

    def _token(self, logits: torch.Tensor, seconds_since: float) -> None:
        token = int(logits[0, -1].argmax())  # the host needs the token to show it: one sync per step, by design
        elapsed = time.perf_counter() - seconds_since
        if self.tokens:
            self.step_seconds.append(elapsed)
        else:
            self.prefill_seconds = elapsed
        self.tokens.append(token)
        self.memory.sample(self.cache)
        self.done = len(self.tokens) >= self.max_new or token in self.engine.eos_ids
        if self.done:
            self.final_memory = self.memory.result(self.cache)

    @torch.no_grad()
    def advance(self) -> None:
        """Run the next forward call (the prefill first): one more token."""
        if self.done:
            return
        kwarg = {self.engine.cache_kwarg: self.cache}
        start = time.perf_counter()
        if not self.tokens:
            out = self.engine.model(input_ids=self.ids, use_cache=True, logits_to_keep=1, **kwarg)
        else:
            position = self.ids.shape[1] + len(self.tokens) - 1
            last = torch.tensor([[self.tokens[-1]]], device=self.engine.device)
            compiled = self.compiled is not None
            extra = {"position_ids": torch.tensor([[position]], device=self.engine.device)} if compiled else {}
            out = self.step(input_ids=last, use_cache=True, **extra, **kwarg)
            if compiled:
                self.engine.warm.add(self._compiled_key)
        self._token(out.logits, start)

    def stats(self, reference: PanelRun | None = None) -> dict[str, Any]:
        """Numbers for the stats row: footprint, memory, latency, token match vs ``reference``."""
        compiled = self.compiled is not None
        out: dict[str, Any] = {"tier": self.tier.name, "tokens": len(self.tokens), "prompt_tokens": self.ids.shape[1],
                               "prefill_s": self.prefill_seconds, "compiled": compiled}
        out |= footprint(self.cache, self.engine.model.dtype)
        out |= self.final_memory or self.memory.result(self.cache)
        steps = self.step_seconds[1:] if compiled else self.step_seconds  # a compiled first step may compile
        out["first_step_s"] = self.step_seconds[0] if compiled and self.step_seconds else None
        out["ms_per_token"] = 1e3 * statistics.median(steps) if steps else math.nan
        out["tok_s"] = len(steps) / sum(steps) if steps and sum(steps) > 0 else math.nan
        if reference is not None and reference.tokens and self.tokens:
            n = min(len(reference.tokens), len(self.tokens))
            match, prefix = token_match(torch.tensor([reference.tokens[:n]]), torch.tensor([self.tokens[:n]]))
            out |= {"match": match, "match_prefix": prefix, "match_over": n}
        return out


@dataclass
class TurnUpdate:
    """What the UI shows after each step of a turn: both panels' text and stats so far, and a status line."""

    left_text: str
    right_text: str
    left: dict[str, Any]
    right: dict[str, Any]
    status: str
    finished: bool = False


class Engine:
    """The shared model of the demo: ``model``, ``tokenizer``, ``label`` (shown in the app), one lock for all runs."""

    def __init__(self, model: Any, tokenizer: Any, label: str):
        self.model, self.tokenizer, self.label = model, tokenizer, label
        self.device = next(model.parameters()).device
        self.lock = threading.Lock()
        self.cache_kwarg = cache_kwarg(model)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        self.max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self._compiled: dict[bool, Callable[..., Any]] = {}
        self.warm: set[tuple[bool, int | None]] = set()  # (native?, capacity) of the compiled steps already run

    def describe(self) -> str:
        """One line: model, layers, KV heads x head dim, dtype, device."""
        config = self.model.config.get_text_config(decoder=True)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return (f"{self.label}: {config.num_hidden_layers} layers, {heads} KV heads x head dim {dim}, "
                f"{str(self.model.dtype).removeprefix('torch.')}, {self.device}")

    def tiers(self) -> dict[str, Tier]:
        """Every codec tier by name (read from the package now, so new presets appear without edits)."""
        return {tier.name: tier for tier in codec_tiers()}

    def encode(self, messages: list[dict[str, str]]) -> torch.Tensor:
        """``(1, P)`` int64 ids of a conversation (role / content dicts) ending with a user turn: the tokenizer's
        chat template with the generation prompt, or the plain text of the turns when it has no template."""
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                     return_dict=True)["input_ids"]
        else:
            ids = self.tokenizer("\n".join(m["content"] for m in messages), return_tensors="pt")["input_ids"]
        return ids.to(self.device, torch.int64)

    def check_request(self, ids: torch.Tensor, max_new: int) -> None:
        """Refuse an empty prompt, a token budget outside 1..MAX_NEW_TOKENS or a context past the model's positions."""
        if ids.shape[1] == 0:
            raise RequestError("the prompt is empty: type a message first")
        if not 1 <= max_new <= MAX_NEW_TOKENS:
            raise RequestError(f"max new tokens must be in 1..{MAX_NEW_TOKENS}, got {max_new}")
        if self.max_positions is not None and ids.shape[1] + max_new > self.max_positions:
            raise RequestError(f"the conversation is {ids.shape[1]} tokens; with {max_new} new tokens it passes the "
                               f"model's {self.max_positions} positions: clear the chat or ask for fewer tokens")

    def compiled_step(self, codec: bool) -> Callable[..., Any]:
        """The model compiled once (per kind) for decode steps: the flashcodec backend (the SDPA-over-cache pass,
        strict: no view may remain) for codec caches, Inductor for the native static cache."""
        if codec not in self._compiled:
            import flashcodec_fx

            backend = flashcodec_fx.backend(strict=True) if codec else "inductor"
            self._compiled[codec] = torch.compile(self.model, backend=backend, fullgraph=True, dynamic=False)
        return self._compiled[codec]

    @contextlib.contextmanager
    def _locked(self, waiting: list[bool]) -> Iterator[None]:
        if not self.lock.acquire(blocking=False):
            waiting.append(True)
            self.lock.acquire()
        try:
            yield
        finally:
            self.lock.release()

    def panels(self, left_ids: torch.Tensor, right_ids: torch.Tensor, tier: Tier, max_new: int,
               materialization_free: bool, compiled: bool) -> tuple[PanelRun, PanelRun]:
        """The two runs of a turn: the native cache on ``left_ids (1, P)`` and ``tier`` on ``right_ids (1, P')``,
        eager (``materialization_free``: the right one attends on the stored coefficients) or compiled (static
        caches of a capacity rounded up to ``CAPACITY_STEP`` tokens)."""
        for ids in (left_ids, right_ids):
            self.check_request(ids, max_new)
        if not compiled:
            right = with_switches(tier, materialization_free=materialization_free)
            return (PanelRun(self, RAW, left_ids, max_new, self.model), PanelRun(self, right, right_ids, max_new, self.model))
        longest = max(left_ids.shape[1], right_ids.shape[1]) + max_new
        capacity = math.ceil(longest / CAPACITY_STEP) * CAPACITY_STEP
        from transformers import StaticCache

        static_raw = Tier(f"StaticCache {capacity} compiled",
                          factory=lambda model: StaticCache(config=model.config, max_cache_len=capacity))
        return (PanelRun(self, static_raw, left_ids, max_new, self.compiled_step(codec=False), compiled=capacity),
                PanelRun(self, with_switches(tier, capacity=capacity), right_ids, max_new,
                         self.compiled_step(codec=True), compiled=capacity))

    def turn(self, left_ids: torch.Tensor, right_ids: torch.Tensor, tier: Tier, max_new: int,
             materialization_free: bool = False, compiled: bool = False) -> Iterator[TurnUpdate]:
        """Stream one turn: the left panel answers ``left_ids`` with the native cache, the right one ``right_ids``
        with ``tier`` (see :meth:`panels`). Yields after every token. On CPU the panels alternate token by token;
        on CUDA they run one after the other, so that each allocator peak is its panel's own."""
        waiting: list[bool] = []
        left, right = self.panels(left_ids, right_ids, tier, max_new, materialization_free, compiled)
        sequential = self.device.type == "cuda"
        with self._locked(waiting), prepared(self.model, right.tier):
            status = "waited for another session's run; generating" if waiting else "generating"
            while not (left.done and right.done):
                for run in (left, right):
                    if run.done:
                        continue
                    if sequential and run is right and not right.tokens:
                        right.memory = Memory(self.device)  # the right panel's allocator window starts now
                    if run.compiles_next:
                        kind = "flashcodec" if run is right else "native"
                        yield self._update(left, right, f"compiling the {kind} decode step (first turn at this capacity)")
                    run.advance()
                    yield self._update(left, right, status)
                    if sequential:
                        break
            yield self._update(left, right, "finished", finished=True)

    def _update(self, left: PanelRun, right: PanelRun, status: str, finished: bool = False) -> TurnUpdate:
        decode = self.tokenizer.decode
        return TurnUpdate(decode(left.tokens, skip_special_tokens=True), decode(right.tokens, skip_special_tokens=True),
                          left.stats(), right.stats(left), status, finished)

    def compare(self, prompt: str, tiers: list[Tier], new_tokens: int,
                materialization_free: bool = False) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """The full comparison on one prompt: the native cache, then every tier in ``tiers``. Yields
        ``(tiers done, rows)`` after each; the first row is the native cache. Row keys: tier, kept / view / held
        bytes, kv_ratio (kept vs native), bits_per_value, peak_held / steady_held (and cuda_peak / cuda_steady),
        decode_tok_s, nll (teacher-forced NLL of the native continuation through the tier's cache), kl (mean KL of
        next-token distributions vs native), match / match_prefix (greedy tokens vs native)."""
        ids = self.encode([{"role": "user", "content": prompt}])
        self.check_request(ids, new_tokens)
        if new_tokens < 2:
            raise RequestError("the comparison needs at least 2 new tokens (one decode step after the prefill)")
        rows: list[dict[str, Any]] = []
        with self._locked([]):
            memory = Memory(self.device)
            with _watch_cache(self.model, memory):
                ref = greedy(self.model, ids, make_cache(self.model, RAW), new_tokens)
            rows.append(_compare_row(RAW, ref, ref, memory, self.model.dtype))
            yield 0, rows
            for done, tier in enumerate(tiers, 1):
                tier = with_switches(tier, materialization_free=materialization_free)
                memory = Memory(self.device)
                with prepared(self.model, tier), _watch_cache(self.model, memory):
                    gen = greedy_and_forced(self.model, ids, ref.tokens, make_cache(self.model, tier))
                rows.append(_compare_row(tier, gen, ref, memory, self.model.dtype))
                yield done, rows


@contextlib.contextmanager
def _watch_cache(model: Any, memory: Memory) -> Iterator[None]:
    """Sample the held bytes of the cache every forward call of ``model`` receives (after the call)."""

    def hook(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            memory.sample(cache)

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _compare_row(tier: Tier, gen: Any, ref: Any, memory: Memory, dtype: torch.dtype) -> dict[str, Any]:
    """One row of the comparison (see :meth:`Engine.compare`); ``dtype``: the model's."""
    size, raw = footprint(gen.cache, dtype), footprint(ref.cache, dtype)
    match, prefix = token_match(ref.tokens, gen.tokens)
    return {"tier": tier.name, "note": tier.note, **size, "kv_ratio": size["kept"] / raw["kept"],
            **memory.result(gen.cache), "decode_tok_s": gen.decode_tok_s, "nll": nll(gen.logprobs, ref.tokens),
            "kl": 0.0 if tier.is_raw else mean_kl(ref.logprobs, gen.logprobs), "match": match, "match_prefix": prefix,
            "tokens": gen.tokens.shape[1]}
