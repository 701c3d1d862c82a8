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
