"""A stream exported as named tensors and imported into a fresh stream of the same codec is bitwise the original
(every preset, both layouts; tokens held raw are imported raw and convert at the same length); a lossless png archive
travels as its tokens; a mismatched export changes nothing."""

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
    """Same host mirrors and, bit for bit, the same state tensors (or the same tokens held raw, first call alike)."""
    if a.held_raw() is not None or b.held_raw() is not None:
        if a.held_raw() is None or b.held_raw() is None or a.held_raw()[1] != b.held_raw()[1]:
            return False
        tensors = [(a.tail, b.tail)]
    else:
        tensors = list(zip(a.state, b.state, strict=True))
    return (a._host_length, a._host_start) == (b._host_length, b._host_start) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8),
                                                                  y.reshape(-1).view(torch.uint8))
        for x, y in tensors)


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


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tokens_held_raw_travel_raw_and_convert_at_the_same_length(preset):
    stream = stream_with(preset, 3, torch.bfloat16)  # two calls: 2 tokens, then 1
    assert stream.raw_prefix
    tensors, described = export_stream(stream)
    assert described["archive"] == "raw" and set(tensors) == {"raw"}
    assert described["first_call"] == ([0, 2] if stream.codec.sinks == 0 else None)  # the call past the sinks
    back = fresh_like(stream)
    install_state(back, prepare_state("s", back, tensors, described, torch.device("cpu")))
    x = torch.randn(2, 2, 80, 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for i in range(80):
        for s in (stream, back):
            s.append(x[:, :, i: i + 1])
        assert back.raw_prefix == stream.raw_prefix and bitwise(back, stream), i


def test_lossless_png_archive_travels_as_its_tokens():
    stream = stream_with("png", 40, torch.bfloat16)
    tensors, described = export_stream(stream)
    assert described["archive"] == "tokens" and "data" not in tensors
    assert tensors["tokens"].dtype == torch.bfloat16 and tensors["tokens"].shape == (2, 2, 40, 16)  # 5 groups of 8
    lossy, lossy_described = export_stream(stream_with("int8", 40, torch.bfloat16))
    assert lossy_described["archive"] == "state" and "tokens" not in lossy


def test_mismatched_export_is_refused_and_changes_nothing():
    stream = stream_with("4bit", 60, torch.bfloat16)
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


@pytest.mark.parametrize(("change", "match"), [
    ({"length": 6}, "tokens held raw"),
    ({"first_call": [0, 2]}, "first_call must be"),
    ({"first_call": None}, "need their first_call"),
    ({"raw": torch.zeros(2, 2, 60, 16, dtype=torch.bfloat16), "length": 60}, "fewer than"),
    ({"raw": torch.zeros(2, 2, 5, 16, dtype=torch.int32)}, "floating"),
])
def test_a_bad_raw_export_is_refused(change, match):
    stream = stream_with("4bit", 5, torch.bfloat16)
    tensors, described = export_stream(stream)
    tensors = {"raw": change.pop("raw")} if "raw" in change else tensors
    target = fresh_like(stream)
    with pytest.raises(ValueError, match=match):
        prepare_state("layer 0 keys", target, tensors, {**described, **change}, torch.device("cpu"))
    assert not target.is_initialized


def test_an_export_without_channel_exponents_loads_into_a_codec_without_them():
    """Files written before the ``norm`` field existed hold no exponents: they load into codecs without ``normalize``
    (nothing to restore), and a normalized codec refuses them (its exponents would be lost)."""
    plain = make_codec("jpeg", block_size=1, quant_bits=4, levels="lloyd", rotate=True, center=True, sinks=4, window=8)
    for codec, loads in ((plain, True), (preset_codecs("4bit")[0], False)):
        stream = CodecStream(codec)
        stream.append(torch.randn(1, 2, 90, 16, generator=torch.Generator().manual_seed(1)))
        tensors, described = export_stream(stream)
        old = {name: t for name, t in tensors.items() if name != "norm"}
        back = fresh_like(stream)
        if loads:
            install_state(back, prepare_state("s", back, old, described, torch.device("cpu")))
            assert bitwise(back, stream)
        else:
            with pytest.raises(ValueError, match=r"\['norm'\] missing"):
                prepare_state("s", back, old, described, torch.device("cpu"))


def test_an_fp32_stream_travels_with_its_bf16_raw_rows():
    """A lossy preset's fp32 stream stores bf16 sinks and tail (``raw=bfloat16``): exported and imported as stored,
    the import keeps storing so."""
    stream = stream_with("3bit", 60, torch.float32)
    tensors, described = export_stream(stream)
    tensors = {name: t.clone() for name, t in tensors.items()}  # as read from a file: not the stream's own tensors
    assert described["spec"] == preset_codecs("3bit")[0].spec + ";raw=bfloat16" and described["dtype"] == "float32"
    assert tensors["tail"].dtype == tensors["sink"].dtype == torch.bfloat16
    back = fresh_like(stream)
    install_state(back, prepare_state("s", back, tensors, described, torch.device("cpu")))
    assert bitwise(back, stream) and back.spec == stream.spec and back.dtype == torch.float32
    x = torch.randn(2, 2, 9, 16, generator=torch.Generator().manual_seed(5))
    for s in (stream, back):
        s.append(x)
    assert bitwise(back, stream)


def test_a_file_with_fp32_raw_rows_still_loads_as_it_was_stored():
    """Files written before raw rows could be narrower hold an fp32 stream's sinks and tail in fp32 under the codec's
    own spec: they load as stored and go on storing so (as ``raw_dtype="stream"`` does), until the stream is reset."""
    codec = preset_codecs("4bit")[0]
    kept = CodecStream(codec.with_raw_dtype("stream"))
    x = torch.randn(2, 2, 70, 16, generator=torch.Generator().manual_seed(2))
    kept.append(x[:, :, :60])
    tensors, described = export_stream(kept)
    tensors = {name: t.clone() for name, t in tensors.items()}  # as read from a file: not the stream's own tensors
    described = {**described, "spec": codec.spec}  # what such a file says
    assert tensors["tail"].dtype == torch.float32
    back = CodecStream(codec)
    install_state(back, prepare_state("s", back, tensors, described, torch.device("cpu")))
    assert back.spec == codec.spec and back.raw_dtype == torch.float32 and bitwise(back, kept)
    for s in (kept, back):
        s.append(x[:, :, 60:])
    assert bitwise(back, kept)
    back.reset()
    back.append(x)
    assert back.raw_dtype == torch.bfloat16 and back.spec.endswith(";raw=bfloat16")
