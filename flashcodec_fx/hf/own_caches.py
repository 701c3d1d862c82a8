"""Models that build a cache of their own instead of taking the one ``generate()`` prepares (transformers'
``_supports_default_dynamic_cache()`` is False for them): MiniMax (lightning linear attention beside full attention,
its own ``MiniMaxCache``), and Mamba, RWKV, xLSTM, Reformer, XLNet (no KV cache of transformers' kind).

For a model listed in :data:`OWN_CACHES` the codec cache is a subclass of both :class:`FlashCodecCache` and the
model's own class, so the model's ``isinstance`` check passes, its own methods keep its own states (MiniMax's
``linear_cache``), and its attention layers carry codecs. Every other such model compresses nothing: ``apply_flash_codec``
says so when it is called (:class:`~flashcodec_fx.hf.flash_codec_cache.NoCodecLayers`; ``strict=True`` raises).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from .flash_codec_cache import FlashCodecCache
from .layer import FlashCodecLayer


def builds_own_cache(model: Any) -> bool:
    """Whether ``generate()`` leaves the cache to ``model`` itself (it prepares none)."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    return supports is not None and not supports()


CACHE_ARGUMENTS = ("cache", "past_key_values")  # the names transformers' forwards take a Cache by (5.24+, before)


def takes_cache(model: Any) -> bool:
    """Whether ``model``'s forward takes a KV cache at all (a ``cache`` / ``past_key_values`` parameter): OpenAI GPT's,
    for one, recomputes every token at every step and keeps none."""
    try:
        parameters = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):  # no signature to read: assume it does
        return True
    return any(name in parameters for name in CACHE_ARGUMENTS)


@functools.cache
def _minimax_cache_class() -> type[FlashCodecCache]:
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    class FlashCodecMiniMaxCache(FlashCodecCache, MiniMaxCache):
        """MiniMax's cache with codec layers on its full-attention layers (one layer per model layer, from its
        config): its linear-attention states stay in ``linear_cache`` as ``MiniMaxCache`` keeps them (per layer index;
        the layers of those indices are placeholders), and move with the batch; a crop raises, as it does natively."""

        is_croppable = False

        def __init__(self, *args: Any, **kwargs: Any):
            self.linear_cache = []
            FlashCodecCache.__init__(self, *args, **kwargs)

        def get_linear_cache(self, layer_idx: int) -> Any:
            return self.linear_cache[layer_idx] if layer_idx < len(self.linear_cache) else None

        def _linear(self, layer_idx: int) -> bool:
            return layer_idx < len(self.linear_cache) and not isinstance(self.linear_cache[layer_idx], list)

        def batch_repeat_interleave(self, repeats: int) -> None:
            for idx in range(len(self.layers)):
                if self._linear(idx):
                    self.linear_cache[idx] = self.linear_cache[idx].repeat_interleave(repeats, dim=0)
                elif isinstance(self.layers[idx], FlashCodecLayer):
                    self.layers[idx].batch_repeat_interleave(repeats)

        def batch_select_indices(self, indices: Any) -> None:
            for idx in range(len(self.layers)):
                if self._linear(idx):
                    self.linear_cache[idx] = self.linear_cache[idx][indices, ...]
                elif isinstance(self.layers[idx], FlashCodecLayer):
                    self.layers[idx].batch_select_indices(indices)

        def reorder_cache(self, beam_idx: Any) -> None:
            self.batch_select_indices(beam_idx)

        crop = MiniMaxCache.crop

    return FlashCodecMiniMaxCache


OWN_CACHES: dict[str, Callable[[], type[FlashCodecCache]]] = {
    "minimax": _minimax_cache_class,
}
"""``config.model_type`` -> the codec cache class that is also the model's own cache class."""


def own_cache_class(model: Any) -> type[FlashCodecCache] | None:
    """The codec cache class serving ``model``'s own cache (:data:`OWN_CACHES`), None where there is none."""
    make = OWN_CACHES.get(getattr(getattr(model, "config", None), "model_type", None))
    return None if make is None else make()


__all__ = ["OWN_CACHES", "builds_own_cache", "own_cache_class", "takes_cache"]
