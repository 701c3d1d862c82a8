"""The stored domain of a normalized stream (``normalize=True``, ``codecs/channel_norm.py``): every stored row (sinks,
archive, tail) is the token divided by ``n = 2 ** norm`` per channel, so the kernels never see ``n``:

    append:     the first append reaching past the sinks sets ``norm`` from its tokens past the sinks (as it sets the
                mean) and divides the sink rows stored before it; then every appended token enters as ``x / n``
    attention:  ``q . k = (q * n_k) . (k / n_k)``, ``sum p v = n_v * sum p (v / n_v)``: q and the output are scaled
                around the kernel, and the call's own tokens enter as ``k_new / n_k``, ``v_new / n_v``
    read:       the view is the stored rows times ``n``

Powers of two scale floats exactly, so all of this is exact: a raw row reads back bitwise, and a product
``(q * n) (k / n)`` rounds as ``q k`` does. A stream without ``normalize`` passes through unchanged.
"""

from __future__ import annotations

import torch

from ...codecs import Codec
from ...codecs.channel_norm import channel_exponents, channel_factors
from ..state import StreamState


def factors(codec: Codec, st: StreamState, host: bool = False) -> torch.Tensor | None:
    """``n (B, H, D)`` fp32 of a normalized stream, else None. ``host``: the state lives in host memory (CPU), where
    reading it costs no device sync, so a stream whose exponents are all zero (``n = 1``) gives None too."""
    if not codec.normalize or (host and not bool(st.norm.any())):
        return None
    return channel_factors(st.norm)


def measures(codec: Codec, st: StreamState, new_tokens: int) -> torch.Tensor:
    """0-dim bool: whether an append of ``new_tokens`` is the first to reach past the sinks (it sets the exponents)."""
    return (st.length <= codec.sinks) & (st.length + new_tokens > codec.sinks)


def set_norm(codec: Codec, st: StreamState, new: torch.Tensor) -> None:
    """Before ``new (B, H, T, D)`` is appended: the first append reaching past the sinks sets ``st.norm`` from its
    tokens past the sinks and divides the sink rows stored before it by the new factors (in place, on the device)."""
    t = new.shape[2]
    position = st.length + torch.arange(t, device=new.device)
    first = measures(codec, st, t)
    st.norm.copy_(torch.where(first, channel_exponents(new, position >= codec.sinks), st.norm))
    if codec.sinks:
        stored = (torch.arange(codec.sinks, device=new.device) < st.length).view(1, 1, -1, 1)
        n = channel_factors(st.norm)[:, :, None].to(st.sink.dtype)
        st.sink.copy_(torch.where(first & stored, st.sink / n, st.sink))


def to_stored(codec: Codec, st: StreamState, x: torch.Tensor | None, host: bool = False) -> torch.Tensor | None:
    """``x (B, H, T, D)`` tokens as the stream stores them: ``x / n`` (``x`` itself without ``normalize``; ``host``
    as in :func:`factors`)."""
    n = None if x is None else factors(codec, st, host)
    return x if n is None else x / n[:, :, None].to(x.dtype)


def from_stored(codec: Codec, st: StreamState, rows: torch.Tensor) -> torch.Tensor:
    """Stored rows ``(B, H, N, D)`` -> the tokens they hold: ``rows * n``."""
    if not codec.normalize:
        return rows
    return rows * channel_factors(st.norm)[:, :, None].to(rows.dtype)


def query_factors(codec: Codec, st: StreamState, heads: int, host: bool = False) -> torch.Tensor | None:
    """``n (B, Hq, 1, D)`` in fp32 for ``heads`` query heads (query head ``i`` reads kv head ``i // (Hq / H_kv)``),
    or None without ``normalize`` (``host`` as in :func:`factors`)."""
    n = factors(codec, st, host)
    if n is None:
        return None
    return n.repeat_interleave(heads // n.shape[1], dim=1)[:, :, None]


def attention_inputs(codec_k: Codec, codec_v: Codec, ks: StreamState, vs: StreamState, q: torch.Tensor,
                     k_new: torch.Tensor | None, v_new: torch.Tensor | None, host: bool = False):
    """``(q, k_new, v_new, out_factors)`` as a kernel over the stored domain takes them (see the module docstring);
    ``out_factors (B, Hq, 1, D)`` multiply its output (None: nothing to do). ``host`` as in :func:`factors`."""
    qn = query_factors(codec_k, ks, q.shape[1], host)
    if qn is not None:
        q = q * qn.to(q.dtype)
    return (q, to_stored(codec_k, ks, k_new, host), to_stored(codec_v, vs, v_new, host),
            query_factors(codec_v, vs, q.shape[1], host))


def attention_output(out: torch.Tensor, out_factors: torch.Tensor | None) -> torch.Tensor:
    """A kernel's output over the stored domain -> the attention output (``out * n_v``)."""
    return out if out_factors is None else out * out_factors.to(out.dtype)
