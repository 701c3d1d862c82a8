"""Reversible bit transforms that make a float tensor's bytes predictable for an entropy coder (pure torch, exact).

A float word is ``sign | exponent (E bits) | mantissa (M bits)``. In K/V the exponent carries little information (a
channel keeps its magnitude from token to token), the mantissa nearly all of it. The transforms split each word into
byte *planes*:

- ``"bytes"``: the word's bytes, one plane each (little-endian: the last plane holds the sign and high exponent);
- ``"xor"``: each word XORed with the previous token's word of the same channel (Gorilla / Chimp), then ``"bytes"``;
- ``"fields"``: an exponent plane, then the sign and mantissa (``M + 1`` bits) as ``ceil((M + 1) / 8)`` byte planes
  (DFloat11's split: bf16 gives one exponent byte and one sign-mantissa byte);
- ``"expsign"``: one plane of (exponent, sign) symbols, then the mantissa (``M`` bits) as ``ceil(M / 8)`` planes.
  A symbol is the index of the word's (exponent, sign) pair in ``table``, the sorted pairs present (at most 256:
  :func:`fits_expsign`); the sign is where an entropy coder with context (the previous token of the same channel)
  predicts it best.

Planes are channel-major: ``x (..., S, D)`` becomes ``(..., D, S)`` first, so a plane holds each channel's tokens
contiguously and the byte before a symbol is the same channel's previous token. :func:`split` and :func:`join` are
inverses, bitwise, for every bit pattern (NaN, infinity, negative zero, subnormals).
"""

from __future__ import annotations

import torch

TRANSFORMS = ("bytes", "xor", "fields", "expsign")
FLOAT_BITS = {torch.bfloat16: (8, 7), torch.float16: (5, 10), torch.float32: (8, 23)}  # (exponent, mantissa) bits
_SIGNED = {2: torch.int16, 4: torch.int32}
_WIDE = {2: torch.int32, 4: torch.int64}  # non-negative words fit with room for shifts


def check_transform(transform: str, dtype: torch.dtype) -> None:
    """Raise unless ``transform`` is one of :data:`TRANSFORMS` and ``dtype`` one of :data:`FLOAT_BITS`."""
    if transform not in TRANSFORMS:
        raise ValueError(f"transform must be one of {TRANSFORMS}, got {transform!r}")
    if dtype not in FLOAT_BITS:
        raise TypeError(f"the plane transforms take {[str(d) for d in FLOAT_BITS]} tensors, got {dtype}")


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _words(x: torch.Tensor) -> torch.Tensor:
    """``x (..., S, D)`` -> channel-major words ``(..., D, S)``, non-negative, in a wider integer type."""
    size = x.element_size()
    words = x.transpose(-1, -2).contiguous().view(_SIGNED[size]).to(_WIDE[size])
    return words & ((1 << (8 * size)) - 1)


def _from_words(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_words`: ``words (..., D, S)`` -> ``(..., S, D)`` of ``dtype``."""
    size = _size(dtype)
    signed = words - ((words >> (8 * size - 1)) << (8 * size))  # two's complement in the word width
    return signed.to(_SIGNED[size]).view(dtype).transpose(-1, -2).contiguous()


def _byte_planes(value: torch.Tensor, count: int) -> list[torch.Tensor]:
    return [((value >> (8 * i)) & 0xFF).to(torch.uint8) for i in range(count)]


def _from_byte_planes(planes: list[torch.Tensor], like: torch.dtype) -> torch.Tensor:
    out = planes[0].to(like)
    for i, plane in enumerate(planes[1:], start=1):
        out |= plane.to(like) << (8 * i)
    return out


def _undo_xor(words: torch.Tensor) -> torch.Tensor:
    """Inverse of XOR with the previous token: a prefix XOR along the last axis (log-depth doubling)."""
    out, step = words.clone(), 1
    while step < out.shape[-1]:
        out[..., step:] ^= out[..., :-step].clone()
        step *= 2
    return out


def _exp_sign(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (exponent, sign) pair of each word as one integer ``exponent * 2 + sign``."""
    exp_bits, mant_bits = FLOAT_BITS[dtype]
    return (((words >> mant_bits) & ((1 << exp_bits) - 1)) << 1) | (words >> (exp_bits + mant_bits))


class TooManyPairs(ValueError):
    """``"expsign"`` on a tensor with more than 256 distinct (exponent, sign) pairs (they do not fit a byte)."""


def _pairs_present(pairs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    present = torch.bincount(pairs.reshape(-1), minlength=1 << (FLOAT_BITS[dtype][0] + 1)) > 0
    return present.nonzero().reshape(-1).to(torch.int16)


def pair_table(x: torch.Tensor) -> torch.Tensor:
    """The sorted (exponent, sign) pairs present in ``x`` (``exponent * 2 + sign``, int16)."""
    check_transform("expsign", x.dtype)
    return _pairs_present(_exp_sign(_words(x), x.dtype), x.dtype)


def fits_expsign(x: torch.Tensor) -> bool:
    """Whether ``x`` has at most 256 distinct (exponent, sign) pairs (one byte per symbol)."""
    return pair_table(x).numel() <= 256


def plane_count(transform: str, dtype: torch.dtype) -> int:
    check_transform(transform, dtype)
    mant_bits = FLOAT_BITS[dtype][1]
    if transform == "fields":
        return 1 + -(-(mant_bits + 1) // 8)
    if transform == "expsign":
        return 1 + -(-mant_bits // 8)
    return _size(dtype)


def split(x: torch.Tensor, transform: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``x (..., S, D)`` float -> (byte planes, each ``(..., D, S)`` uint8; the pair table of ``"expsign"``, else an
    empty int16 tensor). Raises :class:`TooManyPairs` for ``"expsign"`` when ``x`` has over 256 (exponent, sign) pairs."""
    check_transform(transform, x.dtype)
    if x.dim() < 2:
        raise ValueError(f"x must be (..., S, D) with at least 2 dims, got shape {tuple(x.shape)}")
    words, size, none = _words(x), x.element_size(), torch.zeros(0, dtype=torch.int16)
    exp_bits, mant_bits = FLOAT_BITS[x.dtype]
    if transform == "xor":
        words = words.clone()
        words[..., 1:] ^= _words(x)[..., :-1]
        return _byte_planes(words, size), none
    if transform == "bytes":
        return _byte_planes(words, size), none
    mantissa = words & ((1 << mant_bits) - 1)
    if transform == "fields":
        exponent = (words >> mant_bits) & ((1 << exp_bits) - 1)
        sign_mantissa = ((words >> (exp_bits + mant_bits)) << mant_bits) | mantissa
        return [exponent.to(torch.uint8), *_byte_planes(sign_mantissa, -(-(mant_bits + 1) // 8))], none
    pairs = _exp_sign(words, x.dtype)
    table = _pairs_present(pairs, x.dtype)
    if table.numel() > 256:
        raise TooManyPairs(f"transform 'expsign' needs at most 256 distinct (exponent, sign) pairs, x has "
                           f"{table.numel()}")
    lookup = torch.zeros(1 << (exp_bits + 1), dtype=torch.uint8)
    lookup[table.long()] = torch.arange(table.numel(), dtype=torch.uint8)
    symbols = lookup[pairs]
    return [symbols, *_byte_planes(mantissa, -(-mant_bits // 8))], table


def join(planes: list[torch.Tensor], transform: str, dtype: torch.dtype, table: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`split`: planes ``(..., D, S)`` uint8 (and ``"expsign"``'s table) -> ``(..., S, D)``."""
    check_transform(transform, dtype)
    if len(planes) != plane_count(transform, dtype):
        raise ValueError(f"transform {transform!r} on {dtype} has {plane_count(transform, dtype)} planes, got "
                         f"{len(planes)}")
    wide, (exp_bits, mant_bits) = _WIDE[_size(dtype)], FLOAT_BITS[dtype]
    if transform in ("bytes", "xor"):
        words = _from_byte_planes(planes, wide)
        return _from_words(_undo_xor(words) if transform == "xor" else words, dtype)
    if transform == "fields":
        sign_mantissa = _from_byte_planes(planes[1:], wide)
        words = ((sign_mantissa >> mant_bits) << (exp_bits + mant_bits)) | (planes[0].to(wide) << mant_bits) \
            | (sign_mantissa & ((1 << mant_bits) - 1))
        return _from_words(words, dtype)
    if table is None or table.dim() != 1 or table.numel() > 256:
        raise ValueError("transform 'expsign' needs its pair table (at most 256 entries)")
    if planes[0].numel() and int(planes[0].max()) >= table.numel():
        raise ValueError(f"expsign symbols index a table of {table.numel()} pairs, got symbol {int(planes[0].max())}")
    pairs = table.to(wide)[planes[0].long()]
    words = ((pairs & 1) << (exp_bits + mant_bits)) | ((pairs >> 1) << mant_bits) | _from_byte_planes(planes[1:], wide)
    return _from_words(words, dtype)
