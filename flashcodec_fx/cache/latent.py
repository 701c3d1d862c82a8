"""`LatentKVCache`: one stream that is both the keys and the values of a layer: multi-head latent attention (MLA:
DeepSeek-V2/V3, Kimi, MiniCPM3, ...) caches one row per token, the latent ``c`` (``kv_lora_rank`` channels) and the
shared rotary key ``k_rot`` (``qk_rope_head_dim``), and attends in the absorbed form:

    scores = [W_UK^T q_nope ; q_rot] . [c ; k_rot]          out = W_UV (sum_t p_t c_t)

so the stored row ``[c ; k_rot]`` is the key of every head and its first ``kv_lora_rank`` channels their value
(``flashcodec::codec_attention`` with the same state as keys and values; the output's first channels are kept).
"""

from __future__ import annotations

import torch

from ..codecs import Codec
from .kv_cache import CodecKVCache
from .stream import CodecStream


class LatentKVCache(CodecKVCache):
    """One stream serving as keys and values (``.keys is .values``): every method of :class:`CodecKVCache` acts on
    it once. ``append(latent, rope)`` stores the concatenated row ``(B, 1, T, latent_width + rope_width)``."""

    def __init__(self, codec: Codec, latent_width: int, rope_width: int, layout: str = "dynamic",
                 max_length: int | None = None, memoize: bool = False, crop: str = "decode"):
        positions = None
        if layout == "static" and isinstance(max_length, int):
            positions = codec.sinks + -(-max(0, max_length - codec.sinks) // codec.group) * codec.group
        self.keys = self.values = CodecStream(codec, layout, max_length, memoize, crop, positions)
        self.latent_width, self.rope_width = latent_width, rope_width

    def row(self, latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """The stored row ``[latent ; rope]`` of ``(B, 1, T, latent_width)`` and ``(B, 1, T, rope_width)`` tokens."""
        return torch.cat([latent, rope], dim=-1)

    def split(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(latent, rope)`` of stored rows ``(..., latent_width + rope_width)``."""
        return row[..., : self.latent_width], row[..., self.latent_width:]

    def check_new(self, latent: torch.Tensor, rope: torch.Tensor, same_head_dim: bool = False) -> None:
        for name, x, width in (("latent", latent, self.latent_width), ("rope key", rope, self.rope_width)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != 1 or x.shape[3] != width:
                raise ValueError(f"an MLA layer stores the {name} as (B, 1, T, {width}), got "
                                 f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if latent.shape[:3] != rope.shape[:3] or latent.dtype != rope.dtype:
            raise ValueError(f"the latent and the rope key must share (B, 1, T) and dtype, got {tuple(latent.shape)} "
                             f"{latent.dtype} and {tuple(rope.shape)} {rope.dtype}")
        self.keys.check_new(self.row(latent, rope))

    def append(self, latent: torch.Tensor, rope: torch.Tensor) -> None:
        if not torch.compiler.is_compiling():
            self.check_new(latent, rope)
        self.keys.append(self.row(latent, rope), checked=True)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.keys.read())

    def crop(self, n: int) -> None:
        self.keys.crop(n)

    def index_select(self, indices: torch.Tensor) -> None:
        self.keys.index_select(indices)

    reorder = index_select

    def repeat_interleave(self, repeats: int) -> None:
        self.keys.repeat_interleave(repeats)

    def reset(self) -> None:
        self.keys.reset()

    def release_memo(self) -> None:
        self.keys.release_memo()

    def storage_breakdown(self) -> dict[str, int]:
        return self.keys.storage_breakdown()

    def storage_bytes(self) -> int:
        return self.keys.storage_bytes()

    def bits_per_value(self) -> float:
        """Stored bits per cached value: the row's channels, each stored once."""
        tail = self.keys.tail
        n = 0 if tail is None else tail.shape[0] * tail.shape[1] * tail.shape[3] * self.get_seq_length()
        return self.keys.stored_bits() / max(1, n)
