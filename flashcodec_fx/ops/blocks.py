"""`flashcodec::encode` / `flashcodec::decode`: whole blocks of a stream to and from their stored form."""

from __future__ import annotations

import torch

from ..codecs import Encoded
from ._validate import check_state, spec_codec


@torch.library.custom_op("flashcodec::encode", mutates_args=())
def encode(x: torch.Tensor, spec: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode ``x (B, H, NB * r, D)`` into ``(data, scale, index)`` as in ``codecs.Encoded``."""
    codec = spec_codec("spec", spec)
    if x.dim() != 4 or x.shape[2] % codec.block_size:
        raise ValueError(f"x must be (B, H, S, D) with S a multiple of block_size={codec.block_size}, got {tuple(x.shape)}")
    return tuple(t.contiguous() for t in codec.encode(x))


@encode.register_fake
def _(x, spec):
    codec = spec_codec("spec", spec)
    b, h, s, d = x.shape
    nb = s // codec.block_size
    return (
        x.new_empty(b, h, nb, codec.rows, d, dtype=codec.storage_dtype(x.dtype)),
        x.new_empty(b, h, nb, codec.rows if codec.quant_bits else 0, dtype=torch.float32),
        x.new_empty(b, h, nb, codec.index_rows, d, dtype=torch.uint8),
    )


@torch.library.custom_op("flashcodec::decode", mutates_args=())
def decode(data: torch.Tensor, scale: torch.Tensor, index: torch.Tensor, spec: list[int],
           dtype: torch.dtype) -> torch.Tensor:
    """Rebuild ``(B, H, NB * r, D)`` in ``dtype`` from stored blocks."""
    codec = spec_codec("spec", spec)
    check_state("state", codec, data, scale, index)
    return codec.decode(Encoded(data, scale, index), dtype).contiguous()


@decode.register_fake
def _(data, scale, index, spec, dtype):
    codec = spec_codec("spec", spec)
    b, h, nb, _, d = data.shape
    return data.new_empty(b, h, nb * codec.block_size, d, dtype=dtype)


def _decode_setup_context(ctx, inputs, output):
    ctx.spec = inputs[3]
    ctx.data_dtype = inputs[0].dtype


def _decode_backward(ctx, grad):
    """Decode is linear in the stored rows: the gradient is ``A^T @ grad`` per block (unquantized codecs)."""
    codec = spec_codec("spec", ctx.spec)
    if codec.quant_bits or codec.index_rows:
        raise RuntimeError("flashcodec::decode is differentiable only for unquantized, unpruned codecs")
    blocks = codec.blockify(grad).float()
    grad_rows = codec.synthesis(grad.device).T @ blocks
    return grad_rows.to(ctx.data_dtype), None, None, None, None


decode.register_autograd(_decode_backward, setup_context=_decode_setup_context)
