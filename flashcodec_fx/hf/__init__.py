"""transformers integration (optional dependency): FlashCodecCache, hot patch, class decorator, codec attention.

See docs/hf.md. Importing this package imports transformers and registers the ``"kvcodec"`` attention
implementation with transformers' AttentionInterface.
"""

from __future__ import annotations

from .._compat import require_transformers

require_transformers()  # before any transformers import: an old release fails with the version and the fix

from .attention import MaterializationFreeFallback, apply_codec_attention, remove_codec_attention  # noqa: E402
from .flash_codec_cache import FlashCodecCache, NoCodecLayers  # noqa: E402
from .layer import FlashCodecLayer  # noqa: E402
from .patch import apply_flash_codec, compress_kv, remove_flash_codec  # noqa: E402

__all__ = ["FlashCodecCache", "FlashCodecLayer", "MaterializationFreeFallback", "NoCodecLayers", "apply_codec_attention",
           "apply_flash_codec", "compress_kv", "remove_codec_attention", "remove_flash_codec"]
