"""``FlashCodecCache.fork``: several requests continued from one prefix (a loaded prompt cache) share its archives
(:mod:`flashcodec_fx.persist.fork`); native layers are deep-copied, as ``copy.deepcopy`` would."""

from __future__ import annotations

from ..persist.fork import fork
from .flash_codec_cache import FlashCodecCache
from .layer import FlashCodecLayer


def fork_cache(cache: FlashCodecCache) -> FlashCodecCache:
    """A copy of ``cache`` that shares the archives of its dynamic codec streams (copy-on-append)."""
    layers = [layer for layer in cache.layers if isinstance(layer, FlashCodecLayer)]
    busy = [idx for idx, layer in enumerate(cache.layers) if isinstance(layer, FlashCodecLayer) and layer.handed_out]
    if busy:
        raise ValueError(f"layers {busy} are in the middle of a step (attention has not read them yet): fork the "
                         f"cache between forward calls")
    shared = {} if cache.source_config is None else {id(cache.source_config): cache.source_config}
    return fork(cache, [s for layer in layers for s in layer.streams], shared)
