"""`CodecKVCache`: the storage engine for one attention layer's K and V streams (no transformers import).

A stream keeps an archive of encoded blocks (``codecs.Encoded`` tensors), a raw tail of the open block
(< r tokens, stream dtype), a 0-dim int64 device length and, optionally, a memoized reconstruction that
receives each block's decoded rows once, when the block is archived.

Layouts:
- ``dynamic``: the archive starts at 16 blocks and doubles on overflow; a host-side length mirror drives growth.
- ``static``: preallocated for ``max_length`` tokens; ``append`` never branches on tensor values on the host,
  so a decode step compiles to one graph and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from . import ops  # noqa: F401  (registers torch.ops.flashcodec)
from .codecs import Codec, Encoded, make_codec

LAYOUTS = ("dynamic", "static")
INITIAL_BLOCKS = 16


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class CodecStream:
    """One compressed ``(B, H, S, D)`` stream. Storage is allocated on the first append."""

    def __init__(self, codec: Codec, layout: str = "dynamic", max_length: int | None = None, memoize: bool = True):
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a flashcodec_fx Codec (see make_codec), got {type(codec).__name__}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if layout == "static" and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"max_length must be a positive int for the static layout, got {max_length!r}")
        self.codec, self.layout, self.max_length, self.memoize = codec, layout, max_length, memoize
        self.state: Encoded | None = None
        self.tail: torch.Tensor | None = None
        self.length: torch.Tensor | None = None
        self.memo: torch.Tensor | None = None
        self._host_length = 0  # eager mirror of `length`: drives growth and bound checks, never read in compiled code

    @property
    def spec(self) -> list[int]:
        return self.codec.spec

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

    @property
    def capacity_blocks(self) -> int:
        return 0 if self.state is None else self.state.data.shape[2]

    @property
    def archived_tokens(self) -> int:
        """Tokens held in the archive (host mirror)."""
        return self._host_length // self.codec.block_size * self.codec.block_size

    def _allocate(self, like: torch.Tensor, blocks: int) -> None:
        b, h, _, d = like.shape
        r = self.codec.block_size
        self.state = self.codec.empty_state((b, h), blocks, d, like.dtype, like.device)
        self.tail = like.new_zeros(b, h, r, d)
        self.length = torch.zeros((), dtype=torch.int64, device=like.device)
        self.memo = like.new_zeros(b, h, blocks * r, d) if self.memoize else None
        ops.prepare_device(self.codec, like.device)  # now, not inside a later CUDA-graph capture

    def _grow(self, blocks: int) -> None:
        old, old_memo, n = self.state, self.memo, self.capacity_blocks
        b, h, _, _, d = old.data.shape
        self.state = self.codec.empty_state((b, h), blocks, d, self.tail.dtype, self.tail.device)
        for new, prev in zip(self.state, old, strict=True):
            new[:, :, :n].copy_(prev)
        if old_memo is not None:
            self.memo = old_memo.new_zeros(b, h, blocks * self.codec.block_size, d)
            self.memo[:, :, : old_memo.shape[2]].copy_(old_memo)

    def _check_new(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[2] < 1:
            raise ValueError(f"new tokens must be a (B, H, T, D) tensor with T >= 1, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"new tokens must be a floating tensor, got {x.dtype}")
        if self.tail is not None:
            b, h, _, d = self.tail.shape
            if (x.shape[0], x.shape[1], x.shape[3]) != (b, h, d) or x.dtype != self.tail.dtype:
                raise ValueError(f"new tokens must be ({b}, {h}, T, {d}) {self.tail.dtype}, got {x.dtype} {tuple(x.shape)}")

    def _check_room(self, t: int) -> None:
        if self.layout == "static" and self._host_length + t > self.max_length:
            raise ValueError(f"static cache holds max_length={self.max_length} tokens; "
                             f"{self._host_length} stored + {t} new exceeds it")

    def append(self, x: torch.Tensor) -> None:
        """Append ``x (B, H, T, D)``; completed blocks are archived on the device."""
        compiling = torch.compiler.is_compiling()
        if not compiling:
            self._check_new(x)
            self._check_room(x.shape[2])
        r, t = self.codec.block_size, x.shape[2]
        if self.layout == "static":
            if self.state is None:
                self._allocate(x, _ceil_div(self.max_length, r))
        else:
            need = _ceil_div(self._host_length + t, r)
            if self.state is None:
                self._allocate(x, max(INITIAL_BLOCKS, need))
            elif need > self.capacity_blocks:
                grown = self.capacity_blocks
                while grown < need:
                    grown *= 2
                self._grow(grown)
        torch.ops.flashcodec.append(*self.state, self.tail, self.length, x.contiguous(), self.spec, self.memo)
        if not compiling:
            self._host_length += t

    def read(self) -> torch.Tensor:
        """The full-precision view ``(B, H, L, D)``.

        Dynamic: ``L`` is the stored length (a slice of the memo, or one decode when not memoized).
        Static: ``L`` is the capacity ``ceil(max_length / r) * r``; positions past the length are to be masked.
        """
        if self.state is None:
            raise RuntimeError("read() before any token was appended")
        if self.memo is not None:
            view = self.memo
        else:
            view = torch.ops.flashcodec.read(*self.state, self.tail, self.length, self.spec)
        return view if self.layout == "static" else view[:, :, : self._host_length]

    def get_seq_length(self) -> int:
        """Stored tokens. Static: the device length (one host sync); raises when appends overflowed ``max_length``
        (a compiled step skips the host check; the append op never writes past the capacity and records the
        overflow in the length)."""
        if self.layout == "static" and self.length is not None and not torch.compiler.is_compiling():
            length = int(self.length)
            if length > self.max_length:
                raise RuntimeError(f"static stream overflow: {length} tokens were appended but max_length="
                                   f"{self.max_length}; tokens past the capacity were dropped. Guard the length in "
                                   f"the caller of a compiled step, or reset() the stream")
            return length
        return self._host_length

    def crop(self, n: int) -> None:
        """Keep the first ``n`` tokens (``n < 0`` drops ``-n``). Tokens of the cut block that were archived come back
        into the raw tail as their decoded values, i.e. exactly what attention read before the crop."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        length = self.get_seq_length()
        keep = length + n if n < 0 else min(n, length)
        if keep < 0:
            raise ValueError(f"cannot crop {n} tokens from a stream of {length}")
        if self.state is None or keep == length:
            return
        r = self.codec.block_size
        start = keep // r * r
        if start < self.archived_tokens:
            block = Encoded(*(t[:, :, start // r: start // r + 1] for t in self.state))
            self.tail.copy_(self.codec.decode(block, self.tail.dtype))
        self.tail[:, :, keep - start:].zero_()  # rows past the length: stale tokens would reach the memo on regrowth
        if self.memo is not None:
            self.memo[:, :, keep:].zero_()
        self.length.fill_(keep)
        self._host_length = keep

    def index_select(self, indices: torch.Tensor) -> None:
        """Reorder / select along batch (beam search): archive, scales, index, tail and memo move together.
        A static layout keeps its buffers (in-place permutation) when the batch size does not change."""
        if self.state is None:
            return
        indices = indices.to(self.tail.device)
        if self.layout == "static" and indices.shape[0] == self.tail.shape[0]:
            # Same batch size (beam reorder): permute in place so buffer addresses stay fixed (CUDA graphs).
            for t in (*self.state, self.tail, self.memo):
                if t is not None:
                    t.copy_(t.index_select(0, indices))
            return
        self.state = Encoded(*(t.index_select(0, indices) for t in self.state))
        self.tail = self.tail.index_select(0, indices)
        if self.memo is not None:
            self.memo = self.memo.index_select(0, indices)

    def repeat_interleave(self, repeats: int) -> None:
        if self.state is None:
            return
        self.state = Encoded(*(t.repeat_interleave(repeats, dim=0) for t in self.state))
        self.tail = self.tail.repeat_interleave(repeats, dim=0)
        if self.memo is not None:
            self.memo = self.memo.repeat_interleave(repeats, dim=0)

    def reset(self) -> None:
        """Forget every token, keep the allocation."""
        if self.state is None:
            return
        for t in (*self.state, self.tail, self.length):
            t.zero_()
        if self.memo is not None:
            self.memo.zero_()
        self._host_length = 0

    def release_memo(self) -> None:
        """Drop the memoized reconstruction (materialization-free decoding never reads it)."""
        self.memo, self.memoize = None, False

    def storage_bytes(self) -> int:
        """Every byte held (``storage_breakdown()["total"]``)."""
        return self.storage_breakdown()["total"]

    def storage_breakdown(self) -> dict[str, int]:
        """Every byte held, by part: ``archive`` (data), ``scales``, ``index``, ``tail`` (+ length), ``memo``, and
        ``total`` (their sum). ``archive_used`` is extra: the filled blocks' data + scales + index (the compressed
        bytes in use), not added into ``total``."""
        if self.state is None:
            return {"archive": 0, "archive_used": 0, "scales": 0, "index": 0, "tail": 0, "memo": 0, "total": 0}
        data, scale, index = self.state
        nbytes = {"archive": data.nbytes, "scales": scale.nbytes, "index": index.nbytes,
                  "tail": self.tail.nbytes + self.length.nbytes, "memo": 0 if self.memo is None else self.memo.nbytes}
        nbytes["total"] = sum(nbytes.values())
        blocks = self.get_seq_length() // self.codec.block_size
        per_block = (data.nbytes + scale.nbytes + index.nbytes) // max(1, self.capacity_blocks)
        nbytes["archive_used"] = blocks * per_block
        return nbytes


class CodecKVCache:
    """K and V streams of one attention layer. ``key_codec``/``value_codec`` may differ (same block_size).

    Instead of codec objects, the codec options build one codec for both streams (as :func:`make_codec`; options left
    at None take the codec's defaults): ``CodecKVCache(mode="jpeg", block_size=8, keep_freqs=2)``.
    """

    def __init__(self, key_codec: Codec | None = None, value_codec: Codec | None = None, layout: str = "dynamic",
                 max_length: int | None = None, memoize: bool = True, *, mode: str | None = None,
                 block_size: int | None = None, keep_freqs: int | None = None, quant_bits: int | None = None,
                 keep_ratio: float | None = None):
        options = {"block_size": block_size, "keep_freqs": keep_freqs, "quant_bits": quant_bits, "keep_ratio": keep_ratio}
        options = {name: value for name, value in options.items() if value is not None}
        if mode is not None or options:
            if key_codec is not None or value_codec is not None:
                raise ValueError("pass either codecs (key_codec / value_codec) or codec options (mode=, block_size=, "
                                 "keep_freqs=, quant_bits=, keep_ratio=), not both")
            key_codec = make_codec("jpeg" if mode is None else mode, **options)
        elif key_codec is None:
            raise TypeError("CodecKVCache needs a codec (key_codec, see make_codec) or codec options, e.g. "
                            "CodecKVCache(mode='jpeg', block_size=8, keep_freqs=8, quant_bits=8)")
        value_codec = key_codec if value_codec is None else value_codec
        if isinstance(value_codec, Codec) and isinstance(key_codec, Codec) \
                and key_codec.block_size != value_codec.block_size:
            raise ValueError(f"key and value codecs must share block_size, got {key_codec.block_size} and "
                             f"{value_codec.block_size}")
        self.keys = CodecStream(key_codec, layout, max_length, memoize)
        self.values = CodecStream(value_codec, layout, max_length, memoize)

    @property
    def layout(self) -> str:
        return self.keys.layout

    def forward(self, k_seq: torch.Tensor, v_seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill from a full sequence ``(B, H, S, D)`` (forgetting what was stored); returns the views."""
        self.reset()
        return self.decode_step(k_seq, v_seq)

    __call__ = forward

    def decode_step(self, new_k: torch.Tensor, new_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(B, H, T, D)`` keys and values; returns the materialized views (see ``CodecStream.read``)."""
        self.append(new_k, new_v)
        return self.read()

    def append(self, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        if not torch.compiler.is_compiling():
            self.keys._check_new(new_k)
            self.values._check_new(new_v)
            if new_k.shape[:3] != new_v.shape[:3]:
                raise ValueError(f"new_k and new_v must share (B, H, T), got {tuple(new_k.shape)} and {tuple(new_v.shape)}")
            self.keys._check_room(new_k.shape[2])
        self.keys.append(new_k)
        self.values.append(new_v)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.read(), self.values.read()

    def get_seq_length(self) -> int:
        return self.keys.get_seq_length()

    def crop(self, n: int) -> None:
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

    def storage_bytes(self) -> int:
        """Every byte both streams hold."""
        return self.keys.storage_bytes() + self.values.storage_bytes()

    def storage_breakdown(self) -> dict[str, int]:
        """Both streams' :meth:`CodecStream.storage_breakdown`, summed part by part."""
        k, v = self.keys.storage_breakdown(), self.values.storage_breakdown()
        return {part: k[part] + v[part] for part in k}

    def attention(self, q: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """Decode attention on the stored coefficients: see :func:`codec_decode_attention`."""
        return codec_decode_attention(q, self.keys, self.values, mask, scale)


def codec_decode_attention(q: torch.Tensor, key_stream: CodecStream, value_stream: CodecStream,
                           mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """``q (B, Hq, T, D)`` attends over both streams' stored state (archive + raw tail) without building the
    ``(S, D)`` view; returns ``(B, Hq, T, D)`` in q's dtype. GQA by grouping query heads."""
    if key_stream.state is None or value_stream.state is None:
        raise RuntimeError("codec_decode_attention needs streams that hold at least one token")
    if not torch.compiler.is_compiling() and key_stream._host_length != value_stream._host_length:
        raise ValueError(f"key and value streams must have the same length, got {key_stream._host_length} and "
                         f"{value_stream._host_length}")
    return torch.ops.flashcodec.codec_attention(
        q, *key_stream.state, key_stream.tail, *value_stream.state, value_stream.tail, key_stream.length,
        key_stream.spec, value_stream.spec, mask, scale)
