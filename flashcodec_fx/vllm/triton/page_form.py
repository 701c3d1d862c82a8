"""What the paged Triton kernels share: their limits, the page and code-slot layout as constexpr tuples, the device
tables (rotation, level table, search factors: ``ops.triton.common.stream_tables``), and the code-slot reader."""

from __future__ import annotations

from dataclasses import astuple, dataclass

import torch
import triton
import triton.language as tl

from ...ops.plan import LEVEL_KINDS, stored_form_plan
from ...ops.triton.common import StreamForm, pow2, stream_tables
from ..page import PageFormat

MAX_HEAD_DIM = 128  # a (D, D) rotation and a tile's whole head_dim live in registers
MAX_BLOCK_SIZE = 128  # a page's code slots are one tile
LLOYD_KIND: tl.constexpr = tl.constexpr(LEVEL_KINDS["lloyd"])

# Indices into the page tuple (``PageConsts.constexpr()``) and a stream's slot tuple (``SlotConsts``), by field name:
# tests/vllm/test_triton_kernels.py checks them against the dataclasses' fields; PageConsts reads the format's fields by
# name (PageFormat.meta, page.PAGE_FIELDS).
P_D: tl.constexpr = tl.constexpr(0)
P_DP: tl.constexpr = tl.constexpr(1)
P_BS: tl.constexpr = tl.constexpr(2)
P_A: tl.constexpr = tl.constexpr(3)
P_RAW_ROW: tl.constexpr = tl.constexpr(4)
P_SLOT: tl.constexpr = tl.constexpr(5)
P_RAW: tl.constexpr = tl.constexpr(6)
P_CENTER: tl.constexpr = tl.constexpr(7)
S_BITS: tl.constexpr = tl.constexpr(0)
S_KIND: tl.constexpr = tl.constexpr(1)
S_SEARCH: tl.constexpr = tl.constexpr(2)
S_ROTATE: tl.constexpr = tl.constexpr(3)
S_SCALE: tl.constexpr = tl.constexpr(4)
S_CODE: tl.constexpr = tl.constexpr(5)


def check_paged_limits(fmt: PageFormat, block_size: int) -> None:
    """ValueError naming the limit when the Triton kernels cannot serve ``fmt`` at ``block_size``."""
    if fmt.head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the paged Triton kernels take head_dim <= {MAX_HEAD_DIM}, got {fmt.head_dim}")
    if block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"the paged Triton kernels take block_size <= {MAX_BLOCK_SIZE}, got {block_size}")
    if fmt.raw:
        return
    for slot in fmt.slots:
        if slot.zeros or slot.scales != 1 or slot.codec.quantizer.rows != 1:
            raise ValueError(f"the paged Triton kernels take per-token codes with one scale and no zero point "
                             f"(levels int / midrise / lloyd), got {slot.codec.spec}")


@dataclass(frozen=True)
class PageConsts:
    """A page's layout in elements and bytes: head_dim ``d``, its power-of-two tile ``dp``, block size ``bs``, raw
    rows ``a``, bytes of a raw row and of a code slot, ``raw`` (every row raw), ``center`` (keys coded minus a page
    mean)."""

    d: int
    dp: int
    bs: int
    a: int
    raw_row: int
    slot: int
    raw: bool
    center: bool

    @classmethod
    def of(cls, fmt: PageFormat, block_size: int) -> PageConsts:
        meta = fmt.meta()
        return cls(fmt.head_dim, pow2(fmt.head_dim, 16), block_size, fmt.raw_rows(block_size), fmt.raw_row_bytes,
                   meta["slot"] if not fmt.raw else fmt.raw_row_bytes, bool(meta["raw"]), bool(meta["center"]))

    def constexpr(self) -> tuple:
        return astuple(self)


@dataclass(frozen=True)
class SlotConsts:
    """One stream's code-slot fields: bits, level kind, scale search, rotation, byte offsets of scale and codes."""

    bits: int
    kind: int
    search: bool
    rotate: bool
    scale: int
    code: int

    def constexpr(self) -> tuple:
        return astuple(self)


def stream_args(fmt: PageFormat, device: torch.device) -> list[tuple]:
    """Per stream (K, V): ``(form tuple, slot tuple, tables)``; placeholders for a raw format."""
    if fmt.raw:
        dummy = torch.zeros(1, dtype=torch.float32, device=device)
        return [((0,) * 19, (1, 0, False, False, 0, 0), (dummy, dummy, dummy))] * 2
    out = []
    for slot in fmt.slots:
        plan = stored_form_plan(slot.codec.spec, fmt.head_dim)
        tables = stream_tables(slot.codec, fmt.head_dim, device)
        consts = SlotConsts(plan.bits[0], plan.level_kind[0], plan.search, plan.rotate, slot.scale_offset,
                            slot.code_offset)
        out.append((StreamForm.of(plan).constexpr(), consts.constexpr(),
                    (tables.rotation, tables.levels, tables.factors)))
    return out


# --- device helpers ---------------------------------------------------------------------------------------------

@triton.jit
def rotation_tile(rot, D: tl.constexpr, DP: tl.constexpr, TRANSPOSE: tl.constexpr):
    """``R (D, D)`` (or ``R^T``) fp32 as a ``(DP, DP)`` tile, zero-padded."""
    i = tl.arange(0, DP)[:, None]
    e = tl.arange(0, DP)[None, :]
    ok = (i < D) & (e < D)
    if TRANSPOSE:
        return tl.load(rot + e * D + i, mask=ok, other=0.0)
    return tl.load(rot + i * D + e, mask=ok, other=0.0)


@triton.jit
def _code_slice(base, d, okd, BITS: tl.constexpr, WIDTH: tl.constexpr, D: tl.constexpr):
    """The bits the ``WIDTH``-bit slice holds of each code, shifted into place (zeros where the code has no such
    slice); ``base`` the byte pointers of the codes' first slice."""
    SHIFT: tl.constexpr = BITS - (BITS & (2 * WIDTH - 1))  # the bits the wider slices hold
    if (BITS & WIDTH) != 0:
        byte = tl.load(base + SHIFT * (D // 8) + (d * WIDTH) // 8, mask=okd, other=0).to(tl.int32)
        return ((byte >> ((d * WIDTH) % 8)) & ((1 << WIDTH) - 1)) << SHIFT
    return tl.zeros(okd.shape, tl.int32)


@triton.jit
def slot_rows(slot, ok, levels, S: tl.constexpr, P: tl.constexpr):
    """Decoded rows ``(N, DP)`` fp32 (in the codec's rotated space) of the code slots at byte pointers ``slot (N,)``,
    zero where not ``ok``: ``level[code] * scale`` (packing: ``codecs/pack.py``, widest slice first)."""
    D: tl.constexpr = P[P_D]
    DP: tl.constexpr = P[P_DP]
    BITS: tl.constexpr = S[S_BITS]
    d = tl.arange(0, DP)[None, :]
    okd = ok[:, None] & (d < D)
    scale = tl.load((slot + S[S_SCALE]).to(tl.pointer_type(tl.float16)), mask=ok, other=0.0).to(tl.float32)
    base = slot[:, None] + S[S_CODE]
    code = _code_slice(base, d, okd, BITS, 8, D) | _code_slice(base, d, okd, BITS, 4, D)
    code |= _code_slice(base, d, okd, BITS, 2, D) | _code_slice(base, d, okd, BITS, 1, D)
    if S[S_KIND] == LLOYD_KIND:
        level = tl.load(levels + code, mask=okd, other=0.0)
    else:  # affine levels: level[c] = c + level[0]
        level = code.to(tl.float32) + tl.load(levels)
    return tl.where(okd, level * scale[:, None], 0.0)
