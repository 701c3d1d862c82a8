"""flashcodec_fx: compressed KV cache for PyTorch LLMs; attention runs on the stored coefficients."""

from __future__ import annotations

from . import _compat, ops  # noqa: F401  (_compat: torch version floor)
from .cache import CodecKVCache, CodecOverflowError, CodecStream, codec_decode_attention
from .codecs import Codec, JPEGCodec, PNGCodec, make_codec, register_codec
from .config import CacheConfig, LayerConfig, StreamConfig, cache_config
from .presets import DEFAULT_PRESET, PRESETS

__version__ = "0.2.0"

_HF_NAMES = ("FlashCodecCache", "FlashCodecLayer", "MaterializationFreeFallback", "apply_codec_attention",
             "apply_flash_codec", "compress_kv", "remove_codec_attention", "remove_flash_codec")

__all__ = [
    "DEFAULT_PRESET", "PRESETS", "CacheConfig", "Codec", "CodecKVCache", "CodecOverflowError", "CodecStream",
    "JPEGCodec", "LayerConfig", "PNGCodec", "StreamConfig", "cache_config", "codec_decode_attention", "make_codec", "ops",
    "register_codec", "__version__",
]


def __getattr__(name: str):
    """Lazy ``flashcodec_fx.backend`` / ``flashcodec_fx.compile_model``: importing the compile pass loads Dynamo.
    Lazy transformers integration (``flashcodec_fx.hf``, the ``_HF_NAMES``): transformers stays optional."""
    if name in ("CompiledGenerateWarning", "backend", "compile_model"):
        from . import passes

        return getattr(passes, name)
    if name in _HF_NAMES:
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'flashcodec_fx' has no attribute {name!r}")
