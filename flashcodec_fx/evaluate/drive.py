"""Driving a model through a cache one forward call at a time (public transformers API only).

- :func:`greedy`: prefill the prompt (exact), then decode greedily token by token; decode tok/s is timed.
- :func:`greedy_and_forced`: both greedy decoding and teacher forcing for one tier in one pass (they share every
  step until the first divergence).
- :func:`teacher_forced`: prefill a prefix (exact), then feed given target tokens one by one through the cache and
  return the log-probabilities each step assigned.
- :func:`streaming` (the streaming protocol): prefill ``prefill`` tokens (exact), then feed the rest of the window in
  chunks of ``chunk`` tokens through the cache; every token after the prefill is scored, and a chunk's queries read
  the history through the cache. :func:`stream_steps` says which positions each call feeds and scores.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


def cache_kwarg(model: Any) -> str:
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
    kwarg = cache_kwarg(model)
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
    kwarg, n = cache_kwarg(model), reference_tokens.shape[1]
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
    kwarg = cache_kwarg(model)
    logprobs = [_step(model, prefix_ids, cache, kwarg)]
    for t in range(target_ids.shape[1] - 1):
        logprobs.append(_step(model, target_ids[:, t: t + 1], cache, kwarg))
    return torch.stack(logprobs, 1)


def stream_steps(length: int, prefill: int, chunk: int) -> list[tuple[slice, slice]]:
    """The streaming protocol's forward calls for a window of ``length`` tokens, as ``(fed, targets)`` position
    slices: the prefill feeds ``[0, prefill)`` and its last position predicts token ``prefill``; then each chunk
    feeds ``[s, min(s + chunk, length))`` and its positions predict the tokens one further on (the window's last
    token is fed but predicts nothing). Every target in ``[prefill, length)`` is scored exactly once."""
    for name, value in (("length", length), ("prefill", prefill), ("chunk", chunk)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if not 1 <= prefill < length:
        raise ValueError(f"prefill must be in [1, length) = [1, {length}), got {prefill}")
    steps = [(slice(0, prefill), slice(prefill, prefill + 1))]
    for start in range(prefill, length, chunk):
        end = min(start + chunk, length)
        steps.append((slice(start, end), slice(start + 1, min(end + 1, length))))
    return steps


@dataclass(frozen=True)
class StreamStep:
    """One forward call of :func:`streaming`: ``fed`` / ``targets`` position slices of the window and the fp32
    log-probs ``(B, targets.stop - targets.start, V)`` that predicted the target tokens."""

    fed: slice
    targets: slice
    logprobs: torch.Tensor


@torch.no_grad()
def streaming(model: Any, ids: torch.Tensor, cache: Any, prefill: int = 128, chunk: int = 16) -> Iterator[StreamStep]:
    """Feed ``ids (B, L)`` through ``cache`` by the streaming protocol (:func:`stream_steps`), yielding each call's
    scored log-probs as it runs (so several tiers can be driven side by side without keeping the whole window's
    distributions)."""
    kwarg = cache_kwarg(model)
    for fed, targets in stream_steps(ids.shape[1], prefill, chunk):
        scored = targets.stop - targets.start
        keep = 1 if fed.start == 0 else fed.stop - fed.start
        logits = model(input_ids=ids[:, fed], use_cache=True, logits_to_keep=keep, **{kwarg: cache}).logits
        logits = logits[:, -1:] if fed.start == 0 else logits[:, :scored]
        yield StreamStep(fed, targets, torch.log_softmax(logits.float(), dim=-1))


def streamed_logprobs(model: Any, ids: torch.Tensor, cache: Any, prefill: int = 128, chunk: int = 16) -> torch.Tensor:
    """All of :func:`streaming`'s log-probs at once: ``(B, L - prefill, V)``, row ``t`` predicting ``ids[:, prefill + t]``."""
    return torch.cat([step.logprobs for step in streaming(model, ids, cache, prefill, chunk)], dim=1)
