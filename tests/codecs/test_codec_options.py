"""Every invalid codec option or spec is rejected with an error naming the parameter."""

from __future__ import annotations

import pytest

from flashcodec_fx.codecs import JPEGCodec, PNGCodec, codec_from_spec, make_codec

BAD_OPTIONS = [
    ("jpeg", {"block_size": 1}, "block_size"),
    ("jpeg", {"block_size": 0}, "block_size"),
    ("jpeg", {"block_size": 8.0}, "block_size"),
    ("jpeg", {"block_size": "8"}, "block_size"),
    ("jpeg", {"block_size": True}, "block_size"),
    ("jpeg", {"block_size": 8, "keep_freqs": 0}, "keep_freqs"),
    ("jpeg", {"block_size": 8, "keep_freqs": 9}, "keep_freqs"),
    ("jpeg", {"block_size": 8, "keep_freqs": 4.0}, "keep_freqs"),
    ("jpeg", {"block_size": 8, "keep_freqs": True}, "keep_freqs"),
    ("jpeg", {"quant_bits": 4}, "quant_bits"),
    ("jpeg", {"quant_bits": 0}, "quant_bits"),
    ("jpeg", {"quant_bits": 16}, "quant_bits"),
    ("jpeg", {"quant_bits": 8.0}, "quant_bits"),
    ("jpeg", {"quant_bits": "8"}, "quant_bits"),
    ("jpeg", {"quant_bits": True}, "quant_bits"),
    ("jpeg", {"keep_ratio": 0.5}, "keep_ratio"),
    ("png", {"block_size": 1}, "block_size"),
    ("png", {"block_size": 257}, "block_size"),
    ("png", {"block_size": 4.0}, "block_size"),
    ("png", {"keep_ratio": 0.0}, "keep_ratio"),
    ("png", {"keep_ratio": -0.5}, "keep_ratio"),
    ("png", {"keep_ratio": 1.5}, "keep_ratio"),
    ("png", {"keep_ratio": float("nan")}, "keep_ratio"),
    ("png", {"keep_ratio": "0.5"}, "keep_ratio"),
    ("png", {"keep_ratio": True}, "keep_ratio"),
    ("png", {"keep_freqs": 4}, "keep_freqs"),
    ("png", {"quant_bits": 8}, "quant_bits"),
]


@pytest.mark.parametrize(("mode", "options", "name"), BAD_OPTIONS)
def test_bad_option_is_rejected_naming_the_parameter(mode, options, name):
    with pytest.raises((ValueError, TypeError), match=name):
        make_codec(mode, **options)


@pytest.mark.parametrize("mode", ["gif", "JPEG", "", None, 0])
def test_unknown_mode(mode):
    with pytest.raises(ValueError, match="mode"):
        make_codec(mode)


def test_direct_constructors_validate_too():
    with pytest.raises(ValueError, match="block_size"):
        JPEGCodec(block_size=1)
    with pytest.raises(ValueError, match="keep_ratio"):
        PNGCodec(keep_ratio=2)


@pytest.mark.parametrize(("spec", "name"), [
    ([0, 8, 8], "spec"),
    ([0, 8, 8, 0, 0], "spec"),
    ([2, 8, 8, 0], "mode"),
    ([0, 1, 1, 0], "block_size"),
    ([0, 8, 9, 0], "keep_freqs"),
    ([0, 8, 0, 0], "keep_freqs"),
    ([0, 8, 8, 4], "quant_bits"),
    ([1, 8, 8, 8], "quant_bits"),
    ([1, 8, 1, 0], "rows"),
    ([1, 8, 9, 0], "rows"),
    ([1, 300, 300, 0], "block_size"),
])
def test_bad_spec_list(spec, name):
    with pytest.raises(ValueError, match=name):
        codec_from_spec(spec)


def test_good_specs_round_trip():
    for codec in (make_codec("jpeg", block_size=4, keep_freqs=2, quant_bits=8), make_codec("jpeg", block_size=16),
                  make_codec("png", block_size=8), make_codec("png", block_size=8, keep_ratio=0.5)):
        assert codec_from_spec(codec.spec).spec == codec.spec
        assert codec_from_spec(tuple(codec.spec)).spec == codec.spec
