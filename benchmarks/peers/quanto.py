"""transformers' ``QuantizedCache`` with the optimum-quanto backend (the ``[bench]`` extra), at transformers'
defaults: per-token groups of 64 values (``axis=0``), asymmetric int4 / int2 with a scale and a shift per group in
the model's dtype, the 128 newest tokens raw until they are flushed together. Its bytes are measured from the
tensors it holds (the packed ``QTensor``'s inner tensors included). transformers refuses models with
sliding-window layers (``ValueError``), which the benchmark then reports as skipped."""

from __future__ import annotations

from typing import Any

from flashcodec_fx.evaluate import Tier

GROUP = 64
RESIDUAL = 128


def quanto_tier(nbits: int) -> Tier:
    def factory(model: Any) -> Any:
        from transformers import QuantizedCache

        return QuantizedCache("quanto", model.config, nbits=nbits, q_group_size=GROUP, residual_length=RESIDUAL)

    return Tier(f"quanto int{nbits}", factory=factory,
                note=f"transformers QuantizedCache(quanto), group {GROUP} per token, residual {RESIDUAL} raw")
