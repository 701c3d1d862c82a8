"""The cache file: tensors and header round-trip exactly under every compression; a truncated, corrupted, foreign or
other-version file raises ValueError naming the problem."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from codec_tiers import FAST
from hypothesis import given
from hypothesis import strategies as st
from test_planes import same_bits

from flashcodec_fx.persist import fileformat, lossless

pytest.importorskip("safetensors")


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"tail": torch.randn(2, 3, 5, 8, generator=gen).to(torch.bfloat16),
            "codes": torch.randint(0, 256, (2, 3, 4, 6), generator=gen, dtype=torch.uint8),
            "scale": torch.randn(2, 3, 4, 1, generator=gen).half(), "length": torch.tensor(37),
            "empty": torch.zeros(2, 3, 0)}


@pytest.mark.parametrize("compression", lossless.METHODS)
def test_round_trip(tmp_path, compression):
    tensors = sample_tensors()
    path = fileformat.write(tmp_path / "c.fc", tensors, {"note": [1, "two"]}, compression)
    header, back = fileformat.read(path)
    assert header["note"] == [1, "two"] and header["compression"] == compression
    assert header["version"] == fileformat.VERSION and set(back) == set(tensors)
    assert all(same_bits(back[name], t) for name, t in tensors.items())
    assert fileformat.read_header(path)["tensors"] == header["tensors"]


@FAST
@given(at=st.floats(0, 1, exclude_max=True), flip=st.integers(1, 255), compression=st.sampled_from(lossless.METHODS))
def test_corrupted_file_is_refused_or_unchanged(tmp_path_factory, at, flip, compression):
    """Any damaged byte: refused, or (a byte of JSON padding the format does not read) the same tensors back."""
    path = fileformat.write(tmp_path_factory.mktemp("f") / "c.fc", sample_tensors(), {}, compression)
    data = bytearray(path.read_bytes())
    data[int(at * len(data))] ^= flip
    path.write_bytes(bytes(data))
    try:
        _, back = fileformat.read(path)
    except ValueError:
        return
    assert all(same_bits(back[name], t) for name, t in sample_tensors().items())


def test_every_byte_of_the_tensor_data_is_checked(tmp_path):
    path = fileformat.write(tmp_path / "c.fc", sample_tensors(), {}, "raw")
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")  # safetensors: 8-byte header size, header, then the data
    for at in range(start, len(data)):
        damaged = bytearray(data)
        damaged[at] ^= 1
        path.write_bytes(bytes(damaged))
        with pytest.raises(ValueError, match="corrupted"):
            fileformat.read(path)


@pytest.mark.parametrize("keep", [0, 7, 100, -1])
def test_truncated_file_is_refused(tmp_path, keep):
    path = fileformat.write(tmp_path / "c.fc", sample_tensors(), {}, "zstd")
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ValueError, match="truncated"):
        fileformat.read(path)


def rewrite_header(path, change) -> None:
    """Rewrite the file's header with ``change(header)`` applied and a matching checksum (a well-formed file)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path, "pt") as f:
        meta, stored = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    header = json.loads(meta[fileformat.HEADER_KEY])
    change(header)
    text = json.dumps(header)
    save_file(stored, path, metadata={fileformat.HEADER_KEY: text,
                                      fileformat.HEADER_SHA_KEY: hashlib.sha256(text.encode()).hexdigest()})


def test_other_version_and_format_are_refused(tmp_path):
    path = fileformat.write(tmp_path / "c.fc", sample_tensors(), {}, "raw")
    rewrite_header(path, lambda h: h.update(version=fileformat.VERSION + 1))
    with pytest.raises(ValueError, match=f"format version {fileformat.VERSION + 1}.*reads version {fileformat.VERSION}"):
        fileformat.read(path)
    rewrite_header(path, lambda h: h.update(version=fileformat.VERSION, format="other"))
    with pytest.raises(ValueError, match="format 'other'"):
        fileformat.read(path)


def test_header_without_matching_tensor_is_refused(tmp_path):
    path = fileformat.write(tmp_path / "c.fc", sample_tensors(), {}, "raw")
    rewrite_header(path, lambda h: h["tensors"].pop("codes"))
    with pytest.raises(ValueError, match="codes"):
        fileformat.read(path)


def test_foreign_files_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="not a flashcodec cache file"):
        fileformat.read(tmp_path / "model.safetensors")
    (tmp_path / "text.fc").write_text("hello")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        fileformat.read(tmp_path / "text.fc")
    for read in (fileformat.read, fileformat.read_header):
        with pytest.raises(FileNotFoundError, match="no cache file at .*missing.fc"):
            read(tmp_path / "missing.fc")
        with pytest.raises(IsADirectoryError, match="is a folder, not a cache file"):
            read(tmp_path)


def test_bad_compression_is_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match="compression must be one of"):
        fileformat.write(tmp_path / "c.fc", sample_tensors(), {}, "gzip")
    assert not any(tmp_path.iterdir())
