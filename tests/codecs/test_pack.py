"""Sub-byte packing: exact round trip for every width, ``bits * D / 8`` bytes, the documented slice layout."""

from __future__ import annotations

import pytest
import torch
from _codec_data import FAST
from hypothesis import given
from hypothesis import strategies as st

from flashcodec_fx.codecs.pack import SLICE_WIDTHS, pack, slices, unpack

lead_shapes = st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple)


def random_codes(shape: tuple[int, ...], bits: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1 << bits, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


@FAST
@given(bits=st.integers(1, 8), lead=lead_shapes, groups=st.integers(1, 8), seed=st.integers(0, 2**31))
def test_round_trip_and_packed_size(bits, lead, groups, seed):
    d = 8 * groups
    codes = random_codes((*lead, d), bits, seed)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (*lead, bits * d // 8)
    assert packed.nbytes * 8 == bits * codes.numel()  # the packed size is the bit count
    out = unpack(packed, bits, d)
    assert out.dtype == torch.int32 and torch.equal(out, codes)


@pytest.mark.parametrize("bits", range(1, 9))
def test_every_code_value_survives(bits):
    """All codes 0..2**b - 1 at every channel position of a D = 64 row (the extremes included)."""
    n = 1 << bits
    codes = (torch.arange(n)[:, None] + torch.arange(64)[None]) % n
    assert torch.equal(unpack(pack(codes, bits), bits, 64), codes.int())


@pytest.mark.parametrize("bits", range(1, 9))
def test_slices_cover_the_bits_widest_first(bits):
    parts = slices(bits)
    assert sum(w for w, _ in parts) == bits and all(w in SLICE_WIDTHS for w, _ in parts)
    assert [w for w, _ in parts] == sorted((w for w, _ in parts), reverse=True)
    assert [s for _, s in parts] == [sum(w for w, _ in parts[:i]) for i in range(len(parts))]


def reference_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The module docstring's layout, one bit at a time: slice (width w, shift s) holds bits s..s+w-1 of every
    code; channel d sits in byte d * w // 8 of that slice, at bit d * w % 8."""
    d = codes.shape[-1]
    out = []
    for width, shift in slices(bits):
        part = torch.zeros(*codes.shape[:-1], d * width // 8, dtype=torch.int64)
        for ch in range(d):
            value = (codes[..., ch].long() >> shift) & ((1 << width) - 1)
            part[..., ch * width // 8] |= value << (ch * width % 8)
        out.append(part)
    return torch.cat(out, dim=-1).to(torch.uint8)


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 7, 8])
def test_layout_is_the_documented_one(bits):
    codes = random_codes((2, 16), bits, seed=bits)
    assert torch.equal(pack(codes, bits), reference_pack(codes, bits))


def test_head_dim_must_fill_whole_bytes_per_slice():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack(torch.zeros(2, 12, dtype=torch.int32), 3)  # its 1-bit slice
    with pytest.raises(ValueError, match="multiple of 2"):
        pack(torch.zeros(2, 11, dtype=torch.int32), 4)
    for dim in (1, 7, 12, 60):  # 8-bit codes: one byte per channel, any head_dim
        codes = random_codes((2, dim), 8, seed=dim)
        assert torch.equal(unpack(pack(codes, 8), 8, dim), codes)
    codes = random_codes((2, 12), 4, seed=4)
    assert torch.equal(unpack(pack(codes, 4), 4, 12), codes)
    with pytest.raises(ValueError, match="head_dim=16 have 6 bytes"):
        unpack(torch.zeros(2, 5, dtype=torch.uint8), 3, 16)
