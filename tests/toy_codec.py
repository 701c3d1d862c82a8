"""A codec defined outside the package, the way a new codec is added: one class, one ``register_codec``.

``half`` keeps each token rounded to fp16 (per-token groups, no transform, no scales): the smallest stored form the
``Codec`` interface allows. The reference ops, the caches and the compile pass serve it through that interface; the
fast kernels do not know it and leave it to the reference.
"""

from __future__ import annotations

import torch

from flashcodec_fx.codecs import Codec, Encoded, register_codec
from flashcodec_fx.codecs.registry import SpecFields


@register_codec
class HalfCodec(Codec):
    """Every archived token as fp16 (``X = 1 @ S`` per one-token block)."""

    name = "half"

    def __init__(self, *, sinks: int = 0, window: int = 0):
        self.block_size, self.rows = 1, 1
        self._set_residual(sinks, window)

    def spec_fields(self) -> dict[str, str | int]:
        return {}

    @classmethod
    def from_spec_fields(cls, fields: SpecFields) -> HalfCodec:
        return cls(sinks=fields.int("sinks"), window=fields.int("window"))

    def archive_shapes(self, head_dim, stream_dtype):
        return {"data": ((1, head_dim), torch.float16), "scale": ((0,), torch.float16), "zero": ((0,), torch.float16),
                "index": ((0,), torch.uint8)}

    def synthesis(self, device=None) -> torch.Tensor:
        return torch.ones(1, 1, device=device)

    def encode_rows(self, blocks: torch.Tensor, dtype: torch.dtype) -> Encoded:
        lead = blocks.shape[:-2]
        empty = [torch.zeros(*lead, 0, dtype=t, device=blocks.device) for t in (torch.float16, torch.float16, torch.uint8)]
        return Encoded(blocks.half(), *empty)

    def stored_rows(self, enc: Encoded, head_dim: int) -> torch.Tensor:
        return enc.data.float()
