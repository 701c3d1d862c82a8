"""Measuring what a KV cache does to a model: shared by the main job (demo/main.py) and the KV benchmarks.

A *tier* is a named way to build a transformers cache for a model: the raw ``DynamicCache`` (the reference), a
``FlashCodecCache`` with given options, or any other cache factory (peers such as transformers' ``QuantizedCache``).
Everything here drives a model through the public transformers API one forward call at a time, so the measured
quantities are what the cache does to the model:

- :func:`greedy`: prefill the prompt (exact), then decode greedily token by token; decode tok/s is timed.
- :func:`greedy_and_forced`: both of the above for one tier in one pass (they share every step until the first
  divergence).
- :func:`teacher_forced`: prefill a prefix (exact), then feed given target tokens one by one through the cache and
  return the log-probabilities each step assigned; every target after the first is predicted by a step that read
  the (possibly compressed) cache.
- :func:`cache_bytes`: bytes the cache keeps (``kv``) and holds in all (``held``, incl. views / buffers).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Tier:
    """A named cache recipe. ``options``: ``FlashCodecCache.from_config`` options, or ``None`` for the raw
    ``DynamicCache``; ``factory(model) -> cache`` overrides both (peers). ``note`` is printed with the results."""

    name: str
    options: Mapping[str, Any] | None = None
    factory: Callable[[Any], Any] | None = field(default=None, compare=False)
    note: str = ""

    @property
    def is_raw(self) -> bool:
        return self.options is None and self.factory is None


RAW = Tier("raw DynamicCache")


def main_tiers(materialization_free: bool = True) -> list[Tier]:
    """The main job's tiers: raw, png lossless, jpeg float, jpeg int8 at K = 8, 4, 2 (r = 8), and optionally the
    materialization-free decode path on the int8 K=8 tier."""
    tiers = [
        RAW,
        Tier("png keep=1.0", {"mode": "png", "block_size": 8, "keep_ratio": 1.0}),
        Tier("jpeg r=8 K=8", {"mode": "jpeg", "block_size": 8, "keep_freqs": 8, "quant_bits": None}),
        Tier("jpeg r=8 K=8 int8", {"mode": "jpeg", "block_size": 8, "keep_freqs": 8, "quant_bits": 8}),
        Tier("jpeg r=8 K=4 int8", {"mode": "jpeg", "block_size": 8, "keep_freqs": 4, "quant_bits": 8}),
        Tier("jpeg r=8 K=2 int8", {"mode": "jpeg", "block_size": 8, "keep_freqs": 2, "quant_bits": 8}),
    ]
    if materialization_free:
        options = {"mode": "jpeg", "block_size": 8, "keep_freqs": 8, "quant_bits": 8, "materialization_free": True,
                   "memoize": False, "strict": True}
        tiers.append(Tier("jpeg r=8 K=8 int8 mat-free", options,
                          note="decode attention on the stored coefficients (kvcodec attention), no view kept"))
    return tiers


def make_cache(model: Any, tier: Tier) -> Any:
    """A fresh, empty cache of ``tier`` for ``model``."""
    if tier.factory is not None:
        return tier.factory(model)
    if tier.options is None:
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    from flashcodec_fx.hf import FlashCodecCache

    return FlashCodecCache.from_config(model.config, **tier.options)


@contextlib.contextmanager
def prepared(model: Any, tier: Tier) -> Iterator[None]:
    """Run ``tier`` on ``model``: a materialization-free tier installs the ``"kvcodec"`` attention function for the
    duration (and removes it after), so its decode steps attend on the stored coefficients."""
    if not (tier.options or {}).get("materialization_free"):
        yield
        return
    from flashcodec_fx.hf import apply_codec_attention, remove_codec_attention

    apply_codec_attention(model)
    try:
        yield
    finally:
        remove_codec_attention(model)


def _tensor_bytes(obj: Any) -> int:
    """Bytes of a tensor, including the inner tensors of a tensor subclass (e.g. optimum-quanto's packed QTensor)."""
    if not isinstance(obj, torch.Tensor):
        return 0
    if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
        names, _ = obj.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(obj, name)) for name in names)
    return obj.nbytes


def cache_bytes(cache: Any) -> dict[str, int]:
    """``{"kv": bytes kept for the tokens, "held": every byte held}``.

    FlashCodecCache: ``kv`` = filled archive blocks (coefficients, scales, indices) + raw tails of the compressed
    layers + native layers; ``held`` = its ``storage_bytes()["total"]`` (allocated capacity, memoized views).
    Other caches: every tensor attribute of every layer (a raw ``DynamicCache`` holds exactly its tokens).
    """
    storage = getattr(cache, "storage_bytes", None)
    if callable(storage):
        parts = storage()
        kv = parts["archive_used"] + parts["tail"] + parts.get("native", 0)
        return {"kv": kv, "held": parts["total"]}
    total = 0
    for layer in cache.layers:
        total += sum(_tensor_bytes(value) for value in vars(layer).values())
    return {"kv": total, "held": total}


def _cache_kwarg(model: Any) -> str:
    """transformers >= 5.2x names the forward argument ``cache``; earlier releases ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _step(model: Any, ids: torch.Tensor, cache: Any, kwarg: str) -> torch.Tensor:
    """One forward call appending ``ids (B, T)``; returns the last position's fp32 log-probs ``(B, V)``."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache})
    return torch.log_softmax(out.logits[:, -1].float(), dim=-1)


@dataclass
class Generation:
    """``tokens (B, N)`` int64, ``logprobs (B, N, V)`` fp32 (what each step assigned), decode timing, final cache."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    decode_seconds: float
    decode_steps: int
    cache: Any

    @property
    def decode_tok_s(self) -> float:
        if self.decode_steps == 0 or self.decode_seconds <= 0:
            return math.nan
        return self.tokens.shape[0] * self.decode_steps / self.decode_seconds


@torch.no_grad()
def greedy(model: Any, prompt_ids: torch.Tensor, cache: Any, new_tokens: int) -> Generation:
    """Prefill ``prompt_ids (B, P)`` then decode exactly ``new_tokens`` tokens greedily (EOS does not stop it, so
    every tier is compared on the same number of tokens). Decode time counts the ``new_tokens - 1`` steps after the
    prefill."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    kwarg = _cache_kwarg(model)
    logprobs = [_step(model, prompt_ids, cache, kwarg)]
    tokens = [logprobs[0].argmax(-1, keepdim=True)]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        logprobs.append(_step(model, tokens[-1], cache, kwarg))
        tokens.append(logprobs[-1].argmax(-1, keepdim=True))
    seconds = time.perf_counter() - start
    return Generation(torch.cat(tokens, 1), torch.stack(logprobs, 1), seconds, new_tokens - 1, cache)


@torch.no_grad()
def greedy_and_forced(model: Any, prompt_ids: torch.Tensor, reference_tokens: torch.Tensor, cache: Any) -> Generation:
    """Both measurements of one tier in a single pass, for ``prompt_ids (1, P)`` and the reference continuation
    ``reference_tokens (1, N)``: ``logprobs`` are the teacher-forced log-probs ``(1, N, V)`` (as :func:`teacher_forced`),
    ``tokens`` the greedy continuation ``(1, N)`` (as :func:`greedy`).

    Greedy decoding and teacher forcing feed the same tokens until the greedy choice first differs from the
    reference, so the teacher-forced run is also the greedy run up to there; at that step the cache is copied and
    greedy decoding continues on the copy. Decode time covers every single-token step of both (not the copy)."""
    if prompt_ids.shape[0] != 1:
        raise ValueError(f"prompt_ids must have batch 1, got {tuple(prompt_ids.shape)}")
    kwarg, n = _cache_kwarg(model), reference_tokens.shape[1]
    logprobs = [_step(model, prompt_ids, cache, kwarg)]
    seconds, steps, diverged, fork = 0.0, 0, None, None
    for t in range(n):
        if diverged is None and int(logprobs[t].argmax(-1)) != int(reference_tokens[0, t]):
            diverged, fork = t, copy.deepcopy(cache)
        if t == n - 1:
            break
        start = time.perf_counter()
        logprobs.append(_step(model, reference_tokens[:, t: t + 1], cache, kwarg))
        seconds, steps = seconds + time.perf_counter() - start, steps + 1
    tokens = reference_tokens.clone()
    if diverged is not None:
        tokens[0, diverged] = logprobs[diverged].argmax(-1)[0]
        for t in range(diverged + 1, n):
            start = time.perf_counter()
            tokens[0, t] = _step(model, tokens[:, t - 1: t], fork, kwarg).argmax(-1)[0]
            seconds, steps = seconds + time.perf_counter() - start, steps + 1
    return Generation(tokens, torch.stack(logprobs, 1), seconds, steps, cache)


@torch.no_grad()
def teacher_forced(model: Any, prefix_ids: torch.Tensor, target_ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """Log-probs ``(B, T, V)`` fp32 that the model assigns at each target position: ``prefix_ids (B, P)`` goes
    through prefill (exact), then ``target_ids (B, T)`` is fed token by token through ``cache``; position ``t`` is
    predicted after reading ``prefix + target[:t]``."""
    kwarg = _cache_kwarg(model)
    logprobs = [_step(model, prefix_ids, cache, kwarg)]
    for t in range(target_ids.shape[1] - 1):
        logprobs.append(_step(model, target_ids[:, t: t + 1], cache, kwarg))
    return torch.stack(logprobs, 1)


def nll(logprobs: torch.Tensor, target_ids: torch.Tensor) -> float:
    """Mean negative log-likelihood (nats/token) of ``target_ids (B, T)`` under ``logprobs (B, T, V)``."""
    return float(-logprobs.gather(-1, target_ids.unsqueeze(-1)).mean())


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference || other) between next-token distributions given as log-probs."""
    return float((reference.exp() * (reference - other)).sum(-1).mean())


def token_match(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, int]:
    """(fraction of identical tokens, length of the common prefix) between two ``(1, N)`` token sequences."""
    same = (reference == other).flatten()
    prefix = int(same.numel() if bool(same.all()) else int(same.to(torch.int8).argmin()))
    return float(same.float().mean()), prefix


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """``columns``: (header, row key, format spec). Missing / None values print as ``-``."""
    head = "| " + " | ".join(c[0] for c in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for row in rows:
        cells = []
        for _, key, spec in columns:
            value = row.get(key)
            cells.append("-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
