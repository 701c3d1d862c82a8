"""Trellis-coded quantization (``levels="tcq"``): an 8-state Ungerboeck trellis over each stored row of ``D`` values.

A ``b``-bit code per value, as the scalar level sets store (``pack.py``: ``b * D / 8`` bytes per row), one scale per
row. The alphabet is ``2**(b+1)`` values (:data:`ALPHABETS`: trained on unit-Gaussian rows, symmetric), split into
four subsets ``D_j = alphabet[j::4]``. Each row starts in state 0 (no side bits); from state ``s`` a code ``c``
takes the branch ``c & 1`` (which subset) and the level ``c >> 1`` within it, and the state becomes the last three
branch bits (``next = (s >> 1) | (c & 1) << 2``). So a value decodes from its own code and the low bits of the three
codes before it, with no serial state (:func:`alphabet_index`):

    a[t] = (c[t] >> 1) << 2  |  l[t-2]  |  (l[t] ^ l[t-1] ^ l[t-3]) << 1        l[t] = c[t] & 1 (0 before the row)
    value[t] = alphabet[a[t]] * scale

Encode (:func:`encode`): a Viterbi search of the least squared error path for each candidate scale, then
(``search``) the least-squares scale of the kept codes where it errs less. Every float sum is sequential over the row
(``t = 0 .. D-1``, one rounding per addition, no fused multiply-add), so a kernel reproduces the codes bitwise:

- ``rms = sqrt(sum x[t]**2 / D)`` (the root correctly rounded), candidates ``fp16_up(rms * f)`` for ``f`` in
  ``FACTORS[b]`` (``search``: two to six per bit width) or ``(1.0,)``;
- per candidate scale ``s``: the path cost is the sum of ``(x[t] - alphabet[a] * s)**2`` along the path; per step
  and per (state, branch) the nearest level of the subset (ties: the lower level), per next state the cheaper of its
  two predecessors (ties: the even one, ``2 * (n & 3)``), at the end the cheapest state (ties: the lowest); the
  candidate of least cost is kept (ties: the first);
- refit (``search``): ``num = sum l[t] * x[t]``, ``den = sum l[t]**2`` over the kept path's unscaled levels; where
  ``den > 0`` and ``num > 0`` the scale ``fp16(num / den)`` (nearest, clamped to the fp16 range) replaces the kept one
  where ``sum (l[t] * s - x[t])**2`` is below the kept path's cost.

On unit-Gaussian rows of 64 the MSE per value is 0.309 / 0.084 / 0.021 / 0.0051 at 1 / 2 / 3 / 4 bits
(results/trellis_scales.json) against 0.359 / 0.112 / 0.030 / 0.0074 for the Lloyd-Max levels with their scale
search (benchmarks/bench_trellis.py; results/trellis_probe.json).
"""

from __future__ import annotations

import functools

import torch

STATES = 8
MAX_BITS = 4
# Scale candidates (multiples of the RMS) of ``search``, per bit width: a Viterbi pass each. The first two for every
# width; 3 and 4 bits take more, where the least error over more scales pays (MSE on unit-Gaussian rows 0.97x / 0.90x
# the first two's; at 1 and 2 bits a third pass gains 1% or less): benchmarks/bench_trellis.py --scales, which chose
# them greedily from a grid on one set of rows and measured them on another (results/trellis_scales.json).
FACTORS = {1: (0.9, 1.05), 2: (0.9, 1.05), 3: (0.9, 1.05, 1.2, 0.8), 4: (0.9, 1.05, 0.825, 0.75, 0.95, 1.175)}
FACTOR_SLOTS = 8  # the kernels' table holds up to this many candidates per row

# The 2**(b+1) alphabet of b-bit codes: Lloyd iterations through the Viterbi encoder on 20,000 unit-Gaussian rows of
# 64 (scale = the RMS), symmetrized (benchmarks/trellis_probe_lib.py train_alphabet).
ALPHABETS = {
    1: (-1.180771, -0.380137, 0.380137, 1.180771),
    2: (-1.841671, -1.077732, -0.610029, -0.195187, 0.195187, 0.610029, 1.077732, 1.841671),
    3: (-2.451285, -1.803085, -1.376633, -1.066004, -0.796542, -0.558162, -0.325752, -0.11169,
        0.11169, 0.325752, 0.558162, 0.796542, 1.066004, 1.376633, 1.803085, 2.451285),
    4: (-2.973561, -2.435643, -2.07321, -1.799401, -1.574289, -1.385855, -1.217438, -1.06768,
        -0.923753, -0.791379, -0.659197, -0.536377, -0.410457, -0.294145, -0.174421, -0.058999,
        0.058999, 0.174421, 0.294145, 0.410457, 0.536377, 0.659197, 0.791379, 0.923753,
        1.06768, 1.217438, 1.385855, 1.574289, 1.799401, 2.07321, 2.435643, 2.973561),
}


def check_bits(name: str, bits: int) -> None:
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"{name}='tcq' is for 1..{MAX_BITS} bits (its alphabet has 2**(bits+1) levels), got {bits}: "
                         "use 'lloyd', 'int' or 'uniform'")


def scale_factors(bits: int, search: bool) -> tuple[float, ...]:
    """The candidate scales (multiples of the RMS) :func:`encode` tries for ``bits``-bit rows: :data:`FACTORS` with
    ``search``, else the RMS itself."""
    check_bits("levels", bits)
    return FACTORS[bits] if search else (1.0,)


def alphabet(bits: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``(2**(bits+1),)`` fp32: the unscaled alphabet of ``bits``-bit trellis codes (one copy per device)."""
    check_bits("levels", bits)
    return _on_device(bits, str(torch.device("cpu") if device is None else torch.device(device)))


@functools.lru_cache(maxsize=64)
def _on_device(bits: int, device: str) -> torch.Tensor:
    return torch.tensor(ALPHABETS[bits], dtype=torch.float32, device=device)


def subset(state: int, branch: int) -> int:
    """The subset (``0..3``) that branch ``branch`` leaves state ``state`` on."""
    return ((state >> 1) & 1) | (((branch ^ state ^ (state >> 2)) & 1) << 1)


def next_state(state: int, branch: int) -> int:
    return (state >> 1) | (branch << 2)


def alphabet_index(codes: torch.Tensor) -> torch.Tensor:
    """``codes (..., D)`` integers -> the alphabet index of each (same shape, int64): the windowed decode above."""
    codes = codes.long()
    low = codes & 1
    prev = torch.nn.functional.pad(low, (3, 0))  # prev[..., t + 3 - k] = low[..., t - k]
    d = codes.shape[-1]
    l1, l2, l3 = prev[..., 2: 2 + d], prev[..., 1: 1 + d], prev[..., :d]
    return ((codes >> 1) << 2) | l2 | ((low ^ l1 ^ l3) << 1)


def levels(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unscaled fp32 values of trellis codes ``(..., D)``."""
    return alphabet(bits, codes.device)[alphabet_index(codes)]


def _sequential_sum(terms: torch.Tensor) -> torch.Tensor:
    """``terms (N, D)`` -> ``(N,)`` fp32 sums in order ``t = 0 .. D-1`` (one rounding per addition)."""
    acc = torch.zeros(terms.shape[0], dtype=torch.float32, device=terms.device)
    for t in range(terms.shape[1]):
        acc = acc + terms[:, t]
    return acc


def viterbi(x: torch.Tensor, scale: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (N, D)`` fp32, ``scale (N,)`` fp32 -> ``(codes (N, D) int32, cost (N,) fp32)``: the least squared error
    path from state 0 (the tie rules of the module docstring)."""
    n, d = x.shape
    dev = x.device
    per = 1 << (bits - 1)  # levels per subset
    values = alphabet(bits, dev)[None, :] * scale[:, None]  # (N, 2**(b+1))
    sub = torch.tensor([[subset(s, br) for br in (0, 1)] for s in range(STATES)], device=dev)  # (8, 2)
    new = torch.arange(STATES, device=dev)
    pred_even, branch = 2 * (new & 3), new >> 2  # predecessors 2(n&3) and 2(n&3)+1, both on branch n >> 2
    cost = torch.full((n, STATES), float("inf"), device=dev)
    cost[:, 0] = 0.0
    pick_odd = torch.empty(d, n, STATES, dtype=torch.bool, device=dev)
    level_of = torch.empty(d, n, STATES, dtype=torch.int64, device=dev)
    for t in range(d):
        diff = x[:, t: t + 1] - values
        err = (diff * diff).reshape(n, per, 4)  # [.., i, j]: level i of subset j
        best, idx = err[:, 0], torch.zeros(n, 4, dtype=torch.int64, device=dev)
        for i in range(1, per):  # the nearest level of each subset (ties: the lower level)
            closer = err[:, i] < best
            best, idx = torch.where(closer, err[:, i], best), torch.where(closer, i, idx)
        e_even, e_odd = best[:, sub[pred_even, branch]], best[:, sub[pred_even + 1, branch]]
        c_even, c_odd = cost[:, pred_even] + e_even, cost[:, pred_even + 1] + e_odd
        odd = c_odd < c_even
        pick_odd[t] = odd
        level_of[t] = torch.where(odd, idx[:, sub[pred_even + 1, branch]], idx[:, sub[pred_even, branch]])
        cost = torch.where(odd, c_odd, c_even)
    final, state = cost[:, 0], torch.zeros(n, dtype=torch.int64, device=dev)
    for s in range(1, STATES):  # the cheapest end state (ties: the lowest)
        cheaper = cost[:, s] < final
        final, state = torch.where(cheaper, cost[:, s], final), torch.where(cheaper, s, state)
    codes = torch.empty(n, d, dtype=torch.int32, device=dev)
    rows = torch.arange(n, device=dev)
    for t in range(d - 1, -1, -1):
        codes[:, t] = ((level_of[t, rows, state] << 1) | (state >> 2)).to(torch.int32)
        state = 2 * (state & 3) + pick_odd[t, rows, state].long()
    return codes, final


def encode(x: torch.Tensor, bits: int, search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (..., D)`` fp32 rows -> ``(codes (..., D) int32, scale (...) fp32)``, the scale an fp16 value."""
    from .levels import rms_sqrt
    from .quant import SCALE_DTYPE, fp16_toward

    check_bits("levels", bits)
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d).float()
    rms = rms_sqrt(_sequential_sum(rows * rows) / d)
    best_codes, best_cost, best_scale = None, None, None
    for f in scale_factors(bits, search):
        scale = fp16_toward(rms * torch.tensor(f, dtype=torch.float32, device=rows.device), up=True)
        codes, cost = viterbi(rows, scale, bits)
        if best_codes is None:
            best_codes, best_cost, best_scale = codes, cost, scale
        else:
            take = cost < best_cost
            best_codes = torch.where(take[:, None], codes, best_codes)
            best_cost, best_scale = torch.where(take, cost, best_cost), torch.where(take, scale, best_scale)
    if search:
        lv = levels(best_codes, bits)
        num, den = _sequential_sum(lv * rows), _sequential_sum(lv * lv)
        ok = (den > 0) & (num > 0)
        fp16_max = torch.finfo(SCALE_DTYPE).max
        ls = torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))
        ls = ls.clamp(max=fp16_max).to(SCALE_DTYPE).float()
        diff = lv * ls[:, None] - rows
        err = _sequential_sum(diff * diff)
        best_scale = torch.where(ok & (err < best_cost), ls, best_scale)
    return best_codes.reshape(*lead, d), best_scale.reshape(lead)
