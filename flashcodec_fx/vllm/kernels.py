"""Which kernel stores into and attends on vLLM pages: the fused C++ CPU kernels (``cpu/``), or the reference.

``FLASHCODEC_KERNELS`` chooses, as for the cache's ops (``flashcodec_fx.ops.cpu``): ``auto`` (default) the C++
kernels for CPU tensors, the reference after one warning when they cannot be built; ``reference`` always the
reference (the spec); ``fast`` the C++ kernels or an error. CUDA tensors run the Triton kernels (``triton/``) the
same way: ``auto`` takes the reference after one warning when triton does not import or the format exceeds the
Triton limits (``triton.page_form.check_paged_limits``), ``fast`` raises instead. Tensors on other devices run the
reference. The Triton kernels are tested on the interpreter and compiled for sm_90, never run on a GPU
(docs/vllm.md, "CUDA kernels").

Attention of a request with at most ``FUSED_TOKENS`` tokens in the call (decode steps, short chunks) runs in the
per-token kernel (``cpu/paged_attention.cpp``), on the codes. A longer prefill chunk has many queries per page: it
runs in ``cpu/paged_prefill.cpp``, its own tokens (raw, causal) and its history (each page decoded once per call
into a per-thread scratch of a few pages, every query row against it) as GEMM-shaped tiles, the two merged by their
softmax states. That kernel needs a head_dim that is a multiple of ``PREFILL_DIM_MULTIPLE``; other head dims run
every request in the per-token kernel.

Tolerances against the reference (tests/vllm/test_cpu_kernels.py): the store is bitwise (raw rows copied; codes
from the reference's own rotation product and the quantizer in torch's summation order, ``launch.sum_width``;
trellis codes from the C++ Viterbi encoder, whose sums are sequential as the reference's);
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
from .page import PageFormat, StorePlan, store_plan
from .reference import attention_reference, page_view, store_reference

FUSED_TOKENS = 32  # a request's tokens in one call up to which the per-token kernel serves it (else the tiled one)
PREFILL_DIM_MULTIPLE = 16  # the tiled prefill kernel's head_dim granularity (one SIMD vector of fp32)
TRITON_DEVICE = "cuda"  # the device type whose tensors the Triton kernels serve (tests: "cpu" under TRITON_INTERPRET=1)


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
    """``(page meta, key plan, value plan)`` the C++ kernels take for ``fmt``: its fields by name
    (``PageFormat.meta``, cpu/page.h's ``PageField``), the streams' plans (empty for a raw format)."""
    meta = torch.tensor(list(fmt.meta().values()), dtype=torch.int64)
    if fmt.raw:
        return meta, [], []
    plans = [list(codec_plan(s.codec.spec, fmt.head_dim, width)) for s in fmt.slots]
    return meta, plans[0], plans[1]


def _check_tokens(fmt: PageFormat, cache: torch.Tensor, **rows: torch.Tensor) -> None:
    page_view(cache)
    fmt.check_page(cache.shape[2], cache.shape[3])
    for name, t in rows.items():
        if t.dim() != 3 or t.shape[2] != fmt.head_dim or t.dtype != fmt.dtype:
            raise ValueError(f"{name} must be (N, H, {fmt.head_dim}) {fmt.dtype} (the format's head_dim and dtype), "
                             f"got {t.dtype} {tuple(t.shape)}")


def paged_store(fmt: PageFormat, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, phase: str = "store", plan: StorePlan | None = None) -> None:
    """Store this call's ``key``, ``value (N, H, D)`` into ``cache`` at ``slot_mapping (N,)``, the part of
    ``phase`` (``store`` before attention, ``ring`` after it; spec: ``store_reference``). ``plan``: this call's
    ``page.store_plan`` when the caller has it (the vLLM impl computes it once per step), else computed here."""
    _check_tokens(fmt, cache, key=key, value=value)
    if key.shape[:2] != value.shape[:2] or key.shape[1] != cache.shape[1] or slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"key, value must be (N, H_kv={cache.shape[1]}, D) with slot_mapping (N,), got key "
                         f"{tuple(key.shape)}, value {tuple(value.shape)}, slot_mapping {tuple(slot_mapping.shape)}")
    paged_triton = _triton(fmt, cache, key, value, slot_mapping)
    module = None if paged_triton is not None else _module(key, value, cache) if key.dtype in KERNEL_DTYPES else None
    if paged_triton is None and module is None:
        store_reference(fmt, key, value, cache, slot_mapping, block_table, seq_lens, query_start_loc, phase)
        return
    if plan is None:
        plan = store_plan(fmt, cache.shape[2], slot_mapping, block_table, seq_lens, query_start_loc, phase)
    if paged_triton is not None:
        paged_triton.triton_paged_store(fmt, key, value, cache, slot_mapping, plan)
        return
    meta, kplan, vplan = kernel_args(fmt, sum_width(module))
    module.paged_store(key, value, cache, slot_mapping.to(torch.int64).contiguous(), *plan, meta, kplan, vplan)


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
    args = (query, key, value, cache, block_table.to(torch.int32), seq_lens.to(torch.int32),
            query_start_loc.to(torch.int32), meta, kplan, vplan, float(scale), sinks)
    tiled = fmt.head_dim % PREFILL_DIM_MULTIPLE == 0
    module.paged_attention(*args, FUSED_TOKENS if tiled else query.shape[0], out)
    if not tiled:
        return
    if max_query_len is None:
        starts = args[6]
        max_query_len = int((starts[1:] - starts[:-1]).max()) if starts.numel() > 1 else 0
    if max_query_len > FUSED_TOKENS:  # long prefill chunks: own tokens and history apart, merged
        module.paged_prefill(*args, FUSED_TOKENS, out)
