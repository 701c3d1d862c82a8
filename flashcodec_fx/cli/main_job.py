"""The main job's measurement: one model generating greedily with the raw cache and each compressed-KV tier.

For each tier, side by side in one run: KV bytes vs the raw cache (what the cache keeps for the tokens, and every
byte it holds incl. allocated capacity and memoized views), bits per cached value, greedy token match vs the raw
cache (fraction identical, prefix until the first divergence), the teacher-forced NLL / perplexity of the raw
model's continuation fed token by token through the tier's cache, the mean KL of next-token distributions vs raw
(with its fp32 noise floor), decode tok/s and the tier's wall time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..evaluate import (
    RAW,
    Tier,
    bits_per_value,
    cache_bytes,
    cached_values,
    greedy,
    greedy_and_forced,
    main_tiers,
    make_cache,
    markdown_table,
    mean_kl,
    nll,
    prepared,
    token_match,
)

STORY = Path(__file__).with_name("story.txt")
"""The opening of *Alice's Adventures in Wonderland*, chapter I (Lewis Carroll, 1865; public domain): about 1,300
tokens of real text, long enough that the presets' raw sinks and windows are a small part of what they store."""
DEFAULT_PROMPT = ("Read the opening of this story.\n\n" + STORY.read_text().strip()
                  + "\n\nWhat happens to Alice in this passage, and where is she at the end of it?")
NAMED = {"raw": RAW.name, "png": "png keep=1.0", "jpeg": "jpeg r=8 K=8", "jpeg-int8": "jpeg r=8 K=8 int8",
         "jpeg-k4-int8": "jpeg r=8 K=4 int8", "jpeg-k2-int8": "jpeg r=8 K=2 int8",
         "view": "jpeg r=8 K=8 int8 view"}
"""Short names of the main job's named tiers (``--tiers``) -> tier names."""
DEFAULT_NAMED = ("raw", "png", "jpeg-int8")  # without presets: the lossless tier and the 8-bit tier
FP32_EPS = torch.finfo(torch.float32).eps
COLUMNS = [
    ("tier", "tier", "s"), ("KV bytes vs raw", "kv_ratio", ".3f"), ("bits/value", "bits_per_value", ".2f"),
    ("held vs raw", "held_ratio", ".3f"), ("token match", "token_match", ".3f"), ("NLL", "nll", ".4f"),
    ("ppl", "ppl", ".3f"), ("KL vs raw", "kl_text", "s"), ("decode tok/s", "decode_tok_s", ".2f"),
    ("seconds", "seconds", ".3g"),
]


def markdown_rows(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> list[str]:
    """The lines of ``evaluate.markdown_table``: header, separator, one per row (printed as rows come)."""
    return markdown_table(rows, columns).splitlines()


def presets() -> dict[str, Mapping[str, Any]]:
    """``flashcodec_fx.PRESETS`` (name -> CacheConfig) when the package defines it, else empty."""
    import flashcodec_fx

    return dict(getattr(flashcodec_fx, "PRESETS", None) or {})


def available_tiers() -> dict[str, Tier]:
    """Every tier ``--tiers`` / ``--preset`` can name: the named tiers (:data:`NAMED`) and the presets."""
    by_name = {tier.name: tier for tier in [RAW, *main_tiers(view=True)]}
    tiers = {key: by_name[name] for key, name in NAMED.items()}
    for name in presets():
        if name in tiers:
            raise ValueError(f"preset {name!r} clashes with a named tier of the main job")
        tiers[name] = Tier(f"preset {name}", {"preset": name})
    return tiers


def default_tier_names() -> list[str]:
    """raw, then every preset of ``flashcodec_fx.PRESETS`` (the lossless and 8-bit tiers among them) when the package
    defines presets; else raw, png lossless and the 8-bit tier."""
    found = presets()
    return ["raw", *found] if found else list(DEFAULT_NAMED)


def resolve_tiers(names: list[str]) -> list[Tier]:
    """Tiers for ``names`` in order, the raw reference first (added when absent); ValueError naming what is allowed."""
    tiers = available_tiers()
    unknown = [name for name in names if name not in tiers]
    if unknown:
        raise ValueError(f"unknown tier(s) {unknown}; choose from {list(tiers)}")
    ordered = ["raw", *(name for name in dict.fromkeys(names) if name != "raw")]
    return [tiers[name] for name in ordered]


def kl_noise_floor(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Rounding bound of the mean KL between fp32 log-prob tensors ``(..., V)``: per position, how far each
    distribution's mass is from 1 plus fp32 rounding of every log-prob, weighted by the reference probabilities.
    A measured KL at or below it is indistinguishable from 0."""
    ref, oth = reference.double(), other.double()
    p = ref.exp()
    mass = (p.sum(-1) - 1).abs() + (oth.exp().sum(-1) - 1).abs()
    rounding = FP32_EPS * (p * (ref.abs() + oth.abs())).sum(-1)
    return float((mass + rounding).mean())


def kl_text(kl: float, floor: float | None) -> str:
    """``0`` for the reference, ``< floor`` when the KL is within its rounding floor (never negative), else ``1.23e-4``."""
    if floor is None:
        return "0"
    if kl <= floor:
        return f"< {floor:.0e}"
    return f"{kl:.2e}"


class StepProgress:
    """Counts a tier's forward calls on a progress bar (``bar``: a tqdm-like object with ``update`` / ``total`` /
    ``refresh``). ``reference``: the raw tier's tokens ``(1, N)`` when the tier is teacher-forced on them: the bar then
    grows by the greedy steps that follow the first divergence (see ``evaluate.greedy_and_forced``)."""

    def __init__(self, model: Any, bar: Any, reference: torch.Tensor | None = None):
        self.bar, self.reference, self.calls, self.diverged = bar, reference, 0, False
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        if self.reference is not None and not self.diverged and self.calls < self.reference.shape[1]:
            if int(output.logits[0, -1].argmax()) != int(self.reference[0, self.calls]):
                self.diverged = True
                self.bar.total += self.reference.shape[1] - self.calls - 1
                self.bar.refresh()
        self.calls += 1
        self.bar.update(1)

    def close(self) -> None:
        self.handle.remove()


def measure(model: Any, ids: torch.Tensor, new_tokens: int, tiers: list[Tier],
            progress: Callable[[Tier, int], Any]) -> Iterator[dict[str, Any]]:
    """Run every tier on ``ids (1, P)``, yielding one row per tier as soon as it is measured (the first tier must be
    the raw reference). ``progress(tier, total_steps)`` returns the tier's progress bar (closed after the tier)."""
    if not tiers or not tiers[0].is_raw:
        raise ValueError("tiers must start with the raw DynamicCache tier (the reference)")
    ref = raw_bytes = values = None
    for tier in tiers:
        bar = progress(tier, new_tokens)
        counter = StepProgress(model, bar, None if ref is None else ref.tokens)
        threads = torch.get_num_threads()
        start = time.perf_counter()
        try:
            if ref is None:
                gen = ref = greedy(model, ids, make_cache(model, tier), new_tokens)
                raw_bytes, values = cache_bytes(ref.cache)["kv"], cached_values(ref.cache)
            else:
                with prepared(model, tier):
                    gen = greedy_and_forced(model, ids, ref.tokens, make_cache(model, tier))
        finally:
            counter.close()
            bar.close()
        seconds = time.perf_counter() - start
        yield row(tier, gen, ref, raw_bytes, values, seconds) | {"threads": threads}


def prepare_kernels(device: str) -> tuple[str, float] | None:
    """Build (or load) the fused C++ CPU kernels now, before any tier is timed, so that no row's time includes a
    first build (~30 s, once per machine; ``ops/cpu/build.py`` announces it on stderr). ``(a line saying what
    happened, seconds)``; None off the CPU or with ``FLASHCODEC_KERNELS=reference``."""
    from ..ops.cpu import ENV, EXTENSION, kernel_mode
    from ..ops.cpu.build import binary_path

    if torch.device(device).type != "cpu" or kernel_mode() == "reference":
        return None
    binary = binary_path()
    cached = binary.exists()
    start = time.perf_counter()
    module = EXTENSION.module()
    seconds = time.perf_counter() - start
    if module is None:
        return (f"CPU kernels: not built ({EXTENSION.error}); the codec tiers run the reference ops (slower; "
                f"{ENV}=reference silences this)", seconds)
    if cached:
        return f"CPU kernels: fused C++, loaded in {seconds:.1f} s", seconds
    return f"CPU kernels: fused C++, built in {seconds:.0f} s before the first tier (once per machine: {binary.parent})", seconds


def row(tier: Tier, gen: Any, ref: Any, raw_bytes: int, values: int, seconds: float) -> dict[str, Any]:
    """One result row of ``tier`` (see the module docstring); ``ref`` is the raw tier's generation."""
    match, prefix = token_match(ref.tokens, gen.tokens)
    nbytes = cache_bytes(gen.cache)
    loss = nll(gen.logprobs, ref.tokens)
    if gen is ref:
        kl, floor = 0.0, None
    else:
        kl = mean_kl(ref.logprobs.double(), gen.logprobs.double())
        floor = kl_noise_floor(ref.logprobs, gen.logprobs)
    return {
        "tier": tier.name, "options": None if tier.options is None else dict(tier.options), "note": tier.note,
        "kv_bytes": nbytes["kv"], "kv_ratio": nbytes["kv"] / raw_bytes,
        "bits_per_value": bits_per_value(nbytes["kv"], values),
        "held_bytes": nbytes["held"], "held_ratio": nbytes["held"] / raw_bytes,
        "token_match": match, "match_prefix": prefix, "nll": loss, "ppl": math.exp(loss),
        "kl": max(kl, 0.0), "kl_noise_floor": floor, "kl_text": kl_text(kl, floor),
        "decode_tok_s": gen.decode_tok_s, "seconds": seconds, "tokens": gen.tokens[0].tolist(),
    }
