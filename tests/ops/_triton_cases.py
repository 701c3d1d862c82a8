"""Shared builders for the Triton kernel tests: stored forms, stream states made by the reference ops, on any device."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from flashcodec_fx.codecs import Codec, Encoded, PNGCodec, make_codec  # noqa: E402
from flashcodec_fx.ops import empty_state  # noqa: E402
from flashcodec_fx.ops.reference.append import append_reference  # noqa: E402
from flashcodec_fx.presets import preset_codecs as _preset_codecs  # noqa: E402

# Triton kernels need a GPU or the interpreter; the README's test command sets TRITON_INTERPRET=1.
DEVICES = ["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []
if torch.cuda.is_available():
    DEVICES.append("cuda")
if not DEVICES:
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)


def _jpeg(**options) -> tuple[str, dict]:
    return "jpeg", options


# (name -> codec options): every stored form the kernels read, small groups to keep the interpreter fast.
FORMS = {
    "jpeg_k8": _jpeg(block_size=8),
    "jpeg_k3": _jpeg(block_size=8, keep_freqs=3),
    "png": ("png", {"block_size": 8}),
    "png_pruned": ("png", {"block_size": 8, "keep_ratio": 0.5}),
    "int8": _jpeg(block_size=8, quant_bits=8),  # the int8 tier: uint8 codes, int levels, fp16 scale per (block, row)
    "uniform4": _jpeg(block_size=8, quant_bits=4, levels="uniform"),  # token axis with zero points
    "mixed_bits": _jpeg(block_size=4, quant_bits=(7, 6, 5, 8), levels="int"),  # every slice width
    "lloyd_rot": _jpeg(block_size=1, quant_bits=2, levels="lloyd", rotate=True, center=True, scale_search=True,
                       sinks=4, window=8),  # TurboQuant-style values: rotated, centered, per token
    "lloyd_uniform": _jpeg(block_size=2, quant_bits=(6, 3), levels=("lloyd", "uniform"), rotate=3),
    "dct_channel": _jpeg(block_size=8, quant_bits=(5, 3, 3, 2, 2, 2, 2, 2), levels=("uniform", "midrise"),
                         scale_axis="channel", group=64, rotate=True, sinks=4),  # 3-bit keys: the fold path
    "channel_v": _jpeg(block_size=8, quant_bits=(4, 2, 2, 2, 2, 2, 2, 2), levels=("uniform", "int"),
                       scale_axis="channel", group=64, sinks=4, window=3),
    "token_channel": _jpeg(block_size=1, quant_bits=4, levels="uniform", scale_axis="channel", group=16, sinks=4),
    "channel_unfolded": _jpeg(block_size=8, quant_bits=(3, 2, 2, 1, 1, 1, 1, 1), levels=("int", "midrise"),
                              scale_axis="channel", group=8, sinks=3),  # group = one block: dequantized in registers
    "midrise_offset": _jpeg(block_size=4, quant_bits=3, levels="midrise", scale_axis="channel", group=8, sinks=1,
                            window=5),  # other sinks: value blocks at an offset in the tiles, groups unaligned
    "jpeg_r6": _jpeg(block_size=6, quant_bits=3),
    "token_r4": _jpeg(block_size=4, quant_bits=3, sinks=1, window=2),
}

# Trellis codes (levels="tcq", 1..4 bits, codecs/trellis.py): read by the attention, decode and read kernels; the
# Triton append and encode do not write them (no Viterbi encoder in Triton), so the reference makes their states.
TRELLIS_FORMS = {
    **{f"tcq{b}": _jpeg(block_size=1, quant_bits=b, levels="tcq", rotate=True, center=b % 2 == 1, scale_search=True,
                        sinks=2, window=4) for b in (1, 2, 3, 4)},  # per token, rotated, centered at odd bits
    "tcq_table": _jpeg(block_size=4, quant_bits=(4, 3, 2, 1), levels="tcq", scale_search=True),  # one trellis per
    # DCT row: every slice width, the low bit of a 3-bit code in its 2-bit slice
}


def dtypes(device: str) -> list[torch.dtype]:
    """The interpreter has no bf16; CUDA runs all three."""
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


def form(name: str) -> Codec:
    mode, opts = FORMS[name] if name in FORMS else TRELLIS_FORMS[name]
    return make_codec(mode, **opts)


def preset_codecs(name: str) -> tuple[Codec, Codec]:
    """(key, value) codecs of preset ``name`` as layer 1 gets them (``rotate=True`` seeds 1)."""
    return _preset_codecs(name, layer_idx=1)


def smooth(b: int, h: int, s: int, d: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """A correlated random walk along seq (like real keys), unit scale."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, s, d, generator=gen).cumsum(2) * 0.3 + torch.randn(b, h, 1, d, generator=gen)
    return x.to(dtype).to(device)


def groups_for(codec: Codec, length: int, spare: int = 1) -> int:
    """Archive groups for ``length`` positions plus ``spare`` (static capacity beyond the length)."""
    return max(0, -(-(length - codec.sinks) // codec.group)) + spare


def stored_state(codec: Codec, x: torch.Tensor, groups: int, chunks: list[int] | None = None) -> list[torch.Tensor]:
    """Reference state of stream ``x (B, H, L, D)`` in an archive of ``groups``: a prefill, then the ``chunks``
    (default: three single tokens)."""
    b, h, length, d = x.shape
    state = list(empty_state(codec, b, h, groups, d, x.dtype, x.device))
    chunks = chunks if chunks is not None else [1] * min(3, length - 1)
    pos = 0
    for n in [length - sum(chunks), *chunks]:
        append_reference(state, x[:, :, pos: pos + n].contiguous(), codec.spec)
        pos += n
    return state


def same_archive(codec: Codec, got, want, d: int, dtype: torch.dtype) -> None:
    """Two stored forms ``(data, scale, zero, index)`` of the same groups agree as two group encodes may: quantized
    codes in >= 99% of places, scales likewise (a code may land one step apart where an fp32 sum in another order
    hits a rounding tie, and the clipping search may pick another factor where two errors tie), every dense stored
    row within one quantization step; float rows within a rounding of the stream dtype (png deltas exactly; pruned
    png: its kept deltas compared as sorted magnitudes, since equal magnitudes may keep another position)."""
    rows_got = codec.stored_rows(Encoded(*got[:4]), d)
    rows_want = codec.stored_rows(Encoded(*want[:4]), d)
    q = codec.quantizer
    if q is None:
        tol = 0.0 if isinstance(codec, PNGCodec) else {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        if codec.index_rows:  # pruned png: kept deltas in another order; equal magnitudes may keep another position
            torch.testing.assert_close(rows_got.abs().sort(-2).values, rows_want.abs().sort(-2).values, atol=tol,
                                       rtol=tol)
        else:
            torch.testing.assert_close(rows_got, rows_want, atol=tol, rtol=tol)
        return
    codes_equal = (q.codes(got[0], d) == q.codes(want[0], d)).float().mean()
    assert codes_equal >= 0.99, f"only {float(codes_equal):.3f} of the codes agree"
    assert (got[1] == want[1]).float().mean() >= 0.99
    step = float(want[1].float().abs().amax()) * 2.0 ** -1  # half the widest step, times the widest level gap below
    gap = max(float((q.level_rows()[:, 1:] - q.level_rows()[:, :-1]).abs().max()), 1.0)
    torch.testing.assert_close(rows_got, rows_want, atol=2 * step * gap, rtol=1e-5)


def to(device: str, *tensors):
    """Copies on ``device`` (references are always computed on CPU)."""
    return tuple(t.to(device) for t in tensors)
