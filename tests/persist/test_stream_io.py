"""A stream exported as named tensors and imported into a fresh stream of the same codec is bitwise the original
(every preset, both layouts); a lossless png archive travels as its tokens; a mismatched export changes nothing."""

from __future__ import annotations

import pytest
import torch
from codec_tiers import FAST
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx import CodecStream, make_codec
from flashcodec_fx.persist.stream_io import export_stream, install_state, prepare_state
from flashcodec_fx.presets import PRESETS, preset_codecs


def stream_with(preset: str, tokens: int, dtype: torch.dtype, layout: str = "dynamic", seed: int = 0) -> CodecStream:
    """A stream of preset ``preset``'s key codec (or ``"png"``: png keep_ratio=1.0, r=8) holding ``tokens`` tokens."""
    codec = make_codec("png", block_size=8) if preset == "png" else preset_codecs(preset)[0]
    stream = CodecStream(codec, layout, 128 if layout == "static" else None)
    x = torch.randn(2, 2, tokens, 16, generator=torch.Generator().manual_seed(seed)).to(dtype)
    stream.append(x[:, :, : tokens // 2 + 1])
    if tokens // 2 + 1 < tokens:
        stream.append(x[:, :, tokens // 2 + 1:])
    return stream


def bitwise(a: CodecStream, b: CodecStream) -> bool:
    return (a._host_length, a._host_start) == (b._host_length, b._host_start) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8),
                                                                  y.reshape(-1).view(torch.uint8))
        for x, y in zip(a.state, b.state, strict=True))


def fresh_like(stream: CodecStream) -> CodecStream:
    return CodecStream(stream.codec, stream.layout, stream.max_length)


@FAST
@given(preset=st.sampled_from(sorted(PRESETS)), tokens=st.integers(1, 60),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), layout=st.sampled_from(["dynamic", "static"]),
       seed=st.integers(0, 2**16))
def test_export_import_round_trip_bitwise(preset, tokens, dtype, layout, seed):
    stream = stream_with(preset, tokens, dtype, layout, seed)
    tensors, described = export_stream(stream)
    back = fresh_like(stream)
    install_state(back, prepare_state("s", back, tensors, described, torch.device("cpu")))
    assert bitwise(back, stream)


def test_lossless_png_archive_travels_as_its_tokens():
    stream = stream_with("png", 40, torch.bfloat16)
    tensors, described = export_stream(stream)
    assert described["archive"] == "tokens" and "data" not in tensors
    assert tensors["tokens"].dtype == torch.bfloat16 and tensors["tokens"].shape == (2, 2, 40, 16)  # 5 groups of 8
    lossy, lossy_described = export_stream(stream_with("int8", 40, torch.bfloat16))
    assert lossy_described["archive"] == "state" and "tokens" not in lossy


def test_mismatched_export_is_refused_and_changes_nothing():
    stream = stream_with("4bit", 30, torch.bfloat16)
    tensors, described = export_stream(stream)
    other = stream_with("int8", 10, torch.bfloat16)
    before = [t.clone() for t in other.state]
    with pytest.raises(ValueError, match="the file holds codec"):
        prepare_state("layer 0 keys", other, tensors, described, torch.device("cpu"))
    target = fresh_like(stream)
    with pytest.raises(ValueError, match="layer 0 keys.* must be"):
        prepare_state("layer 0 keys", target, {**tensors, "tail": tensors["tail"][:, :1]}, described,
                      torch.device("cpu"))
    with pytest.raises(ValueError, match="device lengths"):
        prepare_state("layer 0 keys", target, tensors, {**described, "length": described["length"] + 1},
                      torch.device("cpu"))
    assert target.state is None and all(torch.equal(a, b) for a, b in zip(before, other.state, strict=True))
