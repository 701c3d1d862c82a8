"""The lossless stored form of a tensor: a reversible plane transform (:mod:`.planes`), then a byte coder per plane
(:mod:`.entropy`). Exact, bitwise, for every dtype and bit pattern. A blob describes itself (dtype, shape, transform,
planes; the sha256 of the header and of each coded plane, checked before any decoder reads them), so it can be kept
or moved on its own.

Named methods (what ``FlashCodecCache.save(path, compression=...)`` takes, one per file):

- ``raw``: the bytes as they are;
- ``zstd``: float tensors (bf16 / fp16 / fp32) split into planes by :data:`TRANSFORM` (bf16 and fp32: (exponent, sign)
  symbols and mantissa bytes; fp16: its two bytes), zstd on each; other tensors (codes, ints): zstd of the bytes;
- ``ppmd``: the same planes, PPMd order 2 on the plane holding the exponent (the channel's two previous tokens as
  context), zstd on the others: the smallest, and the slowest.

A plane that its coder does not shrink is kept raw; a plane PPMd cannot round-trip (:class:`.entropy.RoundTripError`)
is coded by zstd. A tensor with more than 256 (exponent, sign) pairs takes the ``"fields"`` planes. The header records
the transform and every plane's coder. Which method wins where: ``benchmarks/bench_lossless.py``.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from ..codecs.base import check_choice
from . import entropy, planes

METHODS = ("raw", "zstd", "ppmd")
# the transform per dtype that codes smallest on real K/V (benchmarks/results/lossless.json): fp16 keeps its high
# byte (sign, exponent, two mantissa bits) whole; bf16 and fp32 code (exponent, sign) symbols
TRANSFORM = {torch.bfloat16: "expsign", torch.float32: "expsign", torch.float16: "bytes"}
MAGIC = b"FCLS"
VERSION = 1
_HEAD = struct.Struct("<4sBI32s")  # magic, version, JSON header length, the header's sha256
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.bool)}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"tensor dtype must be one of {sorted(DTYPES)}, got {dtype}")
    return name


def check_method(method: str) -> None:
    check_choice("compression", method, METHODS)


def _split(x: torch.Tensor) -> tuple[str | None, list[bytes], torch.Tensor]:
    """``(transform, plane bytes, pair table)`` of ``x``: its bytes as one plane unless a float tensor of 2+ dims."""
    none = torch.zeros(0, dtype=torch.int16)
    if x.dtype not in planes.FLOAT_BITS or x.dim() < 2 or x.numel() == 0:
        return None, [_bytes(x.reshape(-1))], none
    transform = TRANSFORM[x.dtype]
    try:
        parts, table = planes.split(x, transform)
    except planes.TooManyPairs:
        transform = "fields"
        parts, table = planes.split(x, transform)
    return transform, [_bytes(p) for p in parts], table


def _coders(transform: str | None, count: int, method: str) -> list[str]:
    """The coder of each plane: ``method`` on the plane holding the exponent, zstd on the others."""
    if method == "raw":
        return ["raw"] * count
    coders = ["zstd"] * count
    if transform is not None:
        coders[-1 if transform == "bytes" else 0] = method
    return coders


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def encode(x: torch.Tensor, method: str = "ppmd") -> bytes:
    """``x`` (any shape, a dtype of :data:`DTYPES`, moved to the CPU) -> its lossless blob."""
    check_method(method)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    x = x.detach().cpu().contiguous()
    header = {"dtype": dtype_name(x.dtype), "shape": list(x.shape)}
    if method == "raw":
        transform, raw_planes, table = None, [_bytes(x.reshape(-1))], torch.zeros(0, dtype=torch.int16)
    else:
        transform, raw_planes, table = _split(x)
    payload, described = [], []
    for data, coder in zip(raw_planes, _coders(transform, len(raw_planes), method), strict=True):
        try:
            coded = entropy.compress(data, coder)
        except entropy.RoundTripError:  # recorded in the header: the plane is zstd, exact all the same
            coded, coder = entropy.compress(data, "zstd"), "zstd"
        if len(coded) >= len(data):
            coded, coder = data, "raw"
        payload.append(coded)
        described.append({"coder": coder, "size": len(data), "stored": len(coded),
                          "sha256": hashlib.sha256(coded).hexdigest()})
    header.update(transform=transform, table=table.tolist(), planes=described)
    text = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([_HEAD.pack(MAGIC, VERSION, len(text), hashlib.sha256(text).digest()), text, *payload])


def _header(blob: bytes) -> tuple[dict, int]:
    if len(blob) < _HEAD.size:
        raise ValueError(f"not a lossless blob: {len(blob)} bytes, shorter than its {_HEAD.size}-byte head")
    magic, version, size, sha = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise ValueError(f"not a lossless blob: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"lossless blob version {version}; this flashcodec_fx reads version {VERSION}")
    text = blob[_HEAD.size:_HEAD.size + size]
    if hashlib.sha256(text).digest() != sha:
        raise ValueError("damaged or truncated lossless blob: its header's sha256 does not match")
    try:
        header = json.loads(text)
        dtype, shape = DTYPES[header["dtype"]], tuple(int(s) for s in header["shape"])
        described = [(str(p["coder"]), int(p["size"]), int(p["stored"]), str(p["sha256"])) for p in header["planes"]]
        transform, table = header["transform"], [int(v) for v in header["table"]]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"damaged lossless blob header: {err!r}") from None
    if transform not in (None, *planes.TRANSFORMS) or min(shape, default=0) < 0:
        raise ValueError(f"damaged lossless blob header: transform {transform!r}, shape {shape}")
    return {"dtype": dtype, "shape": shape, "planes": described, "transform": transform, "table": table}, \
        _HEAD.size + size


def decode(blob: bytes) -> torch.Tensor:
    """Inverse of :func:`encode` (a CPU tensor); ``ValueError`` on a damaged or truncated blob."""
    header, offset = _header(bytes(blob))
    dtype, shape, transform = header["dtype"], header["shape"], header["transform"]
    stored = sum(s for _, _, s, _ in header["planes"])
    if len(blob) != offset + stored:
        raise ValueError(f"lossless blob of {len(blob)} bytes, its header describes {offset + stored}")
    data = []
    for coder, size, length, sha in header["planes"]:
        coded = blob[offset:offset + length]
        if hashlib.sha256(coded).hexdigest() != sha:  # checked before a decoder sees damaged input
            raise ValueError(f"damaged lossless blob: a {coder} plane's sha256 does not match its header")
        data.append(entropy.decompress(coded, coder, size))
        offset += length
    if transform is None:
        flat = torch.frombuffer(bytearray(data[0]), dtype=torch.uint8) if data[0] else torch.zeros(0, dtype=torch.uint8)
        if flat.numel() != _count(shape) * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"lossless blob holds {flat.numel()} bytes for a {dtype} tensor of shape {shape}")
        return flat.view(dtype).reshape(shape)
    plane_shape = (*shape[:-2], shape[-1], shape[-2])
    rows = []
    for chunk in data:
        if len(chunk) != _count(plane_shape):
            raise ValueError(f"lossless blob plane of {len(chunk)} bytes for planes of shape {plane_shape}")
        rows.append(torch.frombuffer(bytearray(chunk), dtype=torch.uint8).reshape(plane_shape))
    table = torch.tensor(header["table"], dtype=torch.int16)
    return planes.join(rows, transform, dtype, table)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
