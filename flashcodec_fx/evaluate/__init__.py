"""Measuring what a KV cache does to a model: tiers, driving a model through a cache, metrics, byte accounting.

Shared by the main job (`flashcodec run`), the benchmarks and the tests. transformers is imported only when a cache is
built or a model is driven, so importing this package needs torch only.
"""

from __future__ import annotations

from .drive import (
    Generation,
    StreamStep,
    cache_kwarg,
    greedy,
    greedy_and_forced,
    stream_steps,
    streamed_logprobs,
    streaming,
    teacher_forced,
)
from .metrics import mean_kl, nll, token_kl, token_match, token_nll
from .report import markdown_table
from .storage import bits_per_value, cache_bytes, cached_values
from .tiers import RAW, Tier, main_tiers, make_cache, prepared

__all__ = [
    "RAW", "Generation", "StreamStep", "Tier", "bits_per_value", "cache_bytes", "cache_kwarg", "cached_values",
    "greedy", "greedy_and_forced", "main_tiers", "make_cache", "markdown_table", "mean_kl", "nll", "prepared",
    "stream_steps", "streamed_logprobs", "streaming", "teacher_forced", "token_kl", "token_match", "token_nll",
]
