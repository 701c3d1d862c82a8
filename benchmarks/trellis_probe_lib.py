"""Plain-torch trellis quantizers for ``bench_trellis.py`` (a probe: issue 42), no package code.

A trellis here is a table ``table (S, C)`` (the unscaled value of code ``c`` from state ``s``) and ``next (S, C)`` (the
state after it): ``S`` states, ``C = 2**b`` codes per value, every row starts in state 0 (no side bits).

- ``ungerboeck(b)``: 8-state TCQ; the alphabet is ``alpha`` times the ``(b + 1)``-bit Lloyd-Max levels, split into
  four subsets ``D_j = levels[j::4]``; a code's low bit picks the branch, its other ``b - 1`` bits the level in the
  branch's subset; the state is a shift register of the last three branch bits (``next = (s >> 1) | bit << 2``), so
  a value decodes from its own code and the low bits of the three codes before it.
- ``bitshift(b, m)``: QTIP-style; the state is the last ``m`` bits of the code stream (``next = ((s << b) | c) mod
  2**m``), each value ``table[(s << b) | c]`` a free table of ``2**(m + b)`` entries trained on Gaussian rows (Lloyd
  iterations through the Viterbi encoder).
"""

from __future__ import annotations

import torch

from flashcodec_fx.codecs.levels import level_table
from flashcodec_fx.codecs.quant import fp16_toward

# 8-state Ungerboeck trellis: subset of (state, branch bit); states 0, 1, 4, 5 leave on D0 / D2, the others on D1 / D3
UNGERBOECK_SUBSET = ((0, 2), (2, 0), (1, 3), (3, 1), (2, 0), (0, 2), (3, 1), (1, 3))


class Trellis:
    def __init__(self, table: torch.Tensor, nxt: torch.Tensor, name: str):
        self.table, self.next, self.name = table.float(), nxt.long(), name
        s, c = table.shape
        self.states, self.codes = s, c
        flat = torch.arange(s * c)
        order = torch.argsort(self.next.flatten(), stable=True)
        counts = torch.bincount(self.next.flatten(), minlength=s)
        if not bool((counts == counts[0]).all()):
            raise ValueError("every state needs the same number of incoming edges")
        self.incoming = flat[order].reshape(s, -1)  # (S, E) flat (s, c) edges into each state

    def with_table(self, table: torch.Tensor) -> Trellis:
        return Trellis(table, self.next, self.name)


def ungerboeck(bits: int, alpha: float = 1.0) -> Trellis:
    alphabet = level_table("lloyd", bits + 1) * alpha
    table = torch.empty(8, 1 << bits)
    nxt = torch.empty(8, 1 << bits, dtype=torch.long)
    for s in range(8):
        for c in range(1 << bits):
            branch, idx = c & 1, c >> 1
            table[s, c] = alphabet[UNGERBOECK_SUBSET[s][branch] + 4 * idx]
            nxt[s, c] = (s >> 1) | (branch << 2)
    return Trellis(table, nxt, f"ungerboeck8-{bits}")


def bitshift(bits: int, memory: int, seed: int = 0) -> Trellis:
    s, c = 1 << memory, 1 << bits
    idx = torch.arange(s * c).reshape(s, c)
    nxt = ((torch.arange(s)[:, None] << bits) | torch.arange(c)[None, :]) & (s - 1)
    # initial table: Gaussian quantiles of the (b + 2)-bit grid, spread pseudo-randomly over the entries
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randperm(s * c, generator=gen).float() + 0.5) / (s * c)
    table = (2 ** 0.5) * torch.erfinv(2 * q - 1)
    return Trellis(table[idx], nxt, f"bitshift{s}-{bits}")


def viterbi(x: torch.Tensor, scale: torch.Tensor, tr: Trellis) -> torch.Tensor:
    """``x (N, T)``, ``scale (N, 1)`` -> codes ``(N, T)`` int64 of the least squared error path from state 0."""
    n, t = x.shape
    s, c = tr.states, tr.codes
    inf = torch.tensor(float("inf"))
    cost = torch.full((n, s), float("inf"))
    cost[:, 0] = 0
    values = tr.table.flatten()[None, :] * scale  # (N, S*C)
    back = torch.empty(n, t, s, dtype=torch.uint8 if s * c <= 256 else torch.int16)
    for i in range(t):
        cand = (cost[:, :, None] + torch.zeros(1, 1, c)).flatten(1) + (x[:, i: i + 1] - values) ** 2
        into = cand[:, tr.incoming]  # (N, S, E)
        best, arg = into.min(-1)
        back[:, i] = arg.to(back.dtype)
        cost = torch.where(torch.isnan(best), inf, best)
    state = cost.argmin(-1)
    codes = torch.empty(n, t, dtype=torch.long)
    rows = torch.arange(n)
    for i in range(t - 1, -1, -1):
        edge = tr.incoming[state, back[rows, i, state].long()]
        codes[:, i] = edge % c
        state = edge // c
    return codes


def decode(codes: torch.Tensor, tr: Trellis) -> torch.Tensor:
    """Unscaled values of ``codes (N, T)`` from state 0."""
    n, t = codes.shape
    state = torch.zeros(n, dtype=torch.long)
    out = torch.empty(n, t)
    for i in range(t):
        out[:, i] = tr.table[state, codes[:, i]]
        state = tr.next[state, codes[:, i]]
    return out


def quantize(x: torch.Tensor, tr: Trellis, factors: tuple[float, ...], refit: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (N, T)`` -> ``(reconstruction, codes)``: scale candidates ``factor * rms`` (fp16, rounded up), one Viterbi
    each, the least error kept; then (``refit``) the least-squares scale of the kept codes, where it errs less."""
    rms = x.square().mean(-1, keepdim=True).double().sqrt().float()
    best_err, best_rec, best_codes = None, None, None
    for f in factors:
        scale = fp16_toward(rms * f, up=True)
        codes = viterbi(x, scale, tr)
        lv = decode(codes, tr)
        rec = lv * scale
        err = (rec - x).square().sum(-1, keepdim=True)
        if refit:
            ls = (lv * x).sum(-1, keepdim=True) / lv.square().sum(-1, keepdim=True).clamp_min(1e-30)
            ls = ls.clamp_min(0).to(torch.float16).float()
            rec_ls = lv * ls
            err_ls = (rec_ls - x).square().sum(-1, keepdim=True)
            take = err_ls < err
            rec, err = torch.where(take, rec_ls, rec), torch.where(take, err_ls, err)
        if best_err is None:
            best_err, best_rec, best_codes = err, rec, codes
        else:
            take = err < best_err
            best_err = torch.where(take, err, best_err)
            best_rec = torch.where(take, rec, best_rec)
            best_codes = torch.where(take, codes, best_codes)
    return best_rec, best_codes


def train_table(tr: Trellis, bits: int, rows: int = 4000, dim: int = 64, iterations: int = 12, seed: int = 1,
                factors: tuple[float, ...] = (1.0,)) -> Trellis:
    """Lloyd iterations of the table on unit-Gaussian rows (each entry: the mean of ``x / scale`` coded with it)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen)
    for _ in range(iterations):
        rms = x.square().mean(-1, keepdim=True).sqrt()
        scale = rms * factors[0]
        codes = viterbi(x, scale, tr)
        state = torch.zeros(rows, dtype=torch.long)
        idx = torch.empty(rows, dim, dtype=torch.long)
        for i in range(dim):
            idx[:, i] = state * tr.codes + codes[:, i]
            state = tr.next[state, codes[:, i]]
        y = (x / scale).flatten()
        sums = torch.zeros(tr.states * tr.codes).index_add_(0, idx.flatten(), y)
        counts = torch.bincount(idx.flatten(), minlength=tr.states * tr.codes).float()
        table = torch.where(counts > 0, sums / counts.clamp_min(1), tr.table.flatten())
        tr = tr.with_table(table.reshape(tr.states, tr.codes))
    return tr


def alphabet_index(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Index into the ``(b+1)``-bit alphabet of each code of ``codes (N, T)`` under :func:`ungerboeck`'s trellis, from
    the code and the low bits of the three before it: ``(c >> 1) << 2 | lsb[t-2] | (lsb[t] ^ lsb[t-1] ^ lsb[t-3]) << 1``
    (the state is the last three branch bits, so no serial decode)."""
    lsb = codes & 1
    pad = torch.zeros(codes.shape[0], 3, dtype=codes.dtype)
    prev = torch.cat([pad, lsb], 1)  # prev[:, t + 3 - k] = lsb[t - k]
    t = codes.shape[1]
    l1, l2, l3 = prev[:, 2: 2 + t], prev[:, 1: 1 + t], prev[:, :t]
    return ((codes >> 1) << 2) | l2 | ((lsb ^ l1 ^ l3) << 1)


def train_alphabet(bits: int, rows: int = 20000, dim: int = 64, iterations: int = 12, seed: int = 1) -> torch.Tensor:
    """The ``2**(b+1)`` alphabet of :func:`ungerboeck`'s trellis trained on unit-Gaussian rows (scale = the RMS; Lloyd
    iterations through the Viterbi encoder, each value the mean of the ``x / scale`` coded with it), symmetrized."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen)
    scale = x.square().mean(-1, keepdim=True).sqrt()
    alpha = level_table("lloyd", bits + 1) * 0.9
    base = ungerboeck(bits)
    idx_table = torch.tensor([[UNGERBOECK_SUBSET[s][c & 1] + 4 * (c >> 1) for c in range(1 << bits)] for s in range(8)])
    for _ in range(iterations):
        tr = Trellis(alpha[idx_table], base.next, "alphabet")
        codes = viterbi(x, scale, tr)
        amap = alphabet_index(codes, bits)
        n = alpha.numel()
        sums = torch.zeros(n).index_add_(0, amap.flatten(), (x / scale).flatten())
        counts = torch.bincount(amap.flatten(), minlength=n).float()
        alpha = torch.where(counts > 0, sums / counts.clamp_min(1), alpha)
    return (alpha - alpha.flip(0)) / 2
