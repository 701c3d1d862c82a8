"""`CodecKVCache`: the K and V streams of one attention layer, and decode attention over two streams' stored
form."""

from __future__ import annotations

import math

import torch

from ..codecs import Codec, make_codec
from .growth import ceil_div
from .stream import CodecStream


def static_positions(key_codec: Codec, value_codec: Codec, max_length: int) -> int:
    """Positions both streams of a static layer allocate: the smallest count >= ``max_length`` that both archives
    tile exactly (so the K and V views have one length). Needs the same ``sinks`` on both."""
    if key_codec.sinks != value_codec.sinks:
        raise ValueError(f"the static layout needs the same sinks for keys and values, got {key_codec.sinks} and "
                         f"{value_codec.sinks}")
    step = math.lcm(key_codec.group, value_codec.group)
    return key_codec.sinks + ceil_div(max(0, max_length - key_codec.sinks), step) * step


def _codec(codec, options: dict) -> Codec | None:
    """``codec``, or one built from codec options (as :func:`make_codec`; options left at None take the defaults)."""
    options = {name: value for name, value in options.items() if value is not None}
    if codec is not None and options:
        raise ValueError(f"pass either codecs (key_codec / value_codec) or codec options, not both (got "
                         f"{sorted(options)})")
    if codec is None and not options:
        return None
    return make_codec(options.pop("mode", "jpeg"), **options) if codec is None else codec


class CodecKVCache:
    """K and V streams of one attention layer. ``key_codec`` / ``value_codec`` may differ; or pass codec options as
    keywords (``CodecKVCache(mode="jpeg", block_size=8, keep_freqs=2)``), shared by both streams."""

    def __init__(self, key_codec: Codec | None = None, value_codec: Codec | None = None, layout: str = "dynamic",
                 max_length: int | None = None, memoize: bool = False, crop: str = "decode", **codec_options):
        if value_codec is not None and codec_options:
            raise ValueError("pass either codecs (key_codec / value_codec) or codec options, not both")
        key_codec = _codec(key_codec, dict(codec_options))
        if key_codec is None:
            raise TypeError("CodecKVCache needs a codec (key_codec, see make_codec) or codec options, e.g. "
                            "CodecKVCache(mode='jpeg', block_size=8, keep_freqs=8, quant_bits=8)")
        value_codec = key_codec if value_codec is None else value_codec
        positions = None
        if layout == "static" and isinstance(max_length, int) and isinstance(value_codec, Codec):
            positions = static_positions(key_codec, value_codec, max_length)
        self.keys = CodecStream(key_codec, layout, max_length, memoize, crop, positions)
        self.values = CodecStream(value_codec, layout, max_length, memoize, crop, positions)

    @property
    def layout(self) -> str:
        return self.keys.layout

    def forward(self, k_seq: torch.Tensor, v_seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill from a full sequence ``(B, H, S, D)`` (forgetting what was stored); returns the stored views."""
        self.reset()
        return self.decode_step(k_seq, v_seq)

    __call__ = forward

    def decode_step(self, new_k: torch.Tensor, new_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(B, H, T, D)`` keys and values; returns the stored views ``(B, H, L, D)`` (what
        :meth:`attention` without ``new`` reads; ``attention(q, new=(new_k, new_v))`` reads this call's tokens
        exactly instead)."""
        self.append(new_k, new_v)
        return self.read()

    def check_new(self, new_k: torch.Tensor, new_v: torch.Tensor, same_head_dim: bool = True) -> None:
        """Reject keys and values these streams cannot take together, before any state changes. ``same_head_dim``:
        both need one head dim, as :meth:`attention` reads them with the same queries (False: :meth:`read` only)."""
        self.keys.check_new(new_k)
        self.values.check_new(new_v)
        if new_k.shape[:3] != new_v.shape[:3]:
            raise ValueError(f"new_k and new_v must share (B, H, T), got {tuple(new_k.shape)} and {tuple(new_v.shape)}")
        if same_head_dim and new_k.shape[3] != new_v.shape[3]:
            raise ValueError(f"new_k and new_v must share the head dim: keys have {new_k.shape[3]}, values "
                             f"{new_v.shape[3]} (CodecKVCache.attention reads both with the queries' head dim)")

    def append(self, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        if not torch.compiler.is_compiling():
            self.check_new(new_k, new_v)
        self.keys.append(new_k, checked=True)
        self.values.append(new_v, checked=True)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.read(), self.values.read()

    def get_seq_length(self) -> int:
        return self.keys.get_seq_length()

    def crop(self, n: int) -> None:
        """Both streams keep the same tokens (see :meth:`CodecStream.crop`); a refused crop changes neither."""
        self.keys.check_crop(n)
        self.values.check_crop(n)
        self.keys.crop(n)
        self.values.crop(n)

    def index_select(self, indices: torch.Tensor) -> None:
        """Beam reorder / batch selection of every tensor of both streams."""
        self.keys.index_select(indices)
        self.values.index_select(indices)

    reorder = index_select

    def repeat_interleave(self, repeats: int) -> None:
        self.keys.repeat_interleave(repeats)
        self.values.repeat_interleave(repeats)

    def reset(self) -> None:
        self.keys.reset()
        self.values.reset()

    def release_memo(self) -> None:
        self.keys.release_memo()
        self.values.release_memo()

    def storage_breakdown(self) -> dict[str, int]:
        k, v = self.keys.storage_breakdown(), self.values.storage_breakdown()
        return {part: k[part] + v[part] for part in k}

    def storage_bytes(self) -> int:
        """Every byte both streams hold (see :meth:`storage_breakdown`)."""
        return self.keys.storage_bytes() + self.values.storage_bytes()

    def bits_per_value(self) -> float:
        """Stored bits per cached value (K and V), as stored (:meth:`CodecStream.stored_bits`)."""
        tail = self.keys.tail
        n = 0 if tail is None else tail.shape[0] * tail.shape[1] * tail.shape[3] * self.get_seq_length()
        return (self.keys.stored_bits() + self.values.stored_bits()) / max(1, 2 * n)

    def attention(self, q: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None,
                  new: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Decode attention on the stored form: see :func:`codec_decode_attention`."""
        return codec_decode_attention(q, self.keys, self.values, mask, scale, new)


def codec_decode_attention(q: torch.Tensor, key_stream: CodecStream, value_stream: CodecStream,
                           mask: torch.Tensor | None = None, scale: float | None = None,
                           new: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``q (B, Hq, T, D)`` attends over both streams' stored state without building the ``(S, D)`` view; returns
    ``(B, Hq, T, D)`` in q's dtype. GQA by grouping query heads. ``new``: the current call's ``(keys, values)``,
    already appended, read exactly (as the prompt is)."""
    if not (key_stream.is_initialized and value_stream.is_initialized):
        raise RuntimeError("codec_decode_attention needs streams that hold at least one token")
    if not torch.compiler.is_compiling() and key_stream.get_seq_length() != value_stream.get_seq_length():
        raise ValueError(f"key and value streams must have the same length, got {key_stream.get_seq_length()} and "
                         f"{value_stream.get_seq_length()}")
    k_new, v_new = (None, None) if new is None else new
    (k_state, k_spec), (v_state, v_spec) = key_stream.op_state(), value_stream.op_state()
    return torch.ops.flashcodec.codec_attention(q, k_state, v_state, k_spec, v_spec, k_new, v_new, mask, scale)
