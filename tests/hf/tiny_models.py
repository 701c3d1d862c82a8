"""Helpers of the per-architecture tests (issue 40): a seeded tiny model of any transformers ``model_type`` from a
few config fields, a left-padded batch, a greedy generate, and the flashcodec warnings a call raised."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

VOCAB = 128


def tiny_auto_model(model_type: str, seed: int = 0, **config: Any) -> Any:
    """A seeded, eval-mode fp32 ``AutoModelForCausalLM`` of ``model_type`` (``pad_token_id=0``, ``config`` fields)."""
    import transformers

    torch.manual_seed(seed)
    built = transformers.AutoConfig.for_model(model_type, **{"pad_token_id": 0, **config})
    return transformers.AutoModelForCausalLM.from_config(built).eval()


def padded_batch(length: int = 30, pad: int = 14, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of ``length`` ids, the second left-padded by ``pad`` (id 0); ``(ids, attention_mask)``."""
    ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask


def greedy(model: Any, ids: torch.Tensor, mask: torch.Tensor | None = None, new_tokens: int = 8, **kwargs: Any) -> Any:
    """``model.generate``, greedy, with sequences and logits."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                              return_dict_in_generate=True, output_logits=True, **kwargs)


def codec_greedy(model: Any, ids: torch.Tensor, mask: torch.Tensor | None = None, new_tokens: int = 8,
                 **options: Any) -> Any:
    """:func:`greedy` under ``apply_flash_codec(model, **options)``, removed afterwards."""
    import flashcodec_fx as fx

    fx.apply_flash_codec(model, **options)
    try:
        return greedy(model, ids, mask, new_tokens)
    finally:
        fx.remove_flash_codec(model)


def cache_of(out: Any) -> Any:
    """The cache of a generate output (``cache`` or ``past_key_values``, across transformers 5.x)."""
    return out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache


def flashcodec_warnings(call: Callable[[], Any]) -> tuple[Any, list[warnings.WarningMessage]]:
    """``call()``'s result and the warnings of flashcodec's own classes it raised (every one, repeats included)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [w for w in caught if type(w.message).__module__.startswith("flashcodec_fx")]


def apply_saying(model: Any, category: str, words: str, **options: Any) -> None:
    """``apply_flash_codec(model, **options)``, checking that flashcodec said exactly one thing: a ``category``
    warning whose message holds ``words``."""
    import flashcodec_fx as fx

    _, caught = flashcodec_warnings(lambda: fx.apply_flash_codec(model, **options))
    said = [f"{type(w.message).__name__}: {w.message}" for w in caught]
    assert len(said) == 1 and said[0].startswith(f"{category}: ") and words in said[0], said


def same_logits(a: Any, b: Any, atol: float = 0.0) -> bool:
    """Whether two generate outputs have identical tokens and logits within ``atol`` (0: bitwise identical)."""
    return torch.equal(a.sequences, b.sequences) and all(
        torch.allclose(x, y, rtol=0.0, atol=atol) for x, y in zip(a.logits, b.logits, strict=True))
