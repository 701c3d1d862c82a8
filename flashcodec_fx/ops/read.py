"""`flashcodec::read`: the materialized view of a stream (archive decoded + raw tail), zeros past length."""

from __future__ import annotations

import torch

from ..codecs import Encoded
from ._validate import check_length, check_state, spec_codec


@torch.library.custom_op("flashcodec::read", mutates_args=())
def read(data: torch.Tensor, scale: torch.Tensor, index: torch.Tensor, tail: torch.Tensor, length: torch.Tensor,
         spec: list[int]) -> torch.Tensor:
    """``(B, H, NB * r, D)`` in the tail's dtype: decoded archive, then the open block's raw rows.

    This is the full-precision view that the compile pass removes: attention over it equals
    ``flashcodec::codec_attention`` over the stored state.
    """
    codec = spec_codec("spec", spec)
    check_state("archive", codec, data, scale, index, tail)
    check_length(length)
    r = codec.block_size
    b, h, nb, _, d = data.shape
    out = codec.decode(Encoded(data, scale, index), tail.dtype)
    pos = torch.arange(nb * r, device=data.device)
    start = torch.div(length, r, rounding_mode="floor") * r
    in_tail = (pos >= start) & (pos < length)
    tail_rows = tail.index_select(2, (pos - start).clamp(0, r - 1))
    out = torch.where(in_tail[:, None], tail_rows, out)
    return torch.where((pos < length)[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


@read.register_fake
def _(data, scale, index, tail, length, spec):
    b, h, nb, _, d = data.shape
    return tail.new_empty(b, h, nb * tail.shape[2], d)
