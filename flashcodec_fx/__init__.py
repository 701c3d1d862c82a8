"""flashcodec_fx: compressed KV cache for PyTorch LLMs; attention runs on the stored coefficients.

Importing the package defines the ``torch.ops.flashcodec`` custom ops (:mod:`flashcodec_fx.ops`: their reference,
fake and CPU kernels, and CUDA kernels that load Triton on their first call) and loads torch and nothing else of
weight: every other public name is imported on first use (PEP 562), so ``import flashcodec_fx`` and the
``flashcodec`` command's ``--help`` / ``--version`` load neither Dynamo nor Inductor nor transformers nor Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import _compat  # noqa: F401  (the torch version floor, checked on import)

__version__ = "0.2.0"

_LAZY = {  # public name -> the module that defines it (relative to this package)
    **dict.fromkeys(("CodecKVCache", "CodecOverflowError", "CodecStream", "codec_decode_attention"), ".cache"),
    **dict.fromkeys(("Codec", "JPEGCodec", "PNGCodec", "make_codec", "register_codec"), ".codecs"),
    **dict.fromkeys(("CacheConfig", "LayerConfig", "StreamConfig", "cache_config"), ".config"),
    **dict.fromkeys(("DEFAULT_PRESET", "PRESETS"), ".presets"),
    "UntestedTransformersWarning": "._compat",
    **dict.fromkeys(("load_pretrained", "model_folder"), ".pretrained"),  # the bundled models, offline
    # the compile pass (imports Dynamo)
    **dict.fromkeys(("CompiledGenerateWarning", "backend", "compile_model"), ".passes"),
    # the transformers integration (optional dependency)
    **dict.fromkeys(("FlashCodecCache", "FlashCodecLayer", "MaterializationFreeFallback", "NoCodecLayers",
                     "apply_codec_attention",
                     "apply_flash_codec", "compress_kv", "remove_codec_attention", "remove_flash_codec"), ".hf"),
}

__all__ = [
    "DEFAULT_PRESET", "PRESETS", "CacheConfig", "Codec", "CodecKVCache", "CodecOverflowError", "CodecStream",
    "JPEGCodec", "LayerConfig", "PNGCodec", "StreamConfig", "cache_config", "codec_decode_attention", "load_pretrained",
    "make_codec", "model_folder", "ops", "UntestedTransformersWarning", "register_codec", "__version__",
]


from . import ops  # noqa: E402  (defines torch.ops.flashcodec.*: every op, on import)


def __getattr__(name: str) -> Any:
    """Import the module behind a public name on first access and keep the name here (later lookups are plain)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    else:
        raise AttributeError(f"module 'flashcodec_fx' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
