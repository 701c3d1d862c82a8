"""Launchers of the CPU kernels: validate once per argument layout, look up the codec plans, call the C++.

Plans go to the C++ once (``plan_id``: registered, then passed by number). ``cpu_append_attention``, a decode step's
one call, keeps its per-call Python to a dict lookup: the C++ entry of each pair of specs (``module.AppendAttention``)
remembers the layouts validated here and returns None, having changed nothing, for any other call, which then takes
the slow path below it (validation, registration, or the reference).

Validation (the reference ops' own checks) depends only on the specs and the tensors' shapes and dtypes, so a layout
that passed is remembered and not checked again (``VALIDATED``, bounded: a process-wide memo of a pure check, like
``functools.cache``, module-level so that every call site shares it; it never changes a result). The kernels address
every state tensor through the strides of its first three dims and need the rest contiguous (what ``empty_state``
allocates); the C++ copies other layouts (and, for append, writes the copies back). Stream dtypes other than fp32 /
bf16 / fp16, and every call when the kernels could not be built, run the reference.
"""

from __future__ import annotations

import functools
import math

import torch

from ..reference.append import append_reference, append_stored, check_append_args
from ..reference.append_attention import append_attention_reference, check_append_attention_args
from ..reference.attention import check_attention_args, codec_attention_reference
from ..reference.normalize import attention_inputs, attention_output
from ..state import StreamState, fast_kernels_serve, spec_codec
from .build import EXTENSION
from .plan import codec_plan

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_VALIDATED = 4096


class _Validated:
    """Argument layouts (specs, shapes, dtypes) that passed validation."""

    def __init__(self, limit: int = MAX_VALIDATED):
        self._seen: set = set()
        self._limit = limit

    def check(self, key, validate) -> None:
        if key in self._seen:
            return
        validate()
        if len(self._seen) >= self._limit:
            self._seen.clear()
        self._seen.add(key)

    def clear(self) -> None:
        self._seen.clear()


VALIDATED = _Validated()
_PLAN_IDS: dict[tuple, int] = {}  # (module, spec, head_dim) -> the number register_plan gave its plan
MAX_STEPS = 4096
_STEPS: dict[tuple[str, str], tuple] = {}  # (spec_k, spec_v) -> (module, its AppendAttention for the pair)
SUM_WIDTHS = (8, 16)  # Vectorized<float> sizes of torch's CPU kernels (AVX2 / default, AVX-512)
PROBE_SHAPES = ((67, 64), (130, 24), (9, 32))  # rows and columns of every length class the encoder sums


@functools.cache
def sum_width(module) -> int:
    """The vector width whose summation order reproduces torch's own float sums on this machine (rows and columns of
    probe tensors, compared exactly), so the encoder's RMS scales and search errors round as the reference's; 8 when
    none does (then a scale may land one fp16 step away at a tie; see ``cpu_append``)."""
    gen = torch.Generator().manual_seed(0)
    probes = [torch.randn(shape, generator=gen).square() for shape in PROBE_SHAPES]
    for width in SUM_WIDTHS:
        sums = [module.sum_probe(x, width) for x in probes]
        if all(torch.equal(r, x.sum(1)) and torch.equal(c, x.sum(0)) for (r, c), x in zip(sums, probes, strict=True)):
            return width
    return SUM_WIDTHS[0]


def plan_id(module, spec: str, head_dim: int) -> int:
    """The number of ``spec``'s plan at ``head_dim`` in ``module``'s registry (registered on first use; the plan
    carries the summation width the encoder follows, which attention ignores)."""
    key = (module, spec, head_dim)
    found = _PLAN_IDS.get(key)
    if found is None:
        found = _PLAN_IDS[key] = module.register_plan(list(codec_plan(spec, head_dim, sum_width(module))))
    return found


def _layout(t: torch.Tensor | None):
    return None if t is None else (t.shape, t.dtype)


def _device(t: torch.Tensor | None):
    return None if t is None else t.device


def _state_layout(state) -> tuple:
    return tuple((t.shape, t.dtype) for t in state)


def cpu_codec_attention(q, k_state, v_state, spec_k, spec_v, k_new=None, v_new=None, mask=None, scale=None,
                        softcap=None, sinks=None, alibi=None):
    """CPU kernel of ``flashcodec::codec_attention`` (same contract as ``codec_attention_reference``, its variants
    included: the softcap, the per-query-head sink logits (as fp32) and ALiBi slopes go to the C++ as they are).

    Tolerance against the reference (tests/ops/test_cpu_attention.py): fp32 outputs within 1e-5 absolute for
    inputs of unit scale (fp32 accumulation in another order, a polynomial exp within 2 ulp, the softcap's tanh
    within a few ulp); fp16 / bf16 outputs are one rounding of that fp32 result, so within one ulp of the output
    (2**-8 / 2**-5 at magnitudes 4..8).
    """
    module = EXTENSION.module()
    if (module is None or q.dtype not in KERNEL_DTYPES or q.dim() != 4
            or not fast_kernels_serve(spec_k, spec_v, head_dim=q.shape[3], trellis=True)):  # the reference validates the rest
        return codec_attention_reference(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, scale, softcap,
                                         sinks, alibi)
    key = ("attention", spec_k, spec_v, _layout(q), _state_layout(k_state), _state_layout(v_state), _layout(k_new),
           _layout(v_new), _layout(mask), softcap, _layout(sinks), _layout(alibi), _device(sinks), _device(alibi))
    VALIDATED.check(key, lambda: check_attention_args(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask,
                                                      softcap, sinks, alibi))
    d = q.shape[3]
    softmax_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q, k_new, v_new, out_factors = attention_inputs(spec_codec("spec_k", spec_k), spec_codec("spec_v", spec_v),
                                                    StreamState(*k_state), StreamState(*v_state), q, k_new, v_new,
                                                    host=True)
    out = module.codec_attention_plans(q, k_state, v_state, plan_id(module, spec_k, d), plan_id(module, spec_v, d),
                                       k_new, v_new, mask, softmax_scale, True,
                                       0.0 if softcap is None else float(softcap), sinks, alibi)
    return attention_output(out, out_factors)


def cpu_append(state, new, spec, memo=None) -> None:
    """CPU kernel of ``flashcodec::append`` (same contract as ``append_reference``).

    Bitwise the reference's run with one BLAS thread: the products (centering, rotation, DCT; the memo's decode) run
    through the reference's own ATen expressions on its shapes, on the calling thread (a BLAS thread team for a
    decode step's few rows stalls on a busy machine; MKL rounds some small shapes differently with more threads, so
    the reference itself changes with the thread count there), and the quantizer's float sums (Lloyd RMS scales,
    search errors) follow torch's summation order (``sum_width``). Where that order is not reproduced (no probed
    width matches), an fp16 scale may land one step away at a rounding tie and a code move by one step;
    tests/ops/test_cpu_append.py measures and bounds that rate.
    """
    module = EXTENSION.module()
    if (module is None or new.dtype not in KERNEL_DTYPES or new.dim() != 4
            or not fast_kernels_serve(spec, head_dim=new.shape[3], trellis=True)):  # the reference validates the rest
        append_reference(state, new, spec, memo)
        return
    key = ("append", spec, _state_layout(state), _layout(new), _layout(memo))
    VALIDATED.check(key, lambda: check_append_args(state, new, spec, memo))
    plan, codec = plan_id(module, spec, new.shape[3]), spec_codec("spec", spec)
    append_stored(codec, StreamState(*state), new, memo,
                  lambda stored, kept: module.append_plan(state, stored, plan, kept), host=True)


def cpu_append_attention(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask=None, scale=None, softcap=None,
                         sinks=None, alibi=None):
    """CPU kernel of ``flashcodec::append_attention`` (same contract as ``append_attention_reference``): one call into
    the C++ (``fused.cpp``) for both appends and the attention. The stream states are bitwise those of ``cpu_append``
    twice, the output bitwise that of ``cpu_codec_attention`` after them (so within its tolerance of the reference).

    A layout the C++ entry of the pair knows runs no Python besides this lookup; anything else (a first call, a new
    layout, an invalid argument, the append that measures a normalized stream's channel exponents, a codec or dtype
    the kernels do not serve) goes through :func:`_append_attention_checked`."""
    entry = _STEPS.get((spec_k, spec_v))
    if entry is not None and entry[0] is EXTENSION.loaded:
        try:
            out = entry[1](q, k_state, v_state, k_new, v_new, mask, scale, softcap, sinks, alibi)
        except TypeError:  # an argument of another type than the schema's (a direct call): the checks name it
            out = None
        if out is not None:
            return out
    return _append_attention_checked(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, scale, softcap, sinks,
                                     alibi)


def _append_attention_checked(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, scale, softcap, sinks, alibi):
    """The checks (nothing changes before they pass), then the layout admitted to the pair's C++ entry and the step
    run there; the measuring append as the separate kernels; the reference where the kernels do not serve."""
    module = EXTENSION.module()
    if (module is None or not isinstance(q, torch.Tensor) or q.dtype not in KERNEL_DTYPES or q.dim() != 4
            or not fast_kernels_serve(spec_k, spec_v, head_dim=q.shape[3], trellis=True)):  # the reference validates the rest
        return append_attention_reference(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, scale, softcap,
                                          sinks, alibi)
    check_append_attention_args(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, softcap, sinks, alibi)
    entry = _STEPS.get((spec_k, spec_v))
    if entry is None or entry[0] is not module:
        if len(_STEPS) >= MAX_STEPS:
            _STEPS.clear()
        entry = _STEPS[(spec_k, spec_v)] = (module, module.AppendAttention())
    d = q.shape[3]
    entry[1].admit(q, k_state, v_state, k_new, v_new, mask, sinks, alibi, plan_id(module, spec_k, d),
                   plan_id(module, spec_v, d))
    out = entry[1](q, k_state, v_state, k_new, v_new, mask, scale, softcap, sinks, alibi)
    if out is not None:
        return out
    cpu_append(k_state, k_new, spec_k)  # a normalized stream's first append past its sinks: it measures
    cpu_append(v_state, v_new, spec_v)
    return cpu_codec_attention(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, scale, softcap, sinks, alibi)
