"""The quantization stage: the stored rows of a block (DCT coefficients, or tokens) -> packed codes + 16-bit scales.

A block has ``K`` stored rows of ``D`` channels; row ``j`` gets ``bits[j]`` bits (a quantization table, as in JPEG).
Rows are grouped into *scale classes*; each class has one level set (see ``levels.py``) and one scale (and, for
``uniform`` levels, one zero point) per slice:

- ``axis="token"``: every row is its own class, with one scale per (block, row) over head_dim. For ``block_size=1``
  that is one scale per token and vector (TurboQuant-style); for a DCT block, one per (block, frequency).
- ``axis="channel"``: scales per channel over the ``blocks`` blocks of a scale group (KIVI-style keys); row 0 (DC)
  is one class and rows ``1..K-1`` (AC) share a second one (one step for every AC frequency, JPEG-style), so a
  group stores two scales per channel whatever ``K`` is.

Scales and zero points are stored in fp16; codes are computed with the rounded values, so decoding is exact with
respect to what is stored. ``search=True`` tries a few clipping factors per slice and keeps the least squared error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import trellis
from .levels import MAX_BITS, base_scale, check_levels, code_range, level_table, qmax
from .pack import pack, unpack

AXES = ("token", "channel")
SCALE_DTYPE = torch.float16
SHRINK_FACTORS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)  # int / midrise / uniform: clip the range
LLOYD_FACTORS = (0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4)  # lloyd: around the RMS
_FP16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class Quantizer:
    """``bits``: per stored row (``K`` entries, 1..8). ``levels``: one level set per scale class. ``axis``: ``"token"``
    or ``"channel"``. ``blocks``: blocks per scale group (channel axis; 1 for the token axis). ``search``: least-squares
    clipping search at encode."""

    bits: tuple[int, ...]
    levels: tuple[str, ...]
    axis: str = "token"
    blocks: int = 1
    search: bool = False

    def __post_init__(self):
        if self.axis not in AXES:
            raise ValueError(f"scale_axis must be one of {AXES}, got {self.axis!r}")
        for b in self.bits:
            if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BITS:
                raise ValueError(f"quant_bits entries must be ints in 1..{MAX_BITS}, got {b!r}")
        if len(self.levels) != len(self.classes):
            raise ValueError(f"levels needs one entry per scale class ({len(self.classes)}), got {len(self.levels)}")
        for rows, lv in zip(self.classes, self.levels, strict=True):
            for j in rows:
                check_levels("levels", lv, self.bits[j])
            if lv == "uniform" and len({self.bits[j] for j in rows}) > 1:
                raise ValueError("levels='uniform' needs one bit width per scale class (its zero point and step are "
                                 f"shared); the AC rows have bits {sorted({self.bits[j] for j in rows})}")
        if "tcq" in self.levels and self.axis != "token":
            raise ValueError("levels='tcq' codes each row along head_dim with one scale per row: it needs "
                             f"scale_axis='token', got {self.axis!r}")
        if self.axis == "token" and self.blocks != 1:
            raise ValueError(f"scale_axis='token' keeps one scale per row: blocks must be 1, got {self.blocks}")

    @property
    def rows(self) -> int:
        return len(self.bits)

    @functools.cached_property
    def classes(self) -> tuple[tuple[int, ...], ...]:
        """Rows of each scale class (token axis: one class per row; channel axis: DC, then AC)."""
        k = len(self.bits)
        if self.axis == "token":
            return tuple((j,) for j in range(k))
        return ((0,),) if k == 1 else ((0,), tuple(range(1, k)))

    @functools.cached_property
    def row_class(self) -> tuple[int, ...]:
        return tuple(c for j in range(self.rows) for c, rows in enumerate(self.classes) if j in rows)

    @functools.cached_property
    def zero_slot(self) -> tuple[int, ...]:
        """Index of each class's zero point in the ``zero`` tensor, -1 for classes without one (not ``uniform``)."""
        slots, n = [], 0
        for lv in self.levels:
            slots.append(n if lv == "uniform" else -1)
            n += lv == "uniform"
        return tuple(slots)

    @property
    def zero_classes(self) -> int:
        return sum(s >= 0 for s in self.zero_slot)

    @functools.cached_property
    def row_offsets(self) -> tuple[int, ...]:
        """Bit offset of each row inside a block's packed bytes, in units of head_dim / 8 bytes."""
        out, acc = [], 0
        for b in self.bits:
            out.append(acc)
            acc += b
        return tuple(out)

    def row_bytes(self, head_dim: int) -> int:
        """Packed bytes of one block's ``K`` rows: ``sum(bits) * D / 8``."""
        return sum(self.bits) * head_dim // 8

    def scale_shape(self, head_dim: int) -> tuple[int, int]:
        """Per group: token axis ``(blocks, classes)``; channel axis ``(classes, D)``."""
        return (self.blocks, len(self.classes)) if self.axis == "token" else (len(self.classes), head_dim)

    def zero_shape(self, head_dim: int) -> tuple[int, int]:
        return (self.blocks, self.zero_classes) if self.axis == "token" else (self.zero_classes, head_dim)

    def group_bytes(self, head_dim: int) -> int:
        """Stored bytes of one scale group: codes + fp16 scales + fp16 zero points."""
        s, z = self.scale_shape(head_dim), self.zero_shape(head_dim)
        return self.blocks * self.row_bytes(head_dim) + 2 * (s[0] * s[1] + z[0] * z[1])

    def level_rows(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``(K, 2**max_bits)`` fp32: the level table of each row (padded with zeros), for kernels."""
        tables = [level_table(self.levels[self.row_class[j]], b) for j, b in enumerate(self.bits)]
        out = torch.zeros(self.rows, max(t.numel() for t in tables), dtype=torch.float32)  # tcq: 2**(b+1) columns
        for j, table in enumerate(tables):
            out[j, : table.numel()] = table
        return out.to(device)

    def warm(self, device: torch.device | str) -> None:
        """Cache every level table of this quantizer on ``device``."""
        for j, b in enumerate(self.bits):
            level_table(self.levels[self.row_class[j]], b, device)

    # --- encode / decode -------------------------------------------------------------------------------------

    def _reduce_dims(self) -> tuple[int, ...]:
        return (-1,) if self.axis == "token" else (-3, -2)

    def _class_values(self, rows: torch.Tensor, c: int) -> torch.Tensor:
        idx = self.classes[c]
        return rows[..., idx[0]: idx[0] + 1, :] if len(idx) == 1 else rows[..., idx[0]: idx[-1] + 1, :]

    def _candidates(self, x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(F, ...)`` candidate fp16-rounded scales and zero points of class ``c`` (one per search factor)."""
        lv, dims = self.levels[c], self._reduce_dims()
        rows = self.classes[c]
        if lv in ("int", "midrise") and len(rows) > 1:
            # one shared step: the no-clipping step of the row whose range needs the largest one
            div = torch.tensor([qmax(self.bits[j]) if lv == "int" else 1 << (self.bits[j] - 1) for j in rows],
                               dtype=x.dtype, device=x.device)[:, None]
            base = (x.abs().amax(dims[:-1] if self.axis == "channel" else dims, keepdim=True) / div)
            base, zero = base.amax(-2, keepdim=True), torch.zeros((), dtype=x.dtype, device=x.device)
        else:
            base, zero = base_scale(lv, self.bits[rows[0]], x, dims)
        factors = LLOYD_FACTORS if lv == "lloyd" else SHRINK_FACTORS
        if not self.search:
            factors = (1.0,)
        f = torch.tensor(factors, dtype=x.dtype, device=x.device).view(-1, *[1] * base.dim())
        scale = base * f
        if lv != "uniform":
            return fp16_toward(scale, up=True), torch.zeros_like(scale)
        steps = (1 << self.bits[rows[0]]) - 1
        mid = zero + base * steps / 2
        low = fp16_toward(mid - scale * steps / 2, up=False)
        return fp16_toward((mid + scale * steps / 2 - low) / steps, up=True), low

    def _nearest(self, x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, c: int) -> torch.Tensor:
        """Codes of the levels nearest to ``x`` (class ``c``): grids round half to even, Lloyd-Max ties go down."""
        lv = self.levels[c]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = (x - zero) / safe
        codes = torch.empty(y.shape, dtype=torch.int32, device=x.device)
        rows = self.classes[c]
        for i, j in enumerate(rows):
            b = self.bits[j]
            yj = y[..., i: i + 1, :]
            table = level_table(lv, b, x.device)
            lo, hi = code_range(lv, b)
            if lv == "lloyd":
                mids = (table[1:] + table[:-1]) / 2
                cj = torch.bucketize(yj.contiguous(), mids, right=False)
            else:
                cj = torch.round(yj - table[0])
            codes[..., i: i + 1, :] = cj.clamp(lo, hi).to(torch.int32)
        return codes

    def _levels_of(self, codes: torch.Tensor, c: int) -> torch.Tensor:
        if self.levels[c] == "tcq":  # token axis: one row per class, its values decoded along head_dim
            return trellis.levels(codes, self.bits[self.classes[c][0]])
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
        for i, j in enumerate(self.classes[c]):
            table = level_table(self.levels[c], self.bits[j], codes.device)
            out[..., i: i + 1, :] = table[codes[..., i: i + 1, :].long()]
        return out

    def quantize(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``rows (..., g, K, D)`` fp32 (``g = blocks``) -> ``codes (..., g, row_bytes)`` uint8, ``scale`` and ``zero``
        fp16 of shapes ``(..., *scale_shape)`` and ``(..., *zero_shape)``."""
        rows = rows.float()
        lead, d = rows.shape[:-3], rows.shape[-1]
        codes = torch.empty(rows.shape, dtype=torch.int32, device=rows.device)
        scales, zeros = [], []
        for c, idx in enumerate(self.classes):
            x = self._class_values(rows, c)
            if self.levels[c] == "tcq":  # the trellis' own search (trellis.py): codes and scale (..., g, 1)
                tcq_codes, scale = trellis.encode(x, self.bits[idx[0]], self.search)
                codes[..., idx[0]: idx[0] + 1, :] = tcq_codes
                scales.append(scale)
                continue
            cand_s, cand_z = self._candidates(x, c)
            if cand_s.shape[0] > 1:
                err = torch.stack([
                    ((self._levels_of(self._nearest(x, s, z, c), c) * s + z - x) ** 2).sum(self._reduce_dims(), keepdim=True)
                    for s, z in zip(cand_s, cand_z, strict=True)])
                best = err.argmin(0, keepdim=True)
                scale = cand_s.gather(0, best.expand(1, *cand_s.shape[1:]))[0]
                zero = cand_z.gather(0, best.expand(1, *cand_z.shape[1:]))[0]
            else:
                scale, zero = cand_s[0], cand_z[0]
            codes[..., idx[0]: idx[-1] + 1, :] = self._nearest(x, scale, zero, c)
            scales.append(scale)
            if self.zero_slot[c] >= 0:
                zeros.append(zero)
        packed = torch.cat([pack(codes[..., j, :], b) for j, b in enumerate(self.bits)], dim=-1)
        if self.axis == "token":
            scale = torch.cat([s.reshape(*lead, self.blocks, 1) for s in scales], dim=-1)
            zero = torch.cat([z.reshape(*lead, self.blocks, 1) for z in zeros], dim=-1) if zeros \
                else rows.new_zeros(*lead, self.blocks, 0)
        else:
            scale = torch.cat([s.reshape(*lead, 1, d) for s in scales], dim=-2)
            zero = torch.cat([z.reshape(*lead, 1, d) for z in zeros], dim=-2) if zeros else rows.new_zeros(*lead, 0, d)
        return packed, scale.to(SCALE_DTYPE), zero.to(SCALE_DTYPE)

    def codes(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        """``(..., g, row_bytes)`` uint8 -> ``(..., g, K, D)`` int32 codes."""
        rows, start = [], 0
        for b in self.bits:
            n = b * head_dim // 8
            rows.append(unpack(packed[..., start: start + n], b, head_dim))
            start += n
        return torch.stack(rows, dim=-2)

    def dequantize(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Inverse of :meth:`quantize`: ``(..., g, K, D)`` fp32 rows ``level[code] * scale + zero``."""
        codes = self.codes(packed, head_dim)
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
        scale, zero = scale.float(), zero.float()
        for c, idx in enumerate(self.classes):
            sl = slice(idx[0], idx[-1] + 1)
            if self.axis == "token":
                s = scale[..., c][..., None, None]
                z = zero[..., self.zero_slot[c]][..., None, None] if self.zero_slot[c] >= 0 else 0.0
            else:
                s = scale[..., c, :][..., None, None, :]
                z = zero[..., self.zero_slot[c], :][..., None, None, :] if self.zero_slot[c] >= 0 else 0.0
            out[..., sl, :] = self._levels_of(codes[..., sl, :], c) * s + z
        return out


def fp16_toward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """The nearest fp16 value ``>= x`` (``up``) or ``<= x``, in fp32 (clamped to the fp16 range): scales round up and
    zero points down, so the stored grid still covers every value the unrounded one covered."""
    x = x.float()
    half = x.clamp(-_FP16_MAX, _FP16_MAX).to(SCALE_DTYPE)
    near = half.float()
    off = ((near < x) if up else (near > x)) & (x.abs() <= _FP16_MAX)
    bits = half.view(torch.int16).to(torch.int32)
    negative, magnitude = bits < 0, bits & 0x7FFF
    grow = negative != up  # moving away from zero: up from a positive value, down from a negative one
    magnitude = torch.where(grow, magnitude + 1, magnitude - 1)
    crossing = magnitude < 0  # from a zero of the other sign: the smallest subnormal of the direction's sign
    negative = torch.where(crossing, torch.full_like(negative, not up), negative)
    magnitude = torch.where(crossing, torch.ones_like(magnitude), magnitude)
    stepped = ((negative.to(torch.int32) << 15) | magnitude).to(torch.int16).view(SCALE_DTYPE)
    return torch.where(off, stepped, half).float()
