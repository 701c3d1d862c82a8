"""Stateless codec math: DCT basis, rotation, level sets, packing, the quantizer, the codec registry and the
registered codecs (`jpeg`, `png`)."""

from __future__ import annotations

from .base import Codec, Encoded
from .dct import dct_basis
from .jpeg import JPEGCodec
from .levels import LEVELS, level_table, qmax
from .png import PNGCodec
from .quant import AXES, Quantizer
from .registry import CODECS, codec_class, codec_from_spec, codec_options, make_codec, register_codec
from .rotation import rotation

__all__ = [
    "AXES", "CODECS", "LEVELS", "Codec", "Encoded", "JPEGCodec", "PNGCodec", "Quantizer", "codec_class",
    "codec_from_spec", "codec_options", "dct_basis", "level_table", "make_codec", "qmax", "register_codec",
    "rotation",
]
