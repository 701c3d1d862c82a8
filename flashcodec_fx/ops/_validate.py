"""Shared argument checks for the ops' launchers (reference and Triton alike)."""

from __future__ import annotations

import torch

from ..codecs import Codec, codec_from_spec


def check_state(name: str, codec: Codec, data: torch.Tensor, scale: torch.Tensor, index: torch.Tensor,
                tail: torch.Tensor | None = None) -> None:
    """Check one stream's stored state against its codec: shapes as in ``codecs.Encoded``."""
    if data.dim() != 5:
        raise ValueError(f"{name}_data must be (B, H, NB, R, D), got shape {tuple(data.shape)}")
    b, h, nb, rows, d = data.shape
    if rows != codec.rows:
        raise ValueError(f"{name}_data has {rows} rows per block but the codec stores {codec.rows}")
    want_scale = (b, h, nb, codec.rows if codec.quant_bits else 0)
    if tuple(scale.shape) != want_scale or scale.dtype != torch.float32:
        raise ValueError(f"{name}_scale must be float32 of shape {want_scale}, got {scale.dtype} {tuple(scale.shape)}")
    want_index = (b, h, nb, codec.index_rows, d)
    if tuple(index.shape) != want_index or index.dtype != torch.uint8:
        raise ValueError(f"{name}_index must be uint8 of shape {want_index}, got {index.dtype} {tuple(index.shape)}")
    if tail is not None and (tail.dim() != 4 or tuple(tail.shape) != (b, h, codec.block_size, d)):
        raise ValueError(f"{name}_tail must be (B, H, r, D) = {(b, h, codec.block_size, d)}, got {tuple(tail.shape)}")


def spec_codec(name: str, spec: list[int]) -> Codec:
    try:
        return codec_from_spec(spec)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def check_length(length: torch.Tensor) -> None:
    if length.dim() != 0 or length.dtype != torch.int64:
        raise ValueError(f"length must be a 0-dim int64 tensor, got {length.dtype} of shape {tuple(length.shape)}")


def check_append_args(data: torch.Tensor, scale: torch.Tensor, index: torch.Tensor, tail: torch.Tensor,
                      length: torch.Tensor, new: torch.Tensor, spec: list[int], memo: torch.Tensor | None) -> Codec:
    """Validate ``flashcodec::append`` arguments (reference and Triton alike); returns the codec."""
    codec = spec_codec("spec", spec)
    check_state("archive", codec, data, scale, index, tail)
    check_length(length)
    if new.dim() != 4 or (new.shape[0], new.shape[1], new.shape[3]) != (tail.shape[0], tail.shape[1], tail.shape[3]) \
            or new.dtype != tail.dtype:
        raise ValueError(f"new must be (B, H, T, D) = ({tail.shape[0]}, {tail.shape[1]}, T, {tail.shape[3]}) "
                         f"in {tail.dtype}, got {new.dtype} {tuple(new.shape)}")
    b, h, _, d = tail.shape
    want = (b, h, data.shape[2] * codec.block_size, d)
    if memo is not None and (tuple(memo.shape) != want or memo.dtype != tail.dtype):
        raise ValueError(f"memo must be {tail.dtype} of shape {want}, got {memo.dtype} {tuple(memo.shape)}")
    return codec
