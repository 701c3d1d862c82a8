"""The peers bench_ppl measures beside the flashcodec tiers, as cache tiers grouped by method family. Benchmark
code, not part of the package's API: KIVI-2/4 and TurboQuant-style K4V4 / K3V3 / K3V2 are fake-quant caches
(:mod:`peers.fakequant`) whose bytes are the real formats'; quanto int4 is transformers' own ``QuantizedCache``."""

from __future__ import annotations

from flashcodec_fx.evaluate import Tier

from .fakequant import FakeQuantCache
from .kivi import KiviPolicy
from .quanto import quanto_tier
from .turboquant import TurboQuantPolicy

KIVI = "KIVI"
TURBOQUANT = "TurboQuant-style"
QUANTO = "quanto"
TURBOQUANT_BITS = ((4, 4), (3, 3), (3, 2))


def _fake_quant_tier(policy, note: str) -> Tier:
    return Tier(policy.name, factory=lambda model: FakeQuantCache(model.config, policy), note=note)


def peer_tiers() -> list[tuple[str, Tier]]:
    """``(family, tier)`` for every peer, in the order they are run."""
    tiers = [(KIVI, _fake_quant_tier(KiviPolicy(bits), "fake-quant; keys per channel g32, values per token g32, "
                                     "fp16 scale + min, newest 128 raw")) for bits in (2, 4)]
    tiers += [(TURBOQUANT, _fake_quant_tier(TurboQuantPolicy(kb, vb), "fake-quant; random-sign Walsh-Hadamard, "
                                            "Lloyd-Max Gaussian levels, fp16 norm per vector, nothing raw"))
              for kb, vb in TURBOQUANT_BITS]
    tiers.append((QUANTO, quanto_tier(4)))
    return tiers
