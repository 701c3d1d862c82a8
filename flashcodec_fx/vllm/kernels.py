"""Which kernel stores into and attends on vLLM pages: the fused C++ CPU kernels (``cpu/``), or the reference.

``FLASHCODEC_KERNELS`` chooses, as for the cache's ops (``flashcodec_fx.ops.cpu``): ``auto`` (default) the C++
kernels for CPU tensors, the reference after one warning when they cannot be built; ``reference`` always the
reference (the spec); ``fast`` the C++ kernels or an error. CUDA tensors run the Triton kernels (``triton/``) the
same way: ``auto`` takes the reference after one warning when triton does not import or the format exceeds the
Triton limits (``triton.common.check_paged_limits``), ``fast`` raises instead. Tensors on other devices run the
reference. The Triton kernels are tested on the interpreter and compiled for sm_90, never run on a GPU
(docs/vllm.md, "CUDA kernels").

Attention of a request with at most ``FUSED_TOKENS`` tokens in the call (decode steps, short chunks) runs in the
fused kernel, on the codes. A longer prefill chunk has many queries per page: its history is decoded once per layer
(``cpu/paged_decode.cpp``, the fused twin of ``reference.decode_pages``, fp32) and the chunk attends with torch's
CPU flash attention, history and own tokens as two calls merged by their log-sum-exp (the way vLLM's TurboQuant
backend serves long continuation chunks); the decoded rows do not outlive the call.

Tolerances against the reference (tests/vllm/test_cpu_kernels.py): the store is bitwise (raw rows copied; codes
from the reference's own rotation product and the quantizer in torch's summation order, ``launch.sum_width``);
attention outputs agree within 2e-5 in fp32 for unit-scale inputs (fp32 accumulation in another order, the scale
folded into q, a polynomial exp), and within one rounding of the output for bf16 / fp16.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..ops.cpu import kernel_mode
from ..ops.cpu.launch import KERNEL_DTYPES, sum_width
from ..ops.cpu.plan import codec_plan
from .cpu import EXTENSION
from .page import PageFormat
from .reference import attention_reference, page_view, store_reference

FUSED_TOKENS = 32  # a request's tokens in one call up to which the fused kernel serves it (else the dense path)
TRITON_DEVICE = "cuda"  # the device type whose tensors the Triton kernels serve (tests: "cpu" under TRITON_INTERPRET=1)
PAGE_FIELDS = ("anchors", "raw", "slot", "k_scale", "k_zero", "k_code", "v_scale", "v_zero", "v_code")  # page.h


def _module(*tensors: torch.Tensor):
    """The compiled kernels for these tensors, or None (the reference serves them)."""
    if any(t.device.type != "cpu" for t in tensors) or kernel_mode() == "reference":
        return None
    module = EXTENSION.module()
    if module is None and kernel_mode() == "fast":
        raise RuntimeError(f"FLASHCODEC_KERNELS=fast but the vLLM plugin's CPU kernels could not be built: "
                           f"{EXTENSION.error}")
    return module


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _triton(fmt: PageFormat, cache: torch.Tensor, *tensors: torch.Tensor):
    """The Triton kernels' package for CUDA tensors (None: the reference serves them; see the module docstring)."""
    devices = {cache.device.type, *(t.device.type for t in tensors)}
    if devices != {TRITON_DEVICE} or kernel_mode() == "reference":
        return None
    try:
        from . import triton as paged_triton

        paged_triton.check_paged_limits(fmt, cache.shape[2])
    except (ImportError, ValueError) as exc:
        if kernel_mode() == "fast":
            raise RuntimeError(f"FLASHCODEC_KERNELS=fast but the vLLM plugin's Triton kernels cannot serve this "
                               f"call: {exc}") from exc
        _warn_once(f"flashcodec vLLM plugin: the reference store / attention serves CUDA tensors ({exc})")
        return None
    return paged_triton


def build_kernels() -> None:
    """Build (or load) the C++ kernels now unless ``FLASHCODEC_KERNELS=reference``; ``fast`` raises if they cannot
    be built, ``auto`` warns once (and the reference serves)."""
    if kernel_mode() != "reference":
        _module(torch.empty(0))


@functools.lru_cache(maxsize=512)
def kernel_args(fmt: PageFormat, width: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """``(page meta, key plan, value plan)`` the C++ kernels take for ``fmt`` (plans empty for a raw format)."""
    if fmt.raw:
        return torch.tensor([fmt.anchors, 1] + [0] * (len(PAGE_FIELDS) - 2), dtype=torch.int64), [], []
    k, v = fmt.slots
    meta = [fmt.anchors, 0, fmt.code_slot_bytes, k.scale_offset, k.zero_offset, k.code_offset, v.scale_offset,
            v.zero_offset, v.code_offset]
    plans = [list(codec_plan(s.codec.spec, fmt.head_dim, width)) for s in (k, v)]
    return torch.tensor(meta, dtype=torch.int64), plans[0], plans[1]


def _check_tokens(fmt: PageFormat, cache: torch.Tensor, **rows: torch.Tensor) -> None:
    page_view(cache)
    fmt.check_page(cache.shape[2], cache.shape[3])
    for name, t in rows.items():
        if t.dim() != 3 or t.shape[2] != fmt.head_dim or t.dtype != fmt.dtype:
            raise ValueError(f"{name} must be (N, H, {fmt.head_dim}) {fmt.dtype} (the format's head_dim and dtype), "
                             f"got {t.dtype} {tuple(t.shape)}")


def paged_store(fmt: PageFormat, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Store ``key``, ``value (N, H, D)`` into ``cache`` at ``slot_mapping (N,)`` (spec: ``store_reference``)."""
    _check_tokens(fmt, cache, key=key, value=value)
    if key.shape[:2] != value.shape[:2] or key.shape[1] != cache.shape[1] or slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"key, value must be (N, H_kv={cache.shape[1]}, D) with slot_mapping (N,), got key "
                         f"{tuple(key.shape)}, value {tuple(value.shape)}, slot_mapping {tuple(slot_mapping.shape)}")
    paged_triton = _triton(fmt, cache, key, value, slot_mapping)
    if paged_triton is not None:
        paged_triton.triton_paged_store(fmt, key, value, cache, slot_mapping)
        return
    module = _module(key, value, cache) if key.dtype in KERNEL_DTYPES else None
    if module is None:
        store_reference(fmt, key, value, cache, slot_mapping)
        return
    meta, kplan, vplan = kernel_args(fmt, sum_width(module))
    module.paged_store(key, value, cache, slot_mapping.to(torch.int64).contiguous(), meta, kplan, vplan)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """torch's CPU flash attention on ``(H, L, D)`` fp32: ``(out, logsumexp)``."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[None], k[None], v[None], 0.0, causal,
                                                                          scale=scale)
    return out[0], lse[0]


def _dense_request(module, fmt: PageFormat, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                   blocks: torch.Tensor, ctx: int, scale: float, s_aux: torch.Tensor | None) -> torch.Tensor:
    """One request's attention: ``q (t, H_q, D)`` over its ``ctx`` history positions (pages ``blocks`` of ``cache``,
    decoded) and its own ``k``, ``v (t, H, D)`` (causal); ``(t, H_q, D)`` fp32."""
    t, hq, d = q.shape
    heads = k.shape[1]
    group = hq // heads
    outs, lses = [], []
    out, lse = _flash(q.float().transpose(0, 1), k.float().transpose(0, 1).repeat_interleave(group, 0),
                      v.float().transpose(0, 1).repeat_interleave(group, 0), True, scale)  # (H_q, t, .)
    outs.append(out)
    lses.append(lse)
    if ctx > 0:  # the history: no mask, the GQA heads of a KV head side by side as queries
        meta, kplan, vplan = kernel_args(fmt, sum_width(module))
        kh, vh = module.paged_decode(cache, blocks.contiguous(), ctx, d, fmt.dtype, meta, kplan, vplan)
        grouped = q.float().view(t, heads, group, d).permute(1, 0, 2, 3).reshape(heads, t * group, d)
        out, lse = _flash(grouped, kh, vh, False, scale)
        outs.append(out.view(heads, t, group, d).permute(0, 2, 1, 3).reshape(hq, t, d))
        lses.append(lse.view(heads, t, group).permute(0, 2, 1).reshape(hq, t))
    if s_aux is not None:
        lses.append(s_aux.float().view(hq, 1).expand(hq, t))
    top = torch.stack(lses).amax(0)
    weights = [torch.exp(x - top) for x in lses]
    merged = sum(w[..., None] * o for w, o in zip(weights, outs, strict=False)) / sum(weights)[..., None]
    return merged.transpose(0, 1)


def paged_attention(fmt: PageFormat, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    s_aux: torch.Tensor | None, out: torch.Tensor, max_query_len: int | None = None) -> None:
    """Attention on the pages into ``out (N, H_q, D)`` (spec: ``attention_reference``). ``max_query_len``: the
    most tokens of one request in the call when the caller knows it (vLLM's metadata does), else computed."""
    _check_tokens(fmt, cache, key=key, value=value)
    if query.dim() != 3 or query.shape[2] != fmt.head_dim or query.shape[1] % cache.shape[1] or out.shape != query.shape:
        raise ValueError(f"query must be (N, H_q, {fmt.head_dim}) with H_q a multiple of H_kv={cache.shape[1]}, and "
                         f"out its shape; got query {tuple(query.shape)}, out {tuple(out.shape)}")
    paged_triton = _triton(fmt, cache, query, key, value, out)
    if paged_triton is not None:
        paged_triton.triton_paged_attention(fmt, query, key, value, cache, block_table, seq_lens, query_start_loc,
                                            scale, s_aux, out, max_query_len)
        return
    module = _module(query, cache) if query.dtype in KERNEL_DTYPES else None
    if module is None:
        out.copy_(attention_reference(fmt, query, key, value, cache, block_table, seq_lens, query_start_loc, scale,
                                      s_aux))
        return
    meta, kplan, vplan = kernel_args(fmt, sum_width(module))
    sinks = None if s_aux is None else s_aux.float().contiguous()
    starts = query_start_loc.to(torch.int32)
    module.paged_attention(query, key, value, cache, block_table.to(torch.int32), seq_lens.to(torch.int32), starts,
                           meta, kplan, vplan, float(scale), sinks, FUSED_TOKENS, out)
    if max_query_len is None:
        max_query_len = int((starts[1:] - starts[:-1]).max()) if starts.numel() > 1 else 0
    if max_query_len <= FUSED_TOKENS:  # decode steps and short chunks: done, no host-side loop
        return
    bounds, lengths = starts.tolist(), seq_lens.tolist()
    bs = cache.shape[2]
    for r, length in enumerate(lengths):
        qs, qe = bounds[r], bounds[r + 1]
        if qe - qs <= FUSED_TOKENS:
            continue
        ctx = length - (qe - qs)
        blocks = block_table[r, : -(-ctx // bs)].long()
        out[qs:qe] = _dense_request(module, fmt, query[qs:qe], key[qs:qe], value[qs:qe], cache, blocks, ctx, scale,
                                    s_aux).to(out.dtype)
