"""One codec's stored form at one head_dim, as both kernel backends read it: :class:`StoredFormPlan`.

The C++ kernels get it serialized (``cpu/plan.py``: an int64 ``meta`` vector and fp32 tables), the Triton kernels
as constexpr tuples and device tables (``triton/common.py``: ``StreamForm``, ``StreamTables``); neither derives
anything of the stored form from the codec itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..codecs import JPEGCodec, codec_from_spec, trellis
from ..codecs.jpeg import SEARCH_CODES
from ..codecs.levels import LEVEL_SETS
from ..codecs.quant import LLOYD_FACTORS, SHRINK_FACTORS

# Stored forms (``StoredFormPlan.form``):
FLOAT_ROWS = 0  # jpeg coefficients in the stream dtype, png anchor + deltas in fp32
PRUNED_ROWS = 1  # png keep_ratio < 1: anchor + the kept deltas, uint8 positions
TOKEN_CODES = 2  # packed codes, one fp16 scale per (block, row) (scale_axis="token")
CHANNEL_CODES = 3  # packed codes, fp16 scales per (group, class, channel) (scale_axis="channel")
# Level kinds (``StoredFormPlan.level_kind``, ``class_levels``): the index in ``codecs.levels.LEVEL_SETS`` (the scalar
# ``LEVELS``, then ``tcq``: trellis codes, ``codecs/trellis.py``).
LEVEL_KINDS = {name: i for i, name in enumerate(LEVEL_SETS)}
# Scale searches (``StoredFormPlan.search``; ``quant.Quantizer.search``): none, the clipping trials, the fit.
SEARCH_NONE, SEARCH_TRIALS, SEARCH_FIT = (SEARCH_CODES[m] for m in (False, "trials", "fit"))


@dataclass(frozen=True)
class StoredFormPlan:
    """The stored form of codec ``spec`` for vectors of ``head_dim`` channels (``K = rows``, ``r = block_size``).

    Block: ``form`` (one of ``FLOAT_ROWS .. CHANNEL_CODES``); ``jpeg`` (stored rows are DCT coefficients, else png's
    anchor + deltas); ``rows`` stored rows ``K``, ``dense`` rows of ``S`` in ``X = A @ S``, ``kept`` deltas of a pruned
    png (0 otherwise). Residual: ``sinks``, ``window``, ``tail`` rows of the raw tail; ``group`` tokens and
    ``group_blocks`` blocks per archive (and scale) group. Codes (empty / 0 when unquantized): ``classes`` /
    ``zero_classes`` scale and zero-point classes, ``row_bytes`` packed bytes per block; per stored row ``bits``,
    ``bit_offset`` (units of ``head_dim / 8`` bytes), ``byte_offset``, ``row_class``, ``zero_slot`` (of its class, -1:
    none) and ``level_kind``; per class ``class_levels`` (level kind), ``class_zero``, ``class_first`` /
    ``class_last`` rows, ``class_fit`` the ``(a, c)`` of "fit"'s start factor (``Quantizer.fit_line``); ``slices``
    the OR of the rows' bit widths, ``lloyd`` any Lloyd-Max row, ``search`` the scale search (``SEARCH_NONE`` /
    ``SEARCH_TRIALS`` / ``SEARCH_FIT``), ``level_width`` columns of ``levels``. Transform: ``rotate``, ``center``.

    Host tables (fp32, contiguous): ``synthesis`` ``A (r, dense)``; ``analysis`` ``M (K, r)`` of jpeg, else None;
    ``levels`` ``(K, level_width)`` each row's level table (``Quantizer.level_rows``), else None; ``rotation``
    ``(D, D)`` or None; ``shrink_factors`` / ``lloyd_factors`` the scale search's clipping factors; per class
    ``tcq_factors`` the trellis encoder's candidate scales (``trellis.scale_factors``; empty: not trellis codes).
    """

    spec: str
    head_dim: int
    form: int
    jpeg: bool
    block_size: int
    rows: int
    dense: int
    kept: int
    sinks: int
    window: int
    tail: int
    group: int
    group_blocks: int
    classes: int
    zero_classes: int
    row_bytes: int
    bits: tuple[int, ...]
    bit_offset: tuple[int, ...]
    byte_offset: tuple[int, ...]
    row_class: tuple[int, ...]
    zero_slot: tuple[int, ...]
    level_kind: tuple[int, ...]
    class_levels: tuple[int, ...]
    class_zero: tuple[int, ...]
    class_first: tuple[int, ...]
    class_last: tuple[int, ...]
    class_fit: tuple[tuple[float, float], ...]
    slices: int
    lloyd: bool
    search: int
    level_width: int
    rotate: bool
    center: bool
    shrink_factors: tuple[float, ...]
    lloyd_factors: tuple[float, ...]
    tcq_factors: tuple[tuple[float, ...], ...]
    synthesis: torch.Tensor = field(compare=False, repr=False)
    analysis: torch.Tensor | None = field(compare=False, repr=False)
    levels: torch.Tensor | None = field(compare=False, repr=False)
    rotation: torch.Tensor | None = field(compare=False, repr=False)

    @property
    def quantized(self) -> bool:
        return self.form in (TOKEN_CODES, CHANNEL_CODES)


@functools.lru_cache(maxsize=256)
def stored_form_plan(spec: str, head_dim: int) -> StoredFormPlan:
    """The :class:`StoredFormPlan` of codec ``spec`` at ``head_dim`` (made once per pair)."""
    codec = codec_from_spec(spec)
    q = codec.quantizer
    jpeg = isinstance(codec, JPEGCodec)
    rotation = codec.rotation(head_dim, "cpu")
    common = dict(spec=spec, head_dim=head_dim, jpeg=jpeg, block_size=codec.block_size, rows=codec.rows,
                  dense=codec.dense_rows, kept=codec.index_rows, sinks=codec.sinks, window=codec.window,
                  tail=codec.tail_capacity, group=codec.group, group_blocks=codec.blocks,
                  rotate=codec.rotate is not None, center=codec.center, shrink_factors=SHRINK_FACTORS,
                  lloyd_factors=LLOYD_FACTORS, synthesis=codec.synthesis("cpu").contiguous(),
                  analysis=codec.analysis("cpu").contiguous() if jpeg else None,
                  rotation=None if rotation is None else rotation.contiguous())
    if q is None:
        return StoredFormPlan(form=PRUNED_ROWS if codec.index_rows else FLOAT_ROWS, classes=0, zero_classes=0,
                              row_bytes=0, bits=(), bit_offset=(), byte_offset=(), row_class=(), zero_slot=(),
                              level_kind=(), class_levels=(), class_zero=(), class_first=(), class_last=(), class_fit=(),
                              slices=0, lloyd=False, search=SEARCH_NONE, level_width=1, levels=None, tcq_factors=(),
                              **common)
    slices = 0
    for b in q.bits:
        slices |= b
    kinds = tuple(LEVEL_KINDS[lv] for lv in q.levels)
    levels = q.level_rows("cpu").contiguous()  # tcq rows: their 2**(b+1) alphabet
    return StoredFormPlan(
        form=TOKEN_CODES if q.axis == "token" else CHANNEL_CODES, classes=len(q.classes), zero_classes=q.zero_classes,
        row_bytes=q.row_bytes(head_dim), bits=q.bits, bit_offset=q.row_offsets,
        byte_offset=tuple(o * head_dim // 8 for o in q.row_offsets), row_class=q.row_class,
        zero_slot=tuple(q.zero_slot[c] for c in q.row_class), level_kind=tuple(kinds[c] for c in q.row_class),
        class_levels=kinds, class_zero=q.zero_slot, class_first=tuple(rows[0] for rows in q.classes),
        class_last=tuple(rows[-1] for rows in q.classes),
        class_fit=tuple(q.fit_line(c, head_dim) for c in range(len(q.classes))),
        tcq_factors=tuple(trellis.scale_factors(q.bits[rows[0]], bool(q.search)) if lv == "tcq" else ()
                          for rows, lv in zip(q.classes, q.levels, strict=True)), slices=slices,
        lloyd="lloyd" in q.levels, search=SEARCH_CODES[q.search],
        level_width=levels.shape[1], levels=levels, **common)


def tcq_slots(factors: tuple[float, ...]) -> tuple[float, ...]:
    """One class's trellis candidates (``StoredFormPlan.tcq_factors``) padded with zeros to
    ``trellis.FACTOR_SLOTS``: a row of the kernels' candidate table."""
    return factors + (0.0,) * (trellis.FACTOR_SLOTS - len(factors))
