"""What every codec shares: the stored form of an archive group, the residual policy, and the linear-map contract.

A stream ``(B, H, S, D)`` is stored as

- ``sinks`` raw first tokens (positions ``0 .. sinks - 1``),
- an archive of *groups* of ``G`` tokens (``G`` = ``blocks`` blocks of ``r``), starting at position ``sinks``: a group
  is archived once it is complete and older than the ``window`` newest tokens, and never changes afterwards,
- a raw tail holding the tokens between the archive and the stream's length (at most ``window + G - 1``).

Before a group is encoded, an optional per-channel mean (taken from the first append, the prompt) is subtracted and
an optional fixed rotation along head_dim is applied. Every codec is linear along seq: a block ``X (r, D)`` of the
centered, rotated tokens is ``A @ S`` with ``S`` its dense stored rows (after dequantization), so attention can run
on ``S`` directly (``ops/reference/attention.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch

from .rotation import rotation

RAW_DTYPES = ("auto", "stream", "bfloat16")
"""A codec's ``raw_dtype``: how its raw rows (sinks, tail) are stored. ``"stream"``: in the stream dtype.
``"bfloat16"``: in bf16, the stream being fp32 (the tokens enter rounded to bf16; the call's own tokens, the queries,
the view and attention's output stay fp32). ``"auto"`` (the default): what a cache stores with, per stream
(:meth:`Codec.resolved`): ``"bfloat16"`` for an fp32 stream of a per-token quantized codec with raw sinks or a raw
window (every lossy preset), else ``"stream"``; the ops, given an ``"auto"`` spec, store in the stream dtype."""

if TYPE_CHECKING:
    from .registry import SpecFields


class Encoded(NamedTuple):
    """Stored form of ``NG`` archive groups (shapes per codec: :meth:`Codec.archive_shapes`).

    data:  stored rows (stream dtype or fp32) ``(..., NG, R, D)``, or packed codes ``(..., NG, g, row_bytes)`` uint8.
    scale: fp16 scales of quantized codecs (else an empty ``(..., NG, 0)``-shaped tensor).
    zero:  fp16 zero points of ``uniform`` scale classes (else empty).
    index: uint8 positions of kept png deltas when pruned ``(..., NG, M, D)`` (else empty).
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    index: torch.Tensor


def check_count(name: str, value, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    return value


def check_choice(name: str, value, choices) -> str:
    """``value`` when it is one of the strings ``choices``: ``TypeError`` for another type, ``ValueError`` for another
    string (both naming ``name`` and the choices)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


class Codec:
    """Base of every codec (see the module docstring). Subclasses (registered with
    :func:`~flashcodec_fx.codecs.registry.register_codec`) set their ``name``, the transform (``synthesis``,
    ``encode_rows``), the archive layout (``archive_shapes``), :meth:`stored_rows` and their spec fields."""

    name: ClassVar[str]
    block_size: int
    rows: int  # stored rows per block (before any quantization)
    blocks: int = 1  # blocks per archive group
    sinks: int = 0
    window: int = 0
    center: bool = False
    normalize: bool = False  # stored divided by per-channel powers of two (``channel_norm.py``)
    rotate: int | None = None  # rotation seed
    quantizer = None
    raw_dtype: str = "auto"  # how the raw rows are stored (:data:`RAW_DTYPES`)

    def _set_residual(self, sinks: int, window: int) -> None:
        self.sinks = check_count("sinks", sinks)
        self.window = check_count("window", window)

    def _set_raw_dtype(self, raw_dtype: str) -> None:
        """Set :attr:`raw_dtype` (after the quantizer: ``"bfloat16"`` needs one)."""
        if not isinstance(raw_dtype, str):
            raise TypeError(f"raw_dtype must be one of {RAW_DTYPES}, got {type(raw_dtype).__name__} {raw_dtype!r}")
        if raw_dtype not in RAW_DTYPES:
            raise ValueError(f"raw_dtype must be one of {RAW_DTYPES}, got {raw_dtype!r}")
        if raw_dtype == "bfloat16" and self.quantizer is None:
            raise ValueError("raw_dtype='bfloat16' applies to quantized codecs (quant_bits): an unquantized archive "
                             "keeps the stream dtype, and so do its raw rows")
        self.raw_dtype = raw_dtype

    def resolved(self, stream_dtype: torch.dtype) -> Codec:
        """The codec a stream of ``stream_dtype`` stores with: for ``raw_dtype="auto"``, the codec with
        ``raw_dtype="bfloat16"`` when the stream is fp32 and the codec quantizes per token (``G = 1``) with raw sinks or
        a raw window, else this codec (its raw rows in the stream dtype); ValueError for a ``"bfloat16"`` codec on
        another dtype than fp32. Block codecs (``G > 1``) keep the stream dtype unless asked: a crop that reopens one
        of their groups writes its decoded rows into the raw tail, which bf16 would round (per-token groups are never
        reopened); ``int8`` (no raw token) encodes its fp32 tokens as given."""
        if self.raw_dtype != "auto":
            self.raw_rows_dtype(stream_dtype)
            return self
        if stream_dtype == torch.float32 and self.quantizer is not None and self.group == 1 \
                and (self.sinks > 0 or self.window > 0):
            return self.with_raw_dtype("bfloat16")
        return self

    def with_raw_dtype(self, raw_dtype: str) -> Codec:
        """This codec with :attr:`raw_dtype` ``raw_dtype`` (read back from its spec: a codec that has the option)."""
        from .registry import codec_from_spec

        return codec_from_spec(self._spec(raw_dtype))

    def raw_rows_dtype(self, stream_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the raw rows (sinks, tail) of a stream of ``stream_dtype`` as the ops store it: bf16 for
        ``raw_dtype="bfloat16"`` (ValueError unless the stream is fp32), else the stream dtype."""
        if self.raw_dtype != "bfloat16":
            return stream_dtype
        if stream_dtype != torch.float32:
            raise ValueError(f"raw_dtype='bfloat16' stores the raw rows of float32 streams, got {stream_dtype} "
                             f"(raw_dtype='auto' picks per stream)")
        return torch.bfloat16

    @property
    def group(self) -> int:
        """Tokens per archive group ``G``."""
        return self.blocks * self.block_size

    @property
    def tail_capacity(self) -> int:
        """Rows of the raw tail: the window plus one open group."""
        return self.window + self.group

    @property
    def quant_bits(self) -> int:
        """Largest bit width of the stored codes, 0 when unquantized."""
        return max(self.quantizer.bits) if self.quantizer is not None else 0

    @property
    def index_rows(self) -> int:
        return 0

    @property
    def stores_raw(self) -> bool:
        """Whether the archive holds every token as given, in the stream dtype, at its position (no transform, no
        quantization, no sinks or window): the archive is then the decoded view itself."""
        return False

    @property
    def dense_rows(self) -> int:
        """Rows ``R`` of the dense ``S`` of a block in ``X = A @ S`` (after dequantization / index scatter)."""
        return self.rows

    @property
    def spec(self) -> str:
        """The codec as the string the ``torch.ops.flashcodec`` ops take (``codec_from_spec`` inverts it):
        ``"<name>;key=value;..."`` of :meth:`spec_fields`, then the residual policy."""
        return self._spec(self.raw_dtype)

    def _spec(self, raw_dtype: str) -> str:
        fields = {**self.spec_fields(), "sinks": self.sinks, "window": self.window}
        if raw_dtype != "auto":  # only when set: specs written before the option read back unchanged
            fields["raw"] = raw_dtype
        return ";".join([self.name, *(f"{key}={value}" for key, value in fields.items())])

    def spec_fields(self) -> dict[str, str | int]:
        """The codec's own ``key=value`` fields of :attr:`spec`, in order (the residual policy follows)."""
        raise NotImplementedError

    @classmethod
    def from_spec_fields(cls, fields: SpecFields) -> Codec:
        """The codec whose :attr:`spec` has these fields (``sinks``, ``window`` and ``raw`` included)."""
        raise NotImplementedError

    def __eq__(self, other) -> bool:
        return isinstance(other, Codec) and self.spec == other.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    # --- layout ----------------------------------------------------------------------------------------------

    def archive_shapes(self, head_dim: int, stream_dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-group shape and dtype of each :class:`Encoded` field."""
        raise NotImplementedError

    def empty_archive(self, lead: tuple[int, ...], groups: int, head_dim: int, stream_dtype: torch.dtype,
                      device: torch.device | str | None) -> Encoded:
        """Zeroed storage for ``groups`` archive groups."""
        shapes = self.archive_shapes(head_dim, stream_dtype)
        return Encoded(*(torch.zeros(*lead, groups, *shape, dtype=dtype, device=device)
                         for shape, dtype in shapes.values()))

    def group_bytes(self, head_dim: int, stream_dtype: torch.dtype) -> int:
        """Stored bytes of one archive group (every field)."""
        total = 0
        for shape, dtype in self.archive_shapes(head_dim, stream_dtype).values():
            n = 1
            for s in shape:
                n *= s
            total += n * torch.empty((), dtype=dtype).element_size()
        return total

    def check_head_dim(self, head_dim: int) -> None:
        """Raise if the codec cannot store vectors of ``head_dim`` channels."""

    def warm(self, head_dim: int, device: torch.device | str) -> None:
        """Create the codec's constant tensors on ``device`` now (they are cached per device), so that no later call,
        e.g. inside a CUDA-graph capture, copies one from the host."""
        self.synthesis(device)
        self.rotation(head_dim, device)
        if self.quantizer is not None:
            self.quantizer.warm(device)

    # --- math ------------------------------------------------------------------------------------------------

    def synthesis(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``A (r, R)`` fp32 such that a block is ``A @ stored_rows``."""
        raise NotImplementedError

    def rotation(self, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        """``R (D, D)`` fp32 applied to every archived vector (``x -> R @ x``), or None."""
        return None if self.rotate is None else rotation(head_dim, self.rotate, device)

    def prepare(self, x: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
        """``x (..., S, D)`` -> fp32 centered (``mean (..., D)``) and rotated tokens: what the transform sees."""
        x = x.float()
        if self.center and mean is not None:
            x = x - mean[..., None, :].float()
        rot = self.rotation(x.shape[-1], x.device)
        return x if rot is None else x @ rot.T

    def restore(self, x: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
        """Inverse of :meth:`prepare` (fp32)."""
        rot = self.rotation(x.shape[-1], x.device)
        if rot is not None:
            x = x @ rot
        if self.center and mean is not None:
            x = x + mean[..., None, :].float()
        return x

    def blockify(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., NB * r, D)`` -> ``(..., NB, r, D)``; the seq length must be a multiple of r."""
        *lead, seq, dim = x.shape
        if seq % self.group:
            raise ValueError(f"x: seq length {seq} is not a multiple of the archive group ({self.group} tokens)")
        return x.reshape(*lead, seq // self.block_size, self.block_size, dim)

    def encode_rows(self, blocks: torch.Tensor, dtype: torch.dtype) -> Encoded:
        """``(..., NB, r, D)`` prepared fp32 blocks -> the stored form of their ``NB / blocks`` groups (``dtype``: the
        stream's, kept by unquantized jpeg coefficients)."""
        raise NotImplementedError

    def stored_rows(self, enc: Encoded, head_dim: int) -> torch.Tensor:
        """Dense fp32 ``S (..., NB, R, D)`` (per block) with each block equal to ``synthesis() @ S``."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor, mean: torch.Tensor | None = None) -> Encoded:
        """``x (..., NG * G, D)`` tokens of complete groups -> their stored form (``mean``: the stream's center)."""
        self.check_head_dim(x.shape[-1])
        return self.encode_rows(self.blockify(self.prepare(x, mean)), x.dtype)

    def decode(self, enc: Encoded, dtype: torch.dtype, mean: torch.Tensor | None = None) -> torch.Tensor:
        """Stored groups -> ``(..., NG * G, D)`` tokens in ``dtype``: ``A @ S`` per block, rotated back, mean added."""
        blocks = self.synthesis(enc.data.device) @ self.stored_rows(enc, self.head_dim_of(enc))
        return self.restore(blocks.flatten(-3, -2), mean).to(dtype)

    def head_dim_of(self, enc: Encoded) -> int:
        """``D`` of stored groups."""
        return enc.data.shape[-1]
