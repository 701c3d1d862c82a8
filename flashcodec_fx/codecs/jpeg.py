"""`jpeg`: orthonormal DCT-II per block of r tokens, lowest K coefficients kept, optionally quantized per frequency.

``block_size=1`` is the identity transform (each token is its own block): per-token quantization.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .base import Codec, Encoded, check_count
from .dct import dct_basis
from .pack import check_head_dim
from .quant import AXES, SCALE_DTYPE, SEARCHES, Quantizer, search_mode
from .registry import SpecFields, register_codec

MAX_BLOCK = 256
DEFAULT_CHANNEL_GROUP = 128


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


MAX_SEED = 2**63 - 1
SEARCH_CODES = {False: 0, "trials": 1, "fit": 2}  # Quantizer.search as a spec's search= field


def _search_of_code(code: int):
    for mode, value in SEARCH_CODES.items():
        if value == code:
            return mode
    raise ValueError(f"a jpeg spec's search field must be one of {sorted(SEARCH_CODES.values())}, got {code}")


def _seed(rotate) -> int | None:
    if rotate is None or rotate is False:
        return None
    if rotate is True:
        return 0
    seed = check_count("rotate (a seed)", rotate)
    if seed > MAX_SEED:
        raise ValueError(f"rotate (a seed) must be in 0..2**63 - 1, got {seed}")
    return seed


def _bits(quant_bits, keep: int) -> tuple[int, ...] | None:
    if quant_bits is None:
        return None
    if isinstance(quant_bits, Sequence) and not isinstance(quant_bits, str):
        if len(quant_bits) != keep:
            raise ValueError(f"quant_bits as a table needs one entry per kept frequency ({keep}), got {len(quant_bits)}")
        bits = tuple(quant_bits)
    elif isinstance(quant_bits, bool) or not isinstance(quant_bits, int):
        raise TypeError(f"quant_bits must be None, an int in 1..8 or a sequence of them, got "
                        f"{type(quant_bits).__name__} {quant_bits!r}")
    else:
        bits = (quant_bits,) * keep
    for b in bits:
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"quant_bits entries must be ints, got {type(b).__name__} {b!r}")
        if not 1 <= b <= 8:
            raise ValueError(f"quant_bits entries must be in 1..8, got {b}")
    return bits


def _levels(levels, n_classes: int, axis: str) -> tuple[str, ...]:
    if levels is None:
        return ("int",) * n_classes
    if isinstance(levels, str):
        return (levels,) * n_classes
    if not isinstance(levels, Sequence) or not all(isinstance(v, str) for v in levels):
        raise TypeError(f"levels must be a level-set name or a sequence of them, got {levels!r}")
    want = "one per kept frequency" if axis == "token" else "(dc, ac)"
    if len(levels) != n_classes:
        raise ValueError(f"levels for scale_axis={axis!r} needs {n_classes} entries ({want}), got {len(levels)}")
    return tuple(levels)


def _device(device) -> str:
    return str(torch.device("cpu") if device is None else torch.device(device))


@functools.lru_cache(maxsize=256)
def _matrix(block_size: int, keep: int, synthesis: bool, device: str) -> torch.Tensor:
    """``M[:K]`` (analysis) or its transpose (synthesis), once per device."""
    basis = dct_basis(block_size, device)[:keep]
    return (basis.T if synthesis else basis).contiguous()


@register_codec
class JPEGCodec(Codec):
    """Keep the lowest ``keep_freqs`` DCT coefficients of each block of ``block_size`` tokens.

    ``keep_freqs == block_size`` is lossless up to fp rounding. ``quant_bits`` (an int, or one per kept frequency: a
    quantization table) quantizes the coefficients: ``levels`` (``"int"``, ``"uniform"``, ``"midrise"``, ``"lloyd"``;
    see ``levels.py``), ``scale_axis`` ``"token"`` (an fp16 scale per (block, frequency) over head_dim) or
    ``"channel"`` (per channel over ``group`` tokens, DC and AC classes; ``levels`` may then be a ``(dc, ac)`` pair),
    ``scale_search`` (how each slice's scale is chosen: ``False`` no clipping, ``True`` / ``"trials"`` the least
    squared error over a few clipping factors, ``"fit"`` a closed-form start and two least-squares passes;
    ``quant.py``). ``rotate`` (True or a seed) applies a fixed random-sign
    Walsh-Hadamard rotation along head_dim, ``center`` subtracts a per-channel mean taken from the first append,
    ``normalize`` stores the stream divided by per-channel powers of two that bring outlier channels back towards the
    others (``channel_norm.py``). ``sinks`` / ``window``: raw first / newest tokens, stored as ``raw_dtype`` says
    (``base.RAW_DTYPES``: by default bf16 in an fp32 stream of a quantized codec). Unquantized coefficients keep the
    stream dtype.
    """

    name = "jpeg"

    def __init__(self, block_size: int = 8, keep_freqs: int | None = None, quant_bits=None, *, levels=None,
                 scale_axis: str = "token", group: int | None = None, scale_search: bool | str = False, rotate=None,
                 center: bool = False, normalize: bool = False, sinks: int = 0, window: int = 0,
                 raw_dtype: str = "auto"):
        block_size = check_count("block_size", block_size, least=1)
        if block_size > MAX_BLOCK:
            raise ValueError(f"block_size must be in 1..{MAX_BLOCK}, got {block_size}")
        keep = block_size if keep_freqs is None else keep_freqs
        if isinstance(keep, bool) or not isinstance(keep, int):
            raise TypeError(f"keep_freqs must be None or an int, got {type(keep_freqs).__name__} {keep_freqs!r}")
        if not 1 <= keep <= block_size:
            raise ValueError(f"keep_freqs must be in 1..{block_size} (block_size), got {keep_freqs!r}")
        self.block_size, self.keep_freqs, self.rows = block_size, keep, keep
        self.rotate, self.center = _seed(rotate), _check_bool("center", center)
        self.normalize = _check_bool("normalize", normalize)
        self._set_residual(sinks, window)
        bits = _bits(quant_bits, keep)
        if not isinstance(scale_axis, str):
            raise TypeError(f"scale_axis must be one of {AXES}, got {type(scale_axis).__name__} {scale_axis!r}")
        if scale_axis not in AXES:
            raise ValueError(f"scale_axis must be one of {AXES}, got {scale_axis!r}")
        if not isinstance(scale_search, (bool, str)):
            raise TypeError(f"scale_search must be False, True or one of {SEARCHES}, got "
                            f"{type(scale_search).__name__} {scale_search!r}")
        scale_search = search_mode(scale_search)
        if bits is None:
            if levels is not None or scale_axis != "token" or group is not None or scale_search:
                raise ValueError("levels, scale_axis, group and scale_search apply to quantized coefficients: set "
                                 "quant_bits too")
            self._set_raw_dtype(raw_dtype)
            return
        if group is None:  # channel axis: the smallest multiple of block_size covering 128 tokens
            group = block_size if scale_axis == "token" else -(-DEFAULT_CHANNEL_GROUP // block_size) * block_size
        check_count("group", group, least=1)
        if group % block_size:
            raise ValueError(f"group must be a multiple of block_size={block_size}, got {group}")
        if scale_axis == "token" and group != block_size:
            raise ValueError(f"group applies to scale_axis='channel' (token-axis scales are per block), got "
                             f"group={group} with block_size={block_size}")
        self.blocks = group // block_size
        n_classes = keep if scale_axis == "token" else (1 if keep == 1 else 2)
        self.quantizer = Quantizer(bits, _levels(levels, n_classes, scale_axis), scale_axis, self.blocks, scale_search)
        self._set_raw_dtype(raw_dtype)

    def __repr__(self) -> str:
        return f"JPEGCodec({self.spec})"

    def spec_fields(self) -> dict[str, str | int]:
        q = self.quantizer
        fields: dict[str, str | int] = {"r": self.block_size, "k": self.keep_freqs}
        if q is not None:
            fields.update(bits=".".join(map(str, q.bits)), levels=".".join(q.levels), axis=q.axis, blocks=q.blocks,
                          search=SEARCH_CODES[q.search])
        fields.update(rotate="-" if self.rotate is None else self.rotate, center=int(self.center))
        if self.normalize:  # only when set: specs written before the option read back unchanged
            fields["norm"] = 1
        return fields

    @classmethod
    def from_spec_fields(cls, fields: SpecFields) -> JPEGCodec:
        r = fields.int("r")
        options = dict(rotate=None if fields.str("rotate") == "-" else fields.int("rotate"),
                       center=bool(fields.int("center")), normalize=fields.has("norm") and bool(fields.int("norm")),
                       sinks=fields.int("sinks"), window=fields.int("window"),
                       raw_dtype=fields.str("raw") if fields.has("raw") else "auto")
        if fields.has("bits"):
            options.update(quant_bits=fields.ints("bits"), levels=tuple(fields.str("levels").split(".")),
                           scale_axis=fields.str("axis"), group=fields.int("blocks") * r,
                           scale_search=_search_of_code(fields.int("search")))
        return cls(r, fields.int("k"), **options)

    @property
    def stores_raw(self) -> bool:
        return self.block_size == 1 and self.quantizer is None and self.rotate is None and not self.center \
            and not self.normalize and not self.sinks and not self.window

    def check_head_dim(self, head_dim: int) -> None:
        if self.quantizer is not None:
            for bits in sorted(set(self.quantizer.bits)):
                check_head_dim(head_dim, bits)

    def archive_shapes(self, head_dim, stream_dtype):
        q = self.quantizer
        if q is None:
            return {"data": ((self.rows, head_dim), stream_dtype), "scale": ((0,), SCALE_DTYPE),
                    "zero": ((0,), SCALE_DTYPE), "index": ((0,), torch.uint8)}
        return {"data": ((q.blocks, q.row_bytes(head_dim)), torch.uint8),
                "scale": (q.scale_shape(head_dim), SCALE_DTYPE), "zero": (q.zero_shape(head_dim), SCALE_DTYPE),
                "index": ((0,), torch.uint8)}

    def head_dim_of(self, enc: Encoded) -> int:
        if self.quantizer is None:
            return enc.data.shape[-1]
        return enc.data.shape[-1] * 8 // sum(self.quantizer.bits)

    def synthesis(self, device=None) -> torch.Tensor:
        return _matrix(self.block_size, self.keep_freqs, True, _device(device))

    def analysis(self, device=None) -> torch.Tensor:
        """``M (K, r)``: coefficients of a block ``X`` are ``M @ X``."""
        return _matrix(self.block_size, self.keep_freqs, False, _device(device))

    def encode_rows(self, blocks: torch.Tensor, dtype: torch.dtype) -> Encoded:
        coeffs = self.analysis(blocks.device) @ blocks  # (..., NB, K, D)
        lead, d = coeffs.shape[:-3], coeffs.shape[-1]
        nb = coeffs.shape[-3]
        empty = dict(device=blocks.device)
        if self.quantizer is None:
            ng = nb
            return Encoded(coeffs.to(dtype), torch.zeros(*lead, ng, 0, dtype=SCALE_DTYPE, **empty),
                           torch.zeros(*lead, ng, 0, dtype=SCALE_DTYPE, **empty),
                           torch.zeros(*lead, ng, 0, dtype=torch.uint8, **empty))
        g = self.quantizer.blocks
        codes, scale, zero = self.quantizer.quantize(coeffs.reshape(*lead, nb // g, g, self.keep_freqs, d))
        return Encoded(codes, scale, zero, torch.zeros(*lead, nb // g, 0, dtype=torch.uint8, **empty))

    def stored_rows(self, enc: Encoded, head_dim: int) -> torch.Tensor:
        if self.quantizer is None:
            return enc.data.float()
        rows = self.quantizer.dequantize(enc.data, enc.scale, enc.zero, head_dim)  # (..., NG, g, K, D)
        return rows.flatten(-4, -3)
