"""Shared pieces of the Triton kernels: the Triton path's limits, one stream's stored form (``ops.plan``) as a
constexpr tuple and as the device tables the kernels read (made when a stream allocates), and the stored-row loaders.

A stream's archive blocks are read as the dense stored rows ``S`` of ``X = A @ S`` (``codecs/base.py``) without
ever writing ``S`` out: float rows as they are, pruned png deltas scattered by their uint8 index, and packed codes
unpacked in registers (``codecs/pack.py``: power-of-two bit slices along head_dim) into their level values
(``level[code] * scale + zero``, ``codecs/levels.py``). Affine level sets (``int``, ``uniform``, ``midrise``) enter
the dots as the integer codes themselves (``level = code + offset``; the offset and the scale are applied outside the
dot); ``lloyd`` levels come from a small per-row level table, and so do trellis codes (``tcq``, ``codecs/trellis.py``),
whose table is the ``2**(bits+1)`` alphabet, read at the index each code makes with the low bits of the three codes
before it in its row (:func:`trellis_index`: no serial state, so a tile decodes every value at once).
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...codecs import Codec, trellis
from ...codecs.quant import LLOYD_FACTORS, SHRINK_FACTORS
from ..plan import (
    CHANNEL_CODES,
    FLOAT_ROWS,
    LEVEL_KINDS,
    PRUNED_ROWS,
    TOKEN_CODES,
    StoredFormPlan,
    stored_form_plan,
    tcq_slots,
)


class TupleFields:
    """The fields of a tuple the kernels take as one argument (or the rows of a table they read), declared once, in
    order: ``F_R = _FORM("r")`` declares field ``r`` and is its index, a module-level ``tl.constexpr`` (the globals
    Triton kernels may read, and part of their cache key) by which kernels read it: ``F[F_R]``. :meth:`namedtuple`
    is the Python side's tuple of those fields (built by name)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.names: list[str] = []

    def __call__(self, field: str) -> tl.constexpr:
        if field in self.names:
            raise ValueError(f"{self.name} declares {field!r} twice")
        self.names.append(field)
        return tl.constexpr(len(self.names) - 1)

    def namedtuple(self) -> type:
        return collections.namedtuple(self.name, self.names)


# What the Triton path accepts (launchers raise a ValueError naming the limit; the reference ops take more):
MAX_BLOCK_SIZE = 64  # a block's rows and a tile's positions live in registers
MAX_PRUNED_BLOCK_SIZE = 16  # pruned png scatters its deltas with one unrolled loop per kept delta
MAX_HEAD_DIM = 256  # one program holds a tile's whole head_dim
MAX_TILE_POSITIONS = 256  # positions of one attention tile: a multiple of lcm(block_size_k, block_size_v)
MAX_GROUP_TOKENS = 128  # the group encode / decode hold one archive group in registers
MAX_GRID_ROWS = 65535  # CUDA's limit on a grid's second and third axes: (batch * heads) of the per-group kernels
# The scale search's clipping factors (``quant.SHRINK_FACTORS`` / ``LLOYD_FACTORS``): slots a kernel loops over, counts
FACTOR_SLOTS: tl.constexpr = tl.constexpr(8)
N_SHRINK: tl.constexpr = tl.constexpr(len(SHRINK_FACTORS))
N_LLOYD: tl.constexpr = tl.constexpr(len(LLOYD_FACTORS))
# The trellis encoder's candidate scales: slots per row after the fit lines (``trellis.FACTOR_SLOTS``, zeros after
# the last of a row's candidates)
TCQ_SLOTS: tl.constexpr = tl.constexpr(trellis.FACTOR_SLOTS)

# Stored forms (``StreamForm.form``: ``ops.plan.FLOAT_ROWS .. CHANNEL_CODES``):
_FLOAT_ROWS: tl.constexpr = tl.constexpr(FLOAT_ROWS)
_PRUNED_ROWS: tl.constexpr = tl.constexpr(PRUNED_ROWS)
_TOKEN_CODES: tl.constexpr = tl.constexpr(TOKEN_CODES)
_CHANNEL_CODES: tl.constexpr = tl.constexpr(CHANNEL_CODES)
# The fields of the kernels' tuple of one stream's stored form (:class:`StreamForm`), in tuple order: each
# declaration is the field and its index (kernels: ``R: tl.constexpr = F[F_R]``).
_FORM = TupleFields("StreamForm")
F_FORM = _FORM("form")  # one of FLOAT_ROWS .. CHANNEL_CODES
F_R = _FORM("r")  # tokens per block
F_ROWS = _FORM("rows")  # stored rows per block in data (float / pruned), or quantized rows K
F_DENSE = _FORM("dense")  # rows of S (A's columns)
F_DENSE_P = _FORM("dense_p")  # dense's power-of-two tile
F_KEPT = _FORM("kept")  # deltas of a pruned png
F_SINKS = _FORM("sinks")
F_TAIL = _FORM("tail")  # rows of the raw tail
F_GROUP_BLOCKS = _FORM("group_blocks")  # blocks per scale group
F_CLASSES = _FORM("classes")  # scale classes
F_ZEROS = _FORM("zeros")  # zero-point classes
F_ROW_BYTES = _FORM("row_bytes")  # packed bytes per block
F_SLICES = _FORM("slices")  # the OR of the rows' bit widths (which power-of-two slices exist)
F_LLOYD = _FORM("lloyd")  # any row read through the level table (Lloyd-Max levels, trellis alphabets)
F_TCQ = _FORM("tcq")  # any trellis row (levels="tcq"): its table index is built from the codes before it
F_LEVELS_W = _FORM("levels_w")  # the level table's width
F_ROTATE = _FORM("rotate")
F_CENTER = _FORM("center")
F_FOLD = _FORM("fold")  # channel axis: every attention tile lies inside one scale group (scales fold into q / out)
F_OFFSET = _FORM("offset")  # the position of an attention tile's first token inside this stream's blocks
# The rows of the per-row int32 table (``StreamTables.rows``), by StoredFormPlan's per-row field: one column per
# stored row of a quantized block.
_ROWS = TupleFields("RowTable")
ROW_BITS = _ROWS("bits")
ROW_BIT_OFFSET = _ROWS("bit_offset")  # units of D / 8 bytes
ROW_CLASS = _ROWS("row_class")  # scale class
ROW_ZERO_SLOT = _ROWS("zero_slot")  # zero-point slot (-1: none)
ROW_KIND = _ROWS("level_kind")  # ops.plan.LEVEL_KINDS
# Level kinds (``ROW_KIND``: ``ops.plan.LEVEL_KINDS``):
KIND_INT: tl.constexpr = tl.constexpr(LEVEL_KINDS["int"])
KIND_UNIFORM: tl.constexpr = tl.constexpr(LEVEL_KINDS["uniform"])
KIND_MIDRISE: tl.constexpr = tl.constexpr(LEVEL_KINDS["midrise"])
KIND_LLOYD: tl.constexpr = tl.constexpr(LEVEL_KINDS["lloyd"])
KIND_TCQ: tl.constexpr = tl.constexpr(LEVEL_KINDS["tcq"])
TCQ_WINDOW: tl.constexpr = tl.constexpr(3)  # a trellis code's value reads the low bits of the 3 codes before it


def pow2(n: int, least: int = 1) -> int:
    """Smallest power of two >= max(n, least) (Triton tile dimensions are powers of two)."""
    return max(least, triton.next_power_of_2(max(1, n)))


def check_triton_limits(codec: Codec, head_dim: int, name: str = "spec") -> None:
    """Raise a ValueError when ``codec`` / ``head_dim`` exceed what the Triton kernels take (see the constants)."""
    r = codec.block_size
    if r > MAX_BLOCK_SIZE:
        raise ValueError(f"{name}: the Triton kernels take block_size <= {MAX_BLOCK_SIZE}, got {r}")
    if codec.index_rows and r > MAX_PRUNED_BLOCK_SIZE:
        raise ValueError(f"{name}: the Triton kernels take pruned png (keep_ratio < 1) with block_size <= "
                         f"{MAX_PRUNED_BLOCK_SIZE}, got {r}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels take head_dim <= {MAX_HEAD_DIM}, got {head_dim}")


def grid_rows(batch_heads: int) -> int:
    """``batch_heads`` (batch * heads) as the second axis of a per-group kernel's grid (the groups take the first,
    which holds up to 2**31 - 1 programs: a 128k-token stream has 128k groups of one token); raises a ValueError past
    CUDA's 65,535."""
    if batch_heads > MAX_GRID_ROWS:
        raise ValueError(f"batch * heads must be at most {MAX_GRID_ROWS} on the Triton path, got {batch_heads}")
    return batch_heads


def check_group_tokens(codec: Codec, op: str) -> None:
    """Raise a ValueError when ``codec``'s archive group exceeds what the group kernels hold in registers
    (:data:`MAX_GROUP_TOKENS`: one group per program; ``op`` names the launcher's op)."""
    if codec.group > MAX_GROUP_TOKENS:
        raise ValueError(f"spec: the Triton {op} takes groups of <= {MAX_GROUP_TOKENS} tokens (one group per "
                         f"program), got {codec.group}")


class StreamForm(_FORM.namedtuple()):
    """One stream's :class:`~flashcodec_fx.ops.plan.StoredFormPlan` as the kernels' constexpr tuple (its fields:
    the ``F_*`` declarations above, in tuple order); ``fold`` holds for channel-axis codes only, ``offset`` is 0 for
    the stream attention tiles align to; ``lloyd`` holds for trellis codes too (their alphabet is a level table)."""

    __slots__ = ()

    @classmethod
    def of(cls, plan: StoredFormPlan, fold: bool = False, offset: int = 0) -> StreamForm:
        """The tuple of ``plan`` (``ops.plan.stored_form_plan``); ``fold`` applies to channel-axis codes only."""
        tcq = LEVEL_KINDS["tcq"] in plan.level_kind
        return cls(form=plan.form, r=plan.block_size, rows=plan.rows, dense=plan.dense, dense_p=pow2(plan.dense),
                   kept=plan.kept, sinks=plan.sinks, tail=plan.tail, group_blocks=plan.group_blocks,
                   classes=plan.classes, zeros=plan.zero_classes, row_bytes=plan.row_bytes, slices=plan.slices,
                   lloyd=plan.lloyd or tcq, tcq=tcq, levels_w=plan.level_width, rotate=plan.rotate, center=plan.center,
                   fold=fold and plan.form == CHANNEL_CODES, offset=offset)

    def constexpr(self) -> tuple:
        return tuple(self)


@dataclass(frozen=True)
class StreamTables:
    """The device tensors the kernels read for one codec, copied from its plan's host tables (fp32 unless noted):
    ``synthesis`` ``A (r, R_dense)``; ``rotation`` ``(D, D)`` (a 1-element placeholder without rotation); ``rows``
    int32 ``(5, K)``: per quantized row its bits, bit offset (units of ``D / 8`` bytes), scale class, zero-point slot
    (-1: none) and level kind (``LEVEL_KINDS``); ``levels`` ``(K, 2**max_bits)``: each row's level table
    (``Quantizer.level_rows``); ``analysis`` ``M (K, r)`` of jpeg (coefficients ``M @ X``); ``factors`` ``(16 + 10 K,)``:
    the trials' clipping factors (``quant.SHRINK_FACTORS`` then ``quant.LLOYD_FACTORS``, 8 slots each, zero-padded),
    then "fit"'s start line of each row's class: ``K`` slopes ``a``, then ``K`` intercepts ``c``, then each row's
    trellis candidates (``TCQ_SLOTS`` per row, zero-padded; all zero: not trellis codes). Placeholders (one element)
    where a codec has no such table."""

    synthesis: torch.Tensor
    rotation: torch.Tensor
    rows: torch.Tensor
    levels: torch.Tensor
    analysis: torch.Tensor
    factors: torch.Tensor


def _device_key(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@functools.cache
def _tables(spec: str, head_dim: int, device: torch.device) -> StreamTables:
    plan = stored_form_plan(spec, head_dim)
    placeholder = torch.zeros(1, dtype=torch.float32)
    rows = torch.zeros(1, dtype=torch.int32)
    if plan.bits:
        rows = torch.tensor([getattr(plan, name) for name in _ROWS.names], dtype=torch.int32)
    slots, k = FACTOR_SLOTS.value, len(plan.bits)
    factors = torch.zeros(2 * slots + 2 * k + k * TCQ_SLOTS.value, dtype=torch.float32)
    factors[: len(plan.shrink_factors)] = torch.tensor(plan.shrink_factors)
    factors[slots: slots + len(plan.lloyd_factors)] = torch.tensor(plan.lloyd_factors)
    if k:  # "fit"'s start line (a, c) of each row's class
        lines = torch.tensor([plan.class_fit[c] for c in plan.row_class], dtype=torch.float32)
        factors[2 * slots: 2 * slots + k] = lines[:, 0]
        factors[2 * slots + k: 2 * slots + 2 * k] = lines[:, 1]
        factors[2 * slots + 2 * k:] = torch.tensor([tcq_slots(plan.tcq_factors[c]) for c in plan.row_class]).flatten()
    return StreamTables(*((placeholder if t is None else t).to(device) for t in (
        plan.synthesis, plan.rotation, rows, plan.levels, plan.analysis, factors)))


def stream_tables(codec: Codec, head_dim: int, device: torch.device | str) -> StreamTables:
    """The kernels' tables of ``codec`` on ``device``, cached for the process. The first call copies from the host,
    so it must not happen inside a CUDA-graph capture: a stream makes it when it allocates (``ops.warm``)."""
    return _tables(codec.spec, head_dim, _device_key(device))


def warm_tables(codec: Codec, head_dim: int, device: torch.device | str) -> None:
    """``ops.warm`` hook: create the kernels' tables of ``codec`` on ``device`` now."""
    stream_tables(codec, head_dim, device)


def require_contiguous(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the Triton kernels (the cache allocates it so)")


def io_dtype(dtype: torch.dtype) -> tl.dtype:
    if dtype == torch.float32:
        return tl.float32
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16:
        return tl.bfloat16
    raise TypeError(f"the Triton kernels take float16, bfloat16 or float32 streams, got {dtype}")


# --- device helpers ---------------------------------------------------------------------------------------------

@triton.jit
def fdiv(a, b):
    """Floor division of (possibly negative) integers by a positive ``b`` (compiled ``//`` truncates)."""
    return tl.where(a >= 0, a // b, -((b - 1 - a) // b))


@triton.jit
def mdot(a, b, T: tl.constexpr, PREC: tl.constexpr):
    """``a @ b`` with operands cast to ``T``; fp32 operands use precision ``PREC`` (``ieee`` or ``tf32x3``)."""
    if T == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return tl.dot(a.to(T), b.to(T))


@triton.jit
def row_info(rows_ptr, levels_ptr, j, ok, F: tl.constexpr):
    """Per stored row ``j`` (any shape) of a quantized stream: ``(bits, bit offset, class, zero slot, lloyd, offset)``
    where ``lloyd`` says the row's values come from its level table (Lloyd-Max levels, trellis alphabets) and
    ``offset`` is ``level[0]`` of an affine row (its level of code ``c`` is ``c + offset``), 0 for table rows."""
    K: tl.constexpr = F[F_ROWS]
    W: tl.constexpr = F[F_LEVELS_W]
    m = ok & (j < K)
    bits = tl.load(rows_ptr + j, mask=m, other=0)
    bit_off = tl.load(rows_ptr + ROW_BIT_OFFSET * K + j, mask=m, other=0)
    cls = tl.load(rows_ptr + ROW_CLASS * K + j, mask=m, other=0)
    zslot = tl.load(rows_ptr + ROW_ZERO_SLOT * K + j, mask=m, other=-1)
    kind = tl.load(rows_ptr + ROW_KIND * K + j, mask=m, other=0)
    lloyd = (kind == KIND_LLOYD) | (kind == KIND_TCQ)
    off = tl.where(lloyd, 0.0, tl.load(levels_ptr + j * W, mask=m, other=0.0))
    return bits, bit_off, cls, zslot, lloyd, off


@triton.jit
def _slice_bits(base, bits, bit_off, d, ok, w: tl.constexpr, D: tl.constexpr):
    """The bits a ``w``-bit slice holds of each code, already shifted into place (zero where the row has no such
    slice)."""
    has = (bits & w) != 0
    shift = bits - (bits & (2 * w - 1))
    byte = tl.load(base + (bit_off + shift) * (D // 8) + (d * w) // 8, mask=ok & has, other=0).to(tl.int32)
    return ((byte >> ((d * w) % 8)) & ((1 << w) - 1)) << shift


@triton.jit
def unpack_codes(data_ptr, blk, d, ok, bits, bit_off, F: tl.constexpr, D: tl.constexpr):
    """int32 codes of stored row (``bits``, ``bit_off``) of linear block ``blk`` (int64), channel ``d``, zero where
    not ``ok`` (all broadcast to the tile). Slice of width ``w`` holds bits ``shift .. shift + w - 1`` of each code
    (``shift``: the wider slices present), channel ``d`` in its byte ``d * w // 8`` at bit ``d * w % 8``; only the
    slice widths some row uses (``SLICES``) are read."""
    ROW_BYTES: tl.constexpr = F[F_ROW_BYTES]
    SLICES: tl.constexpr = F[F_SLICES]
    base = data_ptr + blk * ROW_BYTES
    code = tl.zeros(ok.shape, tl.int32)
    if (SLICES & 8) != 0:
        code |= _slice_bits(base, bits, bit_off, d, ok, 8, D)
    if (SLICES & 4) != 0:
        code |= _slice_bits(base, bits, bit_off, d, ok, 4, D)
    if (SLICES & 2) != 0:
        code |= _slice_bits(base, bits, bit_off, d, ok, 2, D)
    if (SLICES & 1) != 0:
        code |= _slice_bits(base, bits, bit_off, d, ok, 1, D)
    return code


@triton.jit
def _low_bit(base, bit_off, d, ok, w, D: tl.constexpr):
    """Bit 0 of the code at channel ``d``: it lies in the row's widest slice (``w`` bits wide, at the row's bit
    offset: ``unpack_codes``), zero where not ``ok``."""
    byte = tl.load(base + bit_off * (D // 8) + (d * w) // 8, mask=ok, other=0).to(tl.int32)
    return (byte >> ((d * w) % 8)) & 1


@triton.jit
def trellis_index(code, data_ptr, rows_ptr, blk, j, d, ok, bits, bit_off, F: tl.constexpr, D: tl.constexpr):
    """The level-table column of each code: the code itself, or on a trellis row (``levels="tcq"``) its alphabet
    index ``((c[t] >> 1) << 2) | l[t-2] | (l[t] ^ l[t-1] ^ l[t-3]) << 1`` (``codecs/trellis.py``), ``l`` the codes'
    low bits along the row (0 before ``d = 0``), read from the packed row at ``d - 1 .. d - 3``; arguments as
    :func:`unpack_codes` (``j``: the stored row, broadcast like ``bits``). A stream without trellis rows (``TCQ``)
    compiles to nothing."""
    TCQ: tl.constexpr = F[F_TCQ]
    if TCQ:
        K: tl.constexpr = F[F_ROWS]
        ROW_BYTES: tl.constexpr = F[F_ROW_BYTES]
        tcq = tl.load(rows_ptr + ROW_KIND * K + j, mask=(j >= 0) & (j < K), other=0) == KIND_TCQ
        w = tl.where(bits >= 8, 8, tl.where(bits >= 4, 4, tl.where(bits >= 2, 2, 1)))  # the widest slice
        index = alphabet_index(code, data_ptr + blk * ROW_BYTES, bit_off, d, ok & tcq, w, D)
        code = tl.where(tcq, index, code)
    return code


@triton.jit
def alphabet_index(code, base, bit_off, d, ok, w, D: tl.constexpr):
    """``trellis.alphabet_index`` of the trellis codes ``code`` at channels ``d`` of packed rows at byte pointers
    ``base`` (their widest slice, ``w`` bits wide, at ``bit_off * D / 8``: it holds the low bits): ``((c[t] >> 1) <<
    2) | l[t-2] | (l[t] ^ l[t-1] ^ l[t-3]) << 1``, the low bits ``l`` read at ``d - 1 .. d - 3`` (0 before ``d = 0``
    and where not ``ok``)."""
    l1 = _low_bit(base, bit_off, d - 1, ok & (d >= 1), w, D)
    l2 = _low_bit(base, bit_off, d - 2, ok & (d >= 2), w, D)
    l3 = _low_bit(base, bit_off, d - TCQ_WINDOW, ok & (d >= TCQ_WINDOW), w, D)
    return ((code >> 1) << 2) | l2 | (((code & 1) ^ l1 ^ l3) << 1)


@triton.jit
def level_values(code, j, lloyd, levels_ptr, ok, F: tl.constexpr):
    """The unscaled value each code stands for, fp32: ``level[code]`` for lloyd rows (the level table; trellis rows
    pass :func:`trellis_index`'s columns), else the code itself (affine rows: their ``offset`` is applied outside the
    dots)."""
    LLOYD: tl.constexpr = F[F_LLOYD]
    W: tl.constexpr = F[F_LEVELS_W]
    value = code.to(tl.float32)
    if LLOYD:
        value = tl.where(lloyd, tl.load(levels_ptr + j * W + code, mask=ok & lloyd, other=0.0), value)
    return value


@triton.jit
def float_rows(data_ptr, index_ptr, blk, j, d, ok, F: tl.constexpr, D: tl.constexpr):
    """Dense fp32 stored rows ``S[blk, j, d]`` of a float or pruned-png stream (``blk`` linear block ids, int64),
    zero where not ``ok``. Pruned png: dense row ``j >= 1`` is the delta at position ``j - 1``, found among the
    ``KEPT`` stored deltas by their uint8 index."""
    FORM: tl.constexpr = F[F_FORM]
    ROWS: tl.constexpr = F[F_ROWS]
    KEPT: tl.constexpr = F[F_KEPT]
    m = ok & (d < D)
    if FORM == _PRUNED_ROWS:
        rows = tl.load(data_ptr + blk * (ROWS * D) + d, mask=m & (j == 0), other=0.0).to(tl.float32)
        for i in tl.static_range(KEPT):
            where = tl.load(index_ptr + blk * (KEPT * D) + i * D + d, mask=m & (j > 0), other=255).to(tl.int32)
            delta = tl.load(data_ptr + blk * (ROWS * D) + (1 + i) * D + d, mask=m & (where == j - 1), other=0.0)
            rows += delta.to(tl.float32)
    else:
        rows = tl.load(data_ptr + blk * (ROWS * D) + j * D + d, mask=m & (j < ROWS), other=0.0).to(tl.float32)
    return rows

