"""`flashcodec::encode` / `flashcodec::decode`: whole archive groups of a stream to and from their stored form."""

from __future__ import annotations

import torch

from ...codecs import Codec, Encoded
from ..state import spec_codec


def _check_mean(codec: Codec, mean: torch.Tensor | None, b: int, h: int, d: int) -> None:
    want = (b, h, d if codec.center else 0)
    if mean is not None and (tuple(mean.shape) != want or mean.dtype != torch.float32):
        raise ValueError(f"mean must be float32 of shape {want} (or None), got {mean.dtype} {tuple(mean.shape)}")


def check_archive(name: str, codec: Codec, enc, head_dim: int, dtype: torch.dtype) -> None:
    """Check ``(data, scale, zero, index)`` of ``NG`` groups against the codec's layout."""
    b, h, ng = enc[0].shape[:3] if enc[0].dim() >= 3 else (-1, -1, -1)
    for field, (shape, want_dtype), t in zip(Encoded._fields, codec.archive_shapes(head_dim, dtype).values(), enc,
                                             strict=True):
        want = (b, h, ng, *shape)
        if tuple(t.shape) != want or t.dtype != want_dtype:
            raise ValueError(f"{name}.{field} must be {want_dtype} of shape {want}, got {t.dtype} {tuple(t.shape)}")


def check_encode_args(x: torch.Tensor, spec: str, mean: torch.Tensor | None) -> Codec:
    """Validate ``flashcodec::encode`` arguments (every kernel's launcher uses this); returns the codec."""
    codec = spec_codec("spec", spec)
    if x.dim() != 4 or x.shape[2] % codec.group:
        raise ValueError(f"x must be (B, H, S, D) with S a multiple of the group ({codec.group} tokens), got "
                         f"{tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    _check_mean(codec, mean, x.shape[0], x.shape[1], x.shape[3])
    codec.check_head_dim(x.shape[3])
    return codec


def encode_reference(x: torch.Tensor, spec: str, mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor, torch.Tensor]:
    """Encode ``x (B, H, NG * G, D)`` (tokens of complete groups) into ``(data, scale, zero, index)``."""
    codec = check_encode_args(x, spec, mean)
    return tuple(t.contiguous() for t in codec.encode(x, mean))


@torch.library.custom_op("flashcodec::encode", mutates_args=())
def encode(x: torch.Tensor, spec: str, mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor, torch.Tensor]:
    """The ``flashcodec::encode`` op; its default kernel is :func:`encode_reference` (the spec)."""
    return encode_reference(x, spec, mean)


@encode.register_fake
def _(x, spec, mean=None):
    codec = spec_codec("spec", spec)
    b, h, s, d = x.shape
    ng = s // codec.group
    return tuple(x.new_empty(b, h, ng, *shape, dtype=dtype) for shape, dtype in codec.archive_shapes(d, x.dtype).values())


def check_decode_args(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, index: torch.Tensor, spec: str,
                      dtype: torch.dtype, mean: torch.Tensor | None) -> tuple[Codec, int]:
    """Validate ``flashcodec::decode`` arguments (every kernel's launcher uses this); returns the codec and head_dim."""
    codec = spec_codec("spec", spec)
    enc = Encoded(data, scale, zero, index)
    d = codec.head_dim_of(enc)
    check_archive("archive", codec, enc, d, dtype)
    _check_mean(codec, mean, data.shape[0], data.shape[1], d)
    return codec, d


def decode_reference(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, index: torch.Tensor, spec: str,
           dtype: torch.dtype, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild ``(B, H, NG * G, D)`` in ``dtype`` from stored groups."""
    codec, _ = check_decode_args(data, scale, zero, index, spec, dtype, mean)
    return codec.decode(Encoded(data, scale, zero, index), dtype, mean).contiguous()


@torch.library.custom_op("flashcodec::decode", mutates_args=())
def decode(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, index: torch.Tensor, spec: str,
           dtype: torch.dtype, mean: torch.Tensor | None = None) -> torch.Tensor:
    """The ``flashcodec::decode`` op; its default kernel is :func:`decode_reference` (the spec)."""
    return decode_reference(data, scale, zero, index, spec, dtype, mean)


@decode.register_fake
def _(data, scale, zero, index, spec, dtype, mean=None):
    codec = spec_codec("spec", spec)
    b, h, ng = data.shape[:3]
    return data.new_empty(b, h, ng * codec.group, codec.head_dim_of(Encoded(data, scale, zero, index)), dtype=dtype)


def _decode_setup_context(ctx, inputs, output):
    ctx.spec = inputs[4]
    ctx.data_dtype = inputs[0].dtype


def _decode_backward(ctx, grad):
    """Decode is linear in the stored rows: the gradient is ``A^T @ grad`` per block (unquantized, unrotated,
    uncentered, unpruned codecs)."""
    codec = spec_codec("spec", ctx.spec)
    if codec.quantizer is not None or codec.index_rows or codec.rotate is not None or codec.center:
        raise RuntimeError("flashcodec::decode is differentiable only for plain jpeg and unpruned png codecs")
    blocks = codec.blockify(grad).float()
    grad_rows = codec.synthesis(grad.device).T @ blocks
    return grad_rows.to(ctx.data_dtype), None, None, None, None, None, None


decode.register_autograd(_decode_backward, setup_context=_decode_setup_context)
