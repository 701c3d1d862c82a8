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
respect to what is stored. The scale of each slice (``search``, :data:`SEARCHES`):

- ``False``: the level set's no-clipping scale (``levels.base_scale``: the RMS for ``lloyd``, the range otherwise);
- ``"trials"`` (``True``): one pass per clipping factor (:data:`LLOYD_FACTORS` around the RMS, :data:`SHRINK_FACTORS`
  of the range), the least squared error kept (the first of equal errors), then the final codes: 7 or 6 passes + 1;
- ``"fit"``: two passes. Start at one clipping factor (``lloyd``: :func:`fit_start`'s closed form in the slice's
  largest magnitude over its RMS, fitted on Gaussian rows; other level sets: 1, no clipping), nearest codes, the
  least-squares scale of those codes (``<x, l> / <l, l>``; ``uniform``: scale and zero point together) rounded to
  the nearest fp16, nearest codes again, and their least-squares scale: those codes and that scale are stored.
  On rotated K/V rows and Gaussian rows it errs as little as the trials (docs/quantization.md).
"""

from __future__ import annotations

import functools
import math
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
SEARCHES = ("trials", "fit")  # Quantizer.search, besides False (True means "trials")
FIT_ROUNDS = 2  # "fit": nearest codes, then their least-squares scale, this many times
FIT_RANGE = (0.5, 1.6)  # "fit": the start factor is clamped to this range
# "fit"'s start factor: clamp(a * amax / base + c, *FIT_RANGE) times the no-clipping scale ``base`` (the RMS for
# Lloyd-Max levels), per level set, bit width and slice size (values per scale slice: head_dim on the token axis;
# other sizes interpolate in log2(size), clamped), fitted on unit-Gaussian slices (benchmarks/bench_clipping.py fit):
# Lloyd-Max levels the least-squares line of the best factor (a grid of 0.01 over FIT_RANGE) in amax / RMS; the other
# level sets one constant (a = 0), the one whose "fit" errs least. 1-bit Lloyd-Max: any positive start gives the sign
# codes, whose least-squares scale is the optimum.
FIT_SIZES = (32, 64, 128, 256, 512)
FIT_LINES: dict[tuple[str, int], tuple[tuple[float, float], ...]] = {
    ("int", 2): ((0.0, 0.5), (0.0, 0.5), (0.0, 0.5), (0.0, 0.5), (0.0, 0.5)),
    ("int", 3): ((0.0, 0.82), (0.0, 0.75), (0.0, 0.69), (0.0, 0.64), (0.0, 0.6)),
    ("int", 4): ((0.0, 0.96), (0.0, 0.92), (0.0, 0.87), (0.0, 0.81), (0.0, 0.77)),
    ("int", 5): ((0.0, 0.99), (0.0, 0.98), (0.0, 0.96), (0.0, 0.93), (0.0, 0.89)),
    ("int", 6): ((0.0, 1.0), (0.0, 1.0), (0.0, 0.99), (0.0, 0.98), (0.0, 0.96)),
    ("int", 7): ((0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (0.0, 0.99), (0.0, 0.99)),
    ("int", 8): ((0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0)),
    ("uniform", 1): ((0.0, 1.35), (0.0, 1.2), (0.0, 1.59), (0.0, 0.98), (0.0, 1.45)),
    ("uniform", 2): ((0.0, 0.73), (0.0, 0.65), (0.0, 0.59), (0.0, 0.55), (0.0, 0.51)),
    ("uniform", 3): ((0.0, 0.92), (0.0, 0.86), (0.0, 0.8), (0.0, 0.74), (0.0, 0.69)),
    ("uniform", 4): ((0.0, 0.98), (0.0, 0.96), (0.0, 0.93), (0.0, 0.88), (0.0, 0.84)),
    ("uniform", 5): ((0.0, 0.99), (0.0, 0.99), (0.0, 0.98), (0.0, 0.96), (0.0, 0.94)),
    ("uniform", 6): ((0.0, 1.0), (0.0, 1.0), (0.0, 0.99), (0.0, 0.99), (0.0, 0.98)),
    ("uniform", 7): ((0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (0.0, 0.99)),
    ("uniform", 8): ((0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0)),
    ("midrise", 1): ((0.0, 0.5), (0.0, 0.5), (0.0, 0.5), (0.0, 0.5), (0.0, 0.5)),
    ("midrise", 2): ((0.0, 0.84), (0.0, 0.76), (0.0, 0.69), (0.0, 0.64), (0.0, 0.6)),
    ("midrise", 3): ((0.0, 0.97), (0.0, 0.9), (0.0, 0.83), (0.0, 0.77), (0.0, 0.72)),
    ("midrise", 4): ((0.0, 1.02), (0.0, 0.99), (0.0, 0.94), (0.0, 0.88), (0.0, 0.83)),
    ("midrise", 5): ((0.0, 1.02), (0.0, 1.01), (0.0, 0.99), (0.0, 0.97), (0.0, 0.93)),
    ("midrise", 6): ((0.0, 1.01), (0.0, 1.01), (0.0, 1.0), (0.0, 0.99), (0.0, 0.98)),
    ("midrise", 7): ((0.0, 1.01), (0.0, 1.01), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0)),
    ("midrise", 8): ((0.0, 1.01), (0.0, 1.01), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0)),
    ("lloyd", 1): ((0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0)),
    ("lloyd", 2): ((0.1888, 0.5703), (0.1035, 0.7425), (0.0437, 0.8825), (0.0317, 0.9075), (0.0099, 0.9699)),
    ("lloyd", 3): ((0.4001, 0.0332), (0.3191, 0.1737), (0.1991, 0.4444), (0.1441, 0.5687), (0.0723, 0.7695)),
    ("lloyd", 4): ((0.3394, 0.0568), (0.3449, 0.0201), (0.3245, 0.0469), (0.2767, 0.1492), (0.1912, 0.3813)),
    ("lloyd", 5): ((0.2081, 0.3189), (0.2183, 0.2815), (0.2326, 0.2285), (0.2595, 0.1364), (0.2623, 0.1092)),
    ("lloyd", 6): ((0.1315, 0.4682), (0.1321, 0.4788), (0.1406, 0.4616), (0.1397, 0.472), (0.1406, 0.4609)),
}


def search_mode(value) -> str | bool:
    """``scale_search`` as :class:`Quantizer` keeps it: ``False``, ``"trials"`` (also ``True``) or ``"fit"``."""
    if value is False or value is True:
        return "trials" if value else False
    if isinstance(value, str) and value in SEARCHES:
        return value
    raise ValueError(f"scale_search must be False, True or one of {SEARCHES}, got {value!r}")


@functools.cache
def fit_start(levels: str, bits: int, size: int) -> tuple[float, float]:
    """``(a, c)`` of "fit"'s start factor ``clamp(a * amax / base + c, *FIT_RANGE)`` for ``levels`` of ``bits`` over
    slices of ``size`` values (:data:`FIT_LINES`; ``(0, 1)``, no clipping, where it has no line), as fp32 values
    (the kernels get them in their plans)."""
    lines = FIT_LINES.get((levels, bits))
    if lines is None:
        return 0.0, 1.0
    lo, hi = math.log2(FIT_SIZES[0]), math.log2(FIT_SIZES[-1])
    t = min(max(math.log2(max(size, 1)), lo), hi)
    i = min(int(t - lo), len(FIT_SIZES) - 2)
    w = t - math.log2(FIT_SIZES[i])
    line = [lines[i][k] * (1 - w) + lines[i + 1][k] * w for k in (0, 1)]
    return tuple(float(v) for v in torch.tensor(line, dtype=torch.float32).tolist())


@dataclass(frozen=True)
class Quantizer:
    """``bits``: per stored row (``K`` entries, 1..8). ``levels``: one level set per scale class. ``axis``: ``"token"``
    or ``"channel"``. ``blocks``: blocks per scale group (channel axis; 1 for the token axis). ``search``: how each
    slice's scale is chosen at encode (module docstring): ``False``, ``"trials"`` (``True``) or ``"fit"``."""

    bits: tuple[int, ...]
    levels: tuple[str, ...]
    axis: str = "token"
    blocks: int = 1
    search: bool | str = False

    def __post_init__(self):
        object.__setattr__(self, "search", search_mode(self.search))
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

    def _base(self, x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The no-clipping ``(scale, zero)`` of each slice of class ``c`` (unrounded)."""
        lv, dims = self.levels[c], self._reduce_dims()
        rows = self.classes[c]
        if lv in ("int", "midrise") and len(rows) > 1:
            # one shared step: the no-clipping step of the row whose range needs the largest one
            div = torch.tensor([qmax(self.bits[j]) if lv == "int" else 1 << (self.bits[j] - 1) for j in rows],
                               dtype=x.dtype, device=x.device)[:, None]
            base = (x.abs().amax(dims[:-1] if self.axis == "channel" else dims, keepdim=True) / div)
            return base.amax(-2, keepdim=True), torch.zeros((), dtype=x.dtype, device=x.device)
        return base_scale(lv, self.bits[rows[0]], x, dims)

    def slice_size(self, c: int, head_dim: int) -> int:
        """Values per scale slice of class ``c``: ``head_dim`` (token axis), else the class's rows of a group."""
        return head_dim if self.axis == "token" else self.blocks * len(self.classes[c])

    def fit_line(self, c: int, head_dim: int) -> tuple[float, float]:
        """``(a, c)`` of "fit"'s start factor of class ``c`` (:func:`fit_start`)."""
        return fit_start(self.levels[c], self.bits[self.classes[c][0]], self.slice_size(c, head_dim))

    def _candidates(self, x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(F, ...)`` candidate fp16-rounded scales and zero points of class ``c`` (one per search factor; "fit":
        its start)."""
        lv = self.levels[c]
        base, zero = self._base(x, c)
        if self.search == "fit":
            a, b = self.fit_line(c, x.shape[-1])
            amax = x.abs().amax(self._reduce_dims(), keepdim=True)
            ratio = amax / torch.where(base > 0, base, torch.ones_like(base))
            line = torch.tensor([a, b], dtype=x.dtype, device=x.device)
            f = (ratio * line[0] + line[1]).clamp(*FIT_RANGE)[None]
        else:
            factors = (LLOYD_FACTORS if lv == "lloyd" else SHRINK_FACTORS) if self.search else (1.0,)
            f = torch.tensor(factors, dtype=x.dtype, device=x.device).view(-1, *[1] * base.dim())
        scale = base * f
        if lv != "uniform":
            return fp16_toward(scale, up=True), torch.zeros_like(scale)
        steps = (1 << self.bits[self.classes[c][0]]) - 1
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

    def _refit(self, x: torch.Tensor, lv: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The least-squares ``(scale, zero)`` of codes with levels ``lv`` for values ``x`` (class ``c``), each rounded
        to the nearest fp16; a slice keeps ``(scale, zero)`` where the fit is not a positive finite scale. Sums in
        torch's order over the slice (the C++ encoder adds in the same order)."""
        dims = self._reduce_dims()
        xl = (x * lv).sum(dims, keepdim=True)
        ll = (lv * lv).sum(dims, keepdim=True)
        if self.levels[c] != "uniform":
            fit = xl / torch.where(ll > 0, ll, torch.ones_like(ll))
            ok = (ll > 0) & (fit > 0) & (fit <= _FP16_MAX)
            return torch.where(ok, fp16_nearest(fit), scale), zero
        n = float(math.prod(x.shape[d] for d in dims))
        sx = x.contiguous().sum(dims, keepdim=True)
        sl = lv.sum(dims, keepdim=True)
        det = n * ll - sl * sl
        fit = (n * xl - sx * sl) / torch.where(det > 0, det, torch.ones_like(det))
        ok = (det > 0) & (fit > 0) & (fit <= _FP16_MAX)
        scale = torch.where(ok, fp16_nearest(fit), scale)
        return scale, torch.where(ok, fp16_nearest((sx - scale * sl) / n), zero)

    def _fit(self, x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``search="fit"`` for class ``c``: ``(codes, scale, zero)`` (module docstring)."""
        cand_s, cand_z = self._candidates(x, c)
        scale, zero = cand_s[0], cand_z[0]
        for _ in range(FIT_ROUNDS):
            codes = self._nearest(x, scale, zero, c)
            scale, zero = self._refit(x, self._levels_of(codes, c), scale, zero, c)
        return codes, scale, zero

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
            if self.search == "fit":
                class_codes, scale, zero = self._fit(x, c)
                codes[..., idx[0]: idx[-1] + 1, :] = class_codes
                scales.append(scale)
                if self.zero_slot[c] >= 0:
                    zeros.append(zero)
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


def fp16_nearest(x: torch.Tensor) -> torch.Tensor:
    """The nearest fp16 value of ``x`` (ties to even), in fp32, clamped to the fp16 range."""
    return x.float().clamp(-_FP16_MAX, _FP16_MAX).to(SCALE_DTYPE).float()


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
