"""What the paged Triton kernels share: their limits, the page and code-slot layout as constexpr tuples, the device
tables (rotation, level table, search factors: ``ops.triton.common.stream_tables``), and the code-slot reader."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.plan import LEVEL_KINDS, stored_form_plan
from ...ops.triton.common import StreamForm, TupleFields, alphabet_index, pow2, stream_tables
from ..page import PageFormat

MAX_HEAD_DIM = 128  # a (D, D) rotation and a tile's whole head_dim live in registers
MAX_BLOCK_SIZE = 128  # a page's code slots are one tile
LLOYD_KIND: tl.constexpr = tl.constexpr(LEVEL_KINDS["lloyd"])
TCQ_KIND: tl.constexpr = tl.constexpr(LEVEL_KINDS["tcq"])

# The fields of the page tuple (:class:`PageConsts`) and of a stream's slot tuple (:class:`SlotConsts`), in tuple
# order: each declaration is the field and its index (kernels: ``D: tl.constexpr = P[P_D]``).
_PAGE = TupleFields("PageConsts")
P_D = _PAGE("d")  # head_dim
P_DP = _PAGE("dp")  # its power-of-two tile
P_BS = _PAGE("bs")  # block size (slots per page)
P_A = _PAGE("a")  # raw rows of a page
P_RAW_ROW = _PAGE("raw_row")  # bytes of a raw row (K then V)
P_SLOT = _PAGE("slot")  # bytes of a code slot
P_RAW = _PAGE("raw")  # every row raw
P_CENTER = _PAGE("center")  # keys coded minus a page mean
_SLOT = TupleFields("SlotConsts")
S_BITS = _SLOT("bits")
S_WIDEST = _SLOT("widest")  # the codes' widest bit slice (it holds their low bits, a trellis code's branch)
S_KIND = _SLOT("kind")  # ops.plan.LEVEL_KINDS
S_SEARCH = _SLOT("search")  # the scale search (ops.plan SEARCH_*)
S_ROTATE = _SLOT("rotate")
S_SCALE = _SLOT("scale")  # byte offset of the fp16 scale in a slot
S_CODE = _SLOT("code")  # byte offset of the packed codes in a slot


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
                             f"(levels int / midrise / lloyd / tcq), got {slot.codec.spec}")


class PageConsts(_PAGE.namedtuple()):
    """A page's layout in elements and bytes (its fields: the ``P_*`` declarations above, in tuple order)."""

    __slots__ = ()

    @classmethod
    def of(cls, fmt: PageFormat, block_size: int) -> PageConsts:
        meta = fmt.meta()
        return cls(d=fmt.head_dim, dp=pow2(fmt.head_dim, 16), bs=block_size, a=fmt.raw_rows(block_size),
                   raw_row=fmt.raw_row_bytes, slot=meta["slot"] if not fmt.raw else fmt.raw_row_bytes,
                   raw=bool(meta["raw"]), center=bool(meta["center"]))

    def constexpr(self) -> tuple:
        return tuple(self)


class SlotConsts(_SLOT.namedtuple()):
    """One stream's code-slot fields (the ``S_*`` declarations above, in tuple order)."""

    __slots__ = ()

    def constexpr(self) -> tuple:
        return tuple(self)


def stream_args(fmt: PageFormat, device: torch.device) -> list[tuple]:
    """Per stream (K, V): ``(form tuple, slot tuple, tables)``; placeholders for a raw format."""
    if fmt.raw:
        dummy = torch.zeros(1, dtype=torch.float32, device=device)
        form = StreamForm._make((0,) * len(StreamForm._fields)).constexpr()
        slot = SlotConsts(bits=1, widest=1, kind=0, search=0, rotate=False, scale=0, code=0).constexpr()
        return [(form, slot, (dummy, dummy, dummy))] * 2
    out = []
    for slot in fmt.slots:
        plan = stored_form_plan(slot.codec.spec, fmt.head_dim)
        tables = stream_tables(slot.codec, fmt.head_dim, device)
        bits = plan.bits[0]
        consts = SlotConsts(bits=bits, widest=1 << (bits.bit_length() - 1), kind=plan.level_kind[0],
                            search=plan.search, rotate=plan.rotate, scale=slot.scale_offset, code=slot.code_offset)
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
    zero where not ``ok``: ``level[code] * scale`` (packing: ``codecs/pack.py``, widest slice first); trellis codes
    index their alphabet by the code and the low bits of the three before it (``alphabet_index``)."""
    D: tl.constexpr = P[P_D]
    DP: tl.constexpr = P[P_DP]
    BITS: tl.constexpr = S[S_BITS]
    d = tl.arange(0, DP)[None, :]
    okd = ok[:, None] & (d < D)
    scale = tl.load((slot + S[S_SCALE]).to(tl.pointer_type(tl.float16)), mask=ok, other=0.0).to(tl.float32)
    base = slot[:, None] + S[S_CODE]
    code = _code_slice(base, d, okd, BITS, 8, D) | _code_slice(base, d, okd, BITS, 4, D)
    code |= _code_slice(base, d, okd, BITS, 2, D) | _code_slice(base, d, okd, BITS, 1, D)
    if S[S_KIND] == TCQ_KIND:
        code = alphabet_index(code, base, 0, d, okd, S[S_WIDEST], D)
    if S[S_KIND] == LLOYD_KIND or S[S_KIND] == TCQ_KIND:
        level = tl.load(levels + code, mask=okd, other=0.0)
    else:  # affine levels: level[c] = c + level[0]
        level = code.to(tl.float32) + tl.load(levels)
    return tl.where(okd, level * scale[:, None], 0.0)
