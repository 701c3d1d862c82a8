"""The cache file: a safetensors file (no pickle) of named tensors, each stored raw or as a lossless blob
(:mod:`.lossless`), and a versioned JSON header in the safetensors metadata.

The header (``metadata["flashcodec"]``, its sha256 in ``metadata["flashcodec_sha256"]``) holds the format name and
version, the compression method, the caller's description (codec specs, lengths, layer types, config fingerprint,
...) and, per tensor, its dtype, shape, encoding and the sha256 of its exact bytes. :func:`read` checks all of it and
decodes every tensor before it returns: a truncated, corrupted or foreign file, or another format version, raises
``ValueError`` naming what is wrong, and the caller has built nothing yet.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from . import lossless

FORMAT = "flashcodec-cache"
VERSION = 1
HEADER_KEY, HEADER_SHA_KEY = "flashcodec", "flashcodec_sha256"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as err:
        raise ImportError("saving and loading caches needs the safetensors package: pip install safetensors (or "
                          "pip install 'flashcodec-fx[hf]')") from err
    return safetensors


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's exact bytes (C order)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], header: dict[str, Any],
          compression: str = "ppmd") -> Path:
    """Write ``tensors`` and ``header`` (JSON-able) to ``path`` atomically (a temporary file, then a rename)."""
    lossless.check_method(compression)
    st = _safetensors()
    stored, described = {}, {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        entry = {"dtype": lossless.dtype_name(t.dtype), "shape": list(t.shape), "sha256": digest(t)}
        if compression == "raw":
            stored[name], entry["encoding"] = t, "raw"
        else:
            blob = lossless.encode(t, compression)
            stored[name], entry["encoding"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8), "lossless"
        entry["stored_bytes"] = stored[name].nbytes
        described[name] = entry
    text = json.dumps({"format": FORMAT, "version": VERSION, "compression": compression, **header,
                       "tensors": described}, sort_keys=True)
    metadata = {HEADER_KEY: text, HEADER_SHA_KEY: hashlib.sha256(text.encode()).hexdigest()}
    path = Path(path)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(handle)
    try:
        st.torch.save_file(stored, staging, metadata=metadata)
        os.replace(staging, path)
    finally:
        Path(staging).unlink(missing_ok=True)
    return path


def _header(metadata: dict[str, str] | None, path: Path) -> dict[str, Any]:
    if not metadata or HEADER_KEY not in metadata:
        raise ValueError(f"{path}: not a flashcodec cache file (no {HEADER_KEY!r} header in its safetensors metadata)")
    text = metadata[HEADER_KEY]
    if hashlib.sha256(text.encode()).hexdigest() != metadata.get(HEADER_SHA_KEY):
        raise ValueError(f"{path}: the header is corrupted (its sha256 does not match)")
    header = json.loads(text)
    if header.get("format") != FORMAT:
        raise ValueError(f"{path}: format {header.get('format')!r}, expected {FORMAT!r}")
    if header.get("version") != VERSION:
        raise ValueError(f"{path}: format version {header.get('version')!r}; this flashcodec_fx reads version "
                         f"{VERSION} only")
    return header


def existing_file(path: str | os.PathLike) -> Path:
    """``path`` as a Path; ``FileNotFoundError`` when nothing is there, ``IsADirectoryError`` for a folder."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no cache file at {os.fspath(path)!r} (FlashCodecCache.save writes one)")
    if path.is_dir():
        raise IsADirectoryError(f"{os.fspath(path)!r} is a folder, not a cache file")
    return path


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The checked header of the file at ``path`` (tensors not read)."""
    path = existing_file(path)
    st = _safetensors()
    try:
        with st.safe_open(path, "pt") as f:
            return _header(f.metadata(), path)
    except st.SafetensorError as err:
        raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupted?): {err}") from None


def read(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(header, tensors)`` of the file at ``path``: every tensor decoded on the CPU and checked (dtype, shape,
    sha256) against the header."""
    path = existing_file(path)
    st = _safetensors()
    try:
        with st.safe_open(path, "pt") as f:
            header = _header(f.metadata(), path)
            stored = {name: f.get_tensor(name) for name in f.keys()}
    except st.SafetensorError as err:
        raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupted?): {err}") from None
    described = header["tensors"]
    if set(stored) != set(described):
        raise ValueError(f"{path}: tensors {sorted(set(stored) ^ set(described))} are in the file or the header "
                         f"but not both")
    tensors = {}
    for name, entry in described.items():
        t = stored[name]
        if entry["encoding"] == "lossless":
            try:
                t = lossless.decode(t.numpy().tobytes())
            except ValueError as err:
                raise ValueError(f"{path}: tensor {name!r}: {err}") from None
        if lossless.dtype_name(t.dtype) != entry["dtype"] or list(t.shape) != entry["shape"]:
            raise ValueError(f"{path}: tensor {name!r} is {t.dtype} {tuple(t.shape)}, the header says "
                             f"{entry['dtype']} {tuple(entry['shape'])}")
        if digest(t) != entry["sha256"]:
            raise ValueError(f"{path}: tensor {name!r} is corrupted (its sha256 does not match the header)")
        tensors[name] = t
    return header, tensors
