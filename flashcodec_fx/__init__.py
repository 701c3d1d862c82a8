"""flashcodec_fx: compressed KV cache for PyTorch LLMs; attention runs on the stored coefficients."""

from __future__ import annotations

from . import ops
from .cache import CodecKVCache, CodecStream, codec_decode_attention
from .codecs import Codec, JPEGCodec, PNGCodec, make_codec

__version__ = "0.1.0"

__all__ = [
    "Codec", "CodecKVCache", "CodecStream", "JPEGCodec", "PNGCodec", "codec_decode_attention", "make_codec", "ops",
    "__version__",
]
