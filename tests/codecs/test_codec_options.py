"""Codec options and specs: every invalid option or spec is rejected with an error naming the parameter; specs round
trip; the stored bytes per group are what the archive allocates, and the bits per value follow."""

from __future__ import annotations

import re

import pytest
import torch
from _codec_data import DTYPES, FAST, bit_table_and_levels
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx.codecs import CODECS, JPEGCodec, PNGCodec, codec_from_spec, make_codec
from flashcodec_fx.codecs import codec_options as options_of
from flashcodec_fx.codecs.base import RAW_DTYPES

# (mode, options, exception, name in the message): wrong types raise TypeError, wrong values ValueError.
BAD_OPTIONS = [
    ("jpeg", {"block_size": 0}, ValueError, "block_size"),
    ("jpeg", {"block_size": 257}, ValueError, "block_size"),
    ("jpeg", {"block_size": 8.0}, TypeError, "block_size"),
    ("jpeg", {"block_size": "8"}, TypeError, "block_size"),
    ("jpeg", {"block_size": True}, TypeError, "block_size"),
    ("jpeg", {"block_size": None}, TypeError, "block_size"),
    ("jpeg", {"block_size": 8, "keep_freqs": 0}, ValueError, "keep_freqs"),
    ("jpeg", {"block_size": 8, "keep_freqs": 9}, ValueError, "keep_freqs"),
    ("jpeg", {"block_size": 8, "keep_freqs": 4.0}, TypeError, "keep_freqs"),
    ("jpeg", {"block_size": 8, "keep_freqs": True}, TypeError, "keep_freqs"),
    ("jpeg", {"quant_bits": 0}, ValueError, "quant_bits"),
    ("jpeg", {"quant_bits": 9}, ValueError, "quant_bits"),
    ("jpeg", {"quant_bits": 16}, ValueError, "quant_bits"),
    ("jpeg", {"quant_bits": 8.0}, TypeError, "quant_bits"),
    ("jpeg", {"quant_bits": "8"}, TypeError, "quant_bits"),
    ("jpeg", {"quant_bits": True}, TypeError, "quant_bits"),
    ("jpeg", {"quant_bits": (8, 8)}, ValueError, "quant_bits"),  # a table needs one entry per kept frequency
    ("jpeg", {"block_size": 2, "quant_bits": (8, 8.0)}, TypeError, "quant_bits"),
    ("jpeg", {"block_size": 2, "quant_bits": (8, 0)}, ValueError, "quant_bits"),
    ("jpeg", {"quant_bits": 8, "levels": "gauss"}, ValueError, "levels"),
    ("jpeg", {"quant_bits": 8, "levels": 3}, TypeError, "levels"),
    ("jpeg", {"block_size": 2, "quant_bits": 8, "levels": ("int", 3)}, TypeError, "levels"),
    ("jpeg", {"quant_bits": 8, "levels": ("int",)}, ValueError, "levels"),  # token axis: one per frequency
    ("jpeg", {"quant_bits": 8, "levels": ("int",) * 3, "scale_axis": "channel"}, ValueError, "levels"),  # (dc, ac)
    ("jpeg", {"quant_bits": 1, "levels": "int"}, ValueError, "levels"),  # int needs >= 2 bits
    ("jpeg", {"block_size": 4, "quant_bits": (4, 3, 3, 2), "levels": "uniform", "scale_axis": "channel"}, ValueError,
     "uniform"),  # the AC rows share one uniform step: one width
    ("jpeg", {"quant_bits": 8, "scale_axis": "row"}, ValueError, "scale_axis"),
    ("jpeg", {"quant_bits": 8, "scale_axis": "channel", "group": 12}, ValueError, "group"),
    ("jpeg", {"quant_bits": 8, "scale_axis": "channel", "group": 0}, ValueError, "group"),
    ("jpeg", {"quant_bits": 8, "scale_axis": "channel", "group": "128"}, TypeError, "group"),
    ("jpeg", {"quant_bits": 8, "scale_axis": "channel", "group": 128.0}, TypeError, "group"),
    ("jpeg", {"quant_bits": 8, "group": 16}, ValueError, "group"),  # token-axis scales are per block
    ("jpeg", {"quant_bits": 8, "scale_search": 1}, TypeError, "scale_search"),
    ("jpeg", {"quant_bits": 8, "scale_search": "yes"}, ValueError, "scale_search"),
    ("jpeg", {"quant_bits": 8, "scale_search": None}, TypeError, "scale_search"),
    ("jpeg", {"levels": "int"}, ValueError, "quant_bits"),  # quantizer options without quant_bits
    ("jpeg", {"scale_axis": "channel"}, ValueError, "quant_bits"),
    ("jpeg", {"group": 16}, ValueError, "quant_bits"),
    ("jpeg", {"scale_search": True}, ValueError, "quant_bits"),
    ("jpeg", {"rotate": -1}, ValueError, "rotate"),
    ("jpeg", {"rotate": 1.5}, TypeError, "rotate"),
    ("jpeg", {"rotate": "0"}, TypeError, "rotate"),
    ("jpeg", {"center": 1}, TypeError, "center"),
    ("jpeg", {"center": "yes"}, TypeError, "center"),
    ("jpeg", {"sinks": -1}, ValueError, "sinks"),
    ("jpeg", {"sinks": 4.0}, TypeError, "sinks"),
    ("jpeg", {"window": -2}, ValueError, "window"),
    ("jpeg", {"window": True}, TypeError, "window"),
    ("jpeg", {"keep_ratio": 0.5}, ValueError, "keep_ratio"),
    ("png", {"block_size": 1}, ValueError, "block_size"),
    ("png", {"block_size": 257}, ValueError, "block_size"),
    ("png", {"block_size": 4.0}, TypeError, "block_size"),
    ("png", {"block_size": "8"}, TypeError, "block_size"),
    ("png", {"block_size": True}, TypeError, "block_size"),
    ("png", {"keep_ratio": 0.0}, ValueError, "keep_ratio"),
    ("png", {"keep_ratio": -0.5}, ValueError, "keep_ratio"),
    ("png", {"keep_ratio": 1.5}, ValueError, "keep_ratio"),
    ("png", {"keep_ratio": float("nan")}, ValueError, "keep_ratio"),
    ("png", {"keep_ratio": "0.5"}, TypeError, "keep_ratio"),
    ("png", {"keep_ratio": True}, TypeError, "keep_ratio"),
    ("png", {"sinks": -1}, ValueError, "sinks"),
    ("png", {"window": 2.0}, TypeError, "window"),
    ("png", {"keep_freqs": 4}, ValueError, "keep_freqs"),
    ("png", {"quant_bits": 8}, ValueError, "quant_bits"),
    ("png", {"rotate": True}, ValueError, "rotate"),
    ("png", {"center": True}, ValueError, "center"),
    ("jpeg", {"quant_bits": 4, "raw_dtype": 16}, TypeError, "raw_dtype"),
    ("jpeg", {"quant_bits": 4, "raw_dtype": "float16"}, ValueError, "raw_dtype"),
    ("jpeg", {"raw_dtype": "bfloat16"}, ValueError, "raw_dtype"),  # unquantized: raw rows keep the stream dtype
    ("png", {"raw_dtype": "stream"}, ValueError, "raw_dtype"),
]


@pytest.mark.parametrize(("mode", "options", "error", "name"), BAD_OPTIONS)
def test_bad_option_is_rejected_naming_the_parameter(mode, options, error, name):
    with pytest.raises(error, match=name):
        make_codec(mode, **options)


@pytest.mark.parametrize("axis", [1, None])
def test_wrong_typed_scale_axis_is_a_type_error(axis):
    with pytest.raises(TypeError, match="scale_axis"):
        make_codec("jpeg", quant_bits=8, scale_axis=axis)


@pytest.mark.parametrize(("mode", "error"), [("gif", ValueError), ("JPEG", ValueError), ("", ValueError),
                                           (None, TypeError), (0, TypeError)])
def test_unknown_mode(mode, error):
    """The message lists the registered codecs (the package's, and any a test registered: tests/toy_codec.py)."""
    assert {"jpeg", "png"} <= set(CODECS)
    with pytest.raises(error, match=re.escape(f"mode must be one of {sorted(CODECS)}")):
        make_codec(mode)


def test_direct_constructors_validate_too():
    with pytest.raises(ValueError, match="block_size"):
        JPEGCodec(block_size=0)
    with pytest.raises(ValueError, match="keep_ratio"):
        PNGCodec(keep_ratio=2)


def test_every_registered_codec_lists_its_options_with_their_defaults():
    assert {"jpeg", "png"} <= set(CODECS)  # and whatever a test registered (tests/codecs/toy_codec.py)
    for mode in CODECS:
        options = options_of(mode)
        assert {"sinks", "window"} <= set(options), mode  # every codec keeps raw sinks and a raw window
        assert make_codec(mode, **options) == make_codec(mode)  # the defaults are the constructor's
        make_codec(mode, sinks=1, window=2)


@pytest.mark.parametrize("block_size", [1, 2, 3, 5, 8, 100, 256])
def test_default_channel_group_is_valid_for_every_block_size(block_size):
    codec = make_codec("jpeg", block_size=block_size, quant_bits=4, scale_axis="channel")
    assert codec.group % block_size == 0 and codec.group >= min(128, block_size)


def test_rotation_seed_out_of_the_generator_range_is_rejected():
    with pytest.raises(ValueError, match="rotate"):
        make_codec("jpeg", rotate=2**64)


def test_rotate_true_is_seed_zero_and_false_is_none():
    assert make_codec("jpeg", rotate=True).rotate == 0
    assert make_codec("jpeg", rotate=False).rotate is None
    assert make_codec("jpeg", rotate=7).rotate == 7


# --------------------------------------------------------------------------------------------------------- specs


@st.composite
def codec_options(draw) -> tuple[str, dict]:
    """A random valid option set for either mode (every option drawn, some left at their default)."""
    residual = {"sinks": draw(st.integers(0, 5)), "window": draw(st.integers(0, 40))}
    if draw(st.booleans()):
        r = draw(st.integers(2, 32))
        return "png", {"block_size": r, "keep_ratio": draw(st.floats(0.01, 1.0)), **residual}
    r = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    keep = draw(st.integers(1, r))
    opts = {"block_size": r, "keep_freqs": keep, "rotate": draw(st.sampled_from([None, False, True, 0, 3, 2**31])),
            "center": draw(st.booleans()), **residual}
    if draw(st.booleans()):
        return "jpeg", {**opts, "raw_dtype": draw(st.sampled_from(["auto", "stream"]))}
    opts["raw_dtype"] = draw(st.sampled_from(RAW_DTYPES))
    axis = draw(st.sampled_from(["token", "channel"]))
    bits, levels = bit_table_and_levels(draw, axis, keep)
    opts["quant_bits"] = bits[0] if len(set(bits)) == 1 and draw(st.booleans()) else tuple(bits)
    opts["levels"] = levels[0] if len(set(levels)) == 1 and draw(st.booleans()) else tuple(levels)
    opts["scale_axis"] = axis
    opts["scale_search"] = draw(st.sampled_from([False, True, "trials", "fit"]))
    if axis == "channel":
        opts["group"] = r * draw(st.integers(1, 16))
    return "jpeg", opts


@FAST
@given(choice=codec_options())
def test_spec_round_trips_for_random_valid_options(choice):
    mode, options = choice
    codec = make_codec(mode, **options)
    back = codec_from_spec(codec.spec)
    assert back.spec == codec.spec and back == codec and hash(back) == hash(codec)
    assert (back.block_size, back.group, back.sinks, back.window) == (codec.block_size, codec.group, codec.sinks,
                                                                      codec.window)
    assert type(back) is type(codec) and back.quantizer == codec.quantizer and back.rotate == codec.rotate
    assert back.raw_dtype == codec.raw_dtype


def test_spec_format():
    """The string the ops take (and the Triton/CPU kernels parse): fixed field order, one level set per class."""
    assert make_codec("png", block_size=8, keep_ratio=0.5, sinks=2).spec == "png;r=8;kept=4;sinks=2;window=0"
    assert make_codec("jpeg", block_size=4, keep_freqs=2).spec == "jpeg;r=4;k=2;rotate=-;center=0;sinks=0;window=0"
    assert make_codec("jpeg", block_size=8, keep_freqs=3, quant_bits=8, rotate=True, window=16).spec == (
        "jpeg;r=8;k=3;bits=8.8.8;levels=int.int.int;axis=token;blocks=1;search=0;rotate=0;center=0;sinks=0;window=16")
    assert make_codec("jpeg", block_size=4, quant_bits=(5, 3, 2, 2), levels=("uniform", "midrise"),
                      scale_axis="channel", group=32, scale_search=True, center=True, sinks=4).spec == (
        "jpeg;r=4;k=4;bits=5.3.2.2;levels=uniform.midrise;axis=channel;blocks=8;search=1;rotate=-;center=1;sinks=4;"
        "window=0")
    assert make_codec("jpeg", block_size=1, quant_bits=3, levels="lloyd", scale_search="fit").spec == (
        "jpeg;r=1;k=1;bits=3;levels=lloyd;axis=token;blocks=1;search=2;rotate=-;center=0;sinks=0;window=0")
    # raw_dtype: only when not "auto" (specs written before the option read back unchanged), after the residual policy
    assert make_codec("jpeg", block_size=1, quant_bits=2, window=3, raw_dtype="bfloat16").spec == (
        "jpeg;r=1;k=1;bits=2;levels=int;axis=token;blocks=1;search=0;rotate=-;center=0;sinks=0;window=3;raw=bfloat16")
    assert make_codec("jpeg", block_size=4, raw_dtype="stream").spec.endswith(";sinks=0;window=0;raw=stream")


CANONICAL = "jpeg;r=8;k=8;bits=8.8.8.8.8.8.8.8;levels=int.int.int.int.int.int.int.int;axis=token;blocks=1;search=0;" \
            "rotate=-;center=0;sinks=0;window=0"


@pytest.mark.parametrize(("spec", "match"), [
    ("gif;r=8;sinks=0;window=0", "mode"),
    ("", "spec"),
    ("jpeg", "spec field"),
    ("jpeg;r", "mode;key=value"),
    ("png;r=8;kept=7;sinks=0", "window"),
    ("png;r=8;kept=8;sinks=0;window=0", "kept"),
    ("png;r=8;kept=x;sinks=0;window=0", "kept"),
    ("png;r=1;kept=0;sinks=0;window=0", "kept"),
    ("png;r=8;kept=7;sinks=-1;window=0", "sinks"),
    (CANONICAL.replace("r=8", "r=0"), "block_size"),
    (CANONICAL.replace("bits=8.8.8.8.8.8.8.8", "bits=8"), "quant_bits"),
    (CANONICAL.replace("levels=int.", "levels=foo."), "levels"),
    (CANONICAL.replace("axis=token", "axis=chan"), "scale_axis"),
    (CANONICAL.replace("rotate=-", "rotate=x"), "rotate"),
    (CANONICAL.replace("rotate=-", "rotate=-1"), "rotate"),
    (CANONICAL.replace("blocks=1", "blocks=2"), "group"),
    (CANONICAL.replace("search=0", "search=3"), "search"),
    # not canonical: parses, but reads back differently
    (CANONICAL.replace("search=0", "search=02"), "not canonical"),
    (CANONICAL.replace("center=0", "center=2"), "not canonical"),
    (CANONICAL.replace("r=8", "r=08"), "not canonical"),
    (CANONICAL + ";x=1", "not canonical"),
    (CANONICAL.replace("search=0;", "search=0;search=1;"), "not canonical"),
    ("png;r=8;kept=7;sinks=0;window=0;r=8", "not canonical"),
    ("png;r=8;kept=7;sinks=0;window=0;bits=8", "not canonical"),
    ("jpeg;k=8;r=8;rotate=-;center=0;sinks=0;window=0", "not canonical"),
    ("jpeg;r=8;k=8;rotate=-;center=0;sinks=0;window=0;levels=int", "not canonical"),
])
def test_malformed_or_non_canonical_spec_is_rejected(spec, match):
    with pytest.raises(ValueError, match=match):
        codec_from_spec(spec)


@pytest.mark.parametrize(("spec", "match"), [
    (CANONICAL.replace("levels=int.int.int.int.int.int.int.int;", ""), "levels"),
    (CANONICAL.replace("axis=token;", ""), "axis"),
    (CANONICAL.replace("bits=8.8.8.8.8.8.8.8", "bits=a.8.8.8.8.8.8.8"), "bits"),
])
def test_incomplete_quantized_spec_is_a_value_error_naming_the_field(spec, match):
    with pytest.raises(ValueError, match=match):
        codec_from_spec(spec)


@pytest.mark.parametrize("spec", [None, 0, [0, 8, 8, 0], ("jpeg",)])
def test_spec_must_be_a_string(spec):
    with pytest.raises(TypeError, match="spec"):
        codec_from_spec(spec)


# ----------------------------------------------------------------------------------------------- stored bytes


LAYOUT_IDS = ["jpeg", "jpeg-k3", "jpeg-int8", "png", "png-half", "key-table", "lloyd2-token", "uniform4-channel",
              "lloyd-uniform-k2"]


def layout_tiers() -> list:
    return [
        make_codec("jpeg", block_size=8), make_codec("jpeg", block_size=8, keep_freqs=3),
        make_codec("jpeg", block_size=8, quant_bits=8), make_codec("png", block_size=8),
        make_codec("png", block_size=8, keep_ratio=0.5),
        make_codec("jpeg", block_size=8, quant_bits=(5, 3, 3, 2, 2, 2, 2, 2), levels=("uniform", "midrise"),
                   scale_axis="channel", group=32, rotate=True, sinks=4),
        make_codec("jpeg", block_size=1, quant_bits=2, levels="lloyd", center=True, window=4),
        make_codec("jpeg", block_size=1, quant_bits=4, levels="uniform", scale_axis="channel", group=16),
        make_codec("jpeg", block_size=4, keep_freqs=2, quant_bits=(3, 1), levels=("lloyd", "uniform")),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", layout_tiers(), ids=LAYOUT_IDS)
def test_group_bytes_is_what_empty_archive_allocates(codec, dtype):
    enc = codec.empty_archive((2, 3), 5, 16, dtype, "cpu")
    assert sum(t.nbytes for t in enc) == 2 * 3 * 5 * codec.group_bytes(16, dtype)
    shapes = codec.archive_shapes(16, dtype)
    for t, (shape, want) in zip(enc, shapes.values(), strict=True):
        assert t.shape == (2, 3, 5, *shape) and t.dtype == want and not t.any()
    if codec.group_bytes(16, dtype):
        x = torch.randn(2, 3, 5 * codec.group, 16).to(dtype)
        for t, like in zip(codec.encode(x, torch.zeros(2, 3, 16) if codec.center else None), enc, strict=True):
            assert t.shape == like.shape and t.dtype == like.dtype  # encode fills exactly that layout


def bits_per_value(codec, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> float:
    return 8 * codec.group_bytes(head_dim, dtype) / (codec.group * head_dim)


def test_bits_per_value_formulas():
    """Archive bits per value as stored (codes, fp16 scales, zero points; bf16 = 16)."""
    assert bits_per_value(make_codec("jpeg", block_size=8, quant_bits=8), 64) == 8.25  # 8 + 16 / 64
    key3 = make_codec("jpeg", block_size=8, quant_bits=(5, 3, 3, 2, 2, 2, 2, 2), levels=("uniform", "midrise"),
                      scale_axis="channel", group=128)
    assert bits_per_value(key3, 64) == 3.0  # 21/8 + (2 scales + 1 zero) * 16 / 128
    assert bits_per_value(make_codec("jpeg", block_size=1, quant_bits=2, levels="lloyd"), 64) == 2.25  # 2 + 16 / 64
    kivi4 = make_codec("jpeg", block_size=1, quant_bits=4, levels="uniform", scale_axis="channel", group=128)
    assert bits_per_value(kivi4, 128) == 4.25  # 4 + (scale + zero) * 16 / 128
    uniform_token = make_codec("jpeg", block_size=1, quant_bits=4, levels="uniform")
    assert bits_per_value(uniform_token, 64) == 4.5  # 4 + (scale + zero) * 16 / 64
    assert bits_per_value(make_codec("jpeg", block_size=8), 64) == 16.0  # bf16 coefficients
    assert bits_per_value(make_codec("jpeg", block_size=8, keep_freqs=2), 64) == 4.0
    assert bits_per_value(make_codec("jpeg", block_size=8), 64, torch.float32) == 32.0
    assert bits_per_value(make_codec("png", block_size=8), 64) == 32.0  # fp32 anchor + deltas
    pruned = make_codec("png", block_size=8, keep_ratio=0.5)
    assert bits_per_value(pruned, 64) == (5 * 32 + 4 * 8) / 8  # anchor + 4 of 7 deltas + their uint8 positions
