"""`flashcodec::codec_attention`: attention on the stored form, never on the (S, D) view.

Each stream is four segments of *slots*, each slot a position: the raw sinks, the archive, the raw tail, and the
current call's own ``T`` new tokens (exact, as the prompt is). An archived block of the centered, rotated vectors is
``X = A @ S`` (A the codec's ``(r, R)`` synthesis matrix, S its dense stored rows), so with ``q_rot = R @ q``

    scores[p] = q . k[p] = ((q_rot @ S^T) @ A^T)[p] + q . mean_k          out += R^T ((prob @ A) @ S) + mass * mean_v

per block. Keys and values may archive at different positions (their own sinks, groups, windows): key scores are
computed per key slot, normalized over every valid position once, moved to positions, and read back per value slot.
A normalized stream is read in its stored domain: ``q * n_k`` against the stored keys, the output times ``n_v``
(``normalize.py``).

Three optional variants of the logits and the softmax, in this order (:func:`codec_attention_reference`):

    s = (q . k) * scale  ->  softcap * tanh(s / softcap)  ->  + alibi[h] * pos  ->  + mask
    p = exp(s - m) / (sum exp(s - m) + exp(sinks[h] - m)),  m = max(max s, sinks[h])

``softcap`` (Gemma 2, Grok), ``alibi`` slopes per query head over the key's position ``pos`` (BLOOM, MPT), ``sinks``
logits per query head that take probability mass and add no value (GPT-OSS); each defaults to off.
"""

from __future__ import annotations

import math

import torch

from ...codecs import Codec, Encoded
from ..state import StreamState, check_state, spec_codec, stream_dtype
from .normalize import attention_inputs, attention_output
from .read import check_new


def _check_mask(mask: torch.Tensor | None, b: int, hq: int, t: int) -> None:
    if mask is None:
        return
    ok = mask.dim() == 4 and mask.shape[0] in (1, b) and mask.shape[1] in (1, hq) and mask.shape[2] in (1, t)
    if not ok or not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise ValueError(f"mask must be bool (True = attend) or additive float of shape (1|B, 1|Hq, 1|T, L) with "
                         f"B={b}, Hq={hq}, T={t}, got {mask.dtype} {tuple(mask.shape)}")


def _check_head_vector(name: str, x, q: torch.Tensor, allowed: str, ok_dtype) -> None:
    """``x``: None or a ``(Hq,)`` tensor on q's device whose dtype passes ``ok_dtype`` (TypeError names ``allowed``)."""
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of shape (Hq,) or None, got {type(x).__name__}")
    if not ok_dtype(x.dtype):
        raise TypeError(f"{name} must be {allowed}, got {x.dtype}")
    if x.dim() != 1 or x.shape[0] != q.shape[1]:
        raise ValueError(f"{name} must have shape (Hq,) = ({q.shape[1]},): one value per query head, got "
                         f"{tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")


def check_variants(q: torch.Tensor, softcap, sinks, alibi) -> None:
    """Validate the optional variants: ``softcap`` a positive finite float; ``sinks`` ``(Hq,)`` of a float dtype;
    ``alibi`` ``(Hq,)`` fp32; both on q's device."""
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be a positive finite float (logits become softcap * tanh(logit / "
                             f"softcap)), got {softcap}")
    _check_head_vector("sinks", sinks, q, "a float tensor (any float dtype: the sink logits)",
                       lambda dt: dt.is_floating_point)
    _check_head_vector("alibi", alibi, q, "a float32 tensor (the ALiBi slopes)", lambda dt: dt == torch.float32)


def check_attention_args(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, softcap=None, sinks=None,
                         alibi=None):
    """Validate ``codec_attention`` arguments; returns ``(codec_k, codec_v, k_state, v_state)``."""
    ck, cv = spec_codec("spec_k", spec_k), spec_codec("spec_v", spec_v)
    ks, vs = check_state("k_state", ck, k_state), check_state("v_state", cv, v_state)
    if q.dim() != 4 or q.shape[0] != ks.tail.shape[0] or q.shape[3] != ks.tail.shape[3]:
        raise ValueError(f"q must be (B, Hq, T, D) matching the cache's B and D {(ks.tail.shape[0], ks.tail.shape[3])}, "
                         f"got {tuple(q.shape)}")
    if vs.tail.shape[:2] != ks.tail.shape[:2] or vs.tail.shape[3] != q.shape[3]:
        raise ValueError(f"k and v states must share (B, H_kv) and q's head_dim, got k {tuple(ks.tail.shape)} and "
                         f"v {tuple(vs.tail.shape)}")
    k_dtype, v_dtype = stream_dtype(ck, ks.tail), stream_dtype(cv, vs.tail)
    if not q.dtype == k_dtype == v_dtype:
        raise ValueError(f"q dtype must match the streams' dtype (k {k_dtype}, v {v_dtype}), got {q.dtype}")
    if q.shape[1] % ks.tail.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({ks.tail.shape[1]})")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together (the current call's own keys and values)")
    check_new("k_new", ck, ks, k_new)
    check_new("v_new", cv, vs, v_new)
    if k_new is not None and k_new.shape[2] != v_new.shape[2]:
        raise ValueError(f"k_new and v_new must hold the same tokens, got {k_new.shape[2]} and {v_new.shape[2]}")
    _check_mask(mask, q.shape[0], q.shape[1], q.shape[2])
    check_variants(q, softcap, sinks, alibi)
    return ck, cv, ks, vs


def slot_positions(codec: Codec, st: StreamState, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position and validity of every slot of a stream: sinks, archive, tail, then the ``new_tokens`` of this call.

    Stored slots count only below ``length - new_tokens`` (the new tokens are read exactly from the call instead)."""
    dev, length, start = st.tail.device, st.length, st.start
    stored_end = length - new_tokens
    sinks = torch.arange(codec.sinks, device=dev)
    archive = codec.sinks + torch.arange(st.data.shape[2] * codec.group, device=dev)
    tail = start + torch.arange(codec.tail_capacity, device=dev)
    new = stored_end + torch.arange(new_tokens, device=dev)
    pos = torch.cat([sinks, archive, tail, new])
    ok = torch.cat([sinks < stored_end, (archive < start) & (archive < stored_end), tail < stored_end,
                    torch.ones(new_tokens, dtype=torch.bool, device=dev)])
    return pos, ok


def mask_bias(mask: torch.Tensor, pos: torch.Tensor, b: int, hkv: int, g: int, t: int) -> torch.Tensor:
    """Gather an additive fp32 bias ``(B, H_kv, G * T, P)`` for absolute positions ``pos (P,)``."""
    picked = mask.index_select(3, pos.clamp(max=mask.shape[3] - 1))
    if picked.dtype == torch.bool:
        picked = torch.zeros(picked.shape, device=mask.device).masked_fill(~picked, float("-inf"))
    picked = picked.float().expand(b, hkv * g, t, -1)
    return picked.reshape(b, hkv, g * t, -1)


def safe_softmax(scores: torch.Tensor, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim where rows with no finite score give zeros (not NaN). ``sink`` (broadcast to
    ``scores[..., :1]``): one more logit per row, in the max and the denominator but not in the result (its column
    dropped), so a row whose scores are all ``-inf`` gives zeros there too."""
    peak = scores.amax(dim=-1, keepdim=True)
    if sink is not None:
        peak = torch.maximum(peak, sink)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(scores - peak)
    denom = weights.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - peak)
    return weights / torch.where(denom > 0, denom, torch.ones_like(denom))


def per_row(x: torch.Tensor, hkv: int, g: int, t: int) -> torch.Tensor:
    """A per-query-head ``(Hq,)`` vector as fp32 ``(1, H_kv, G * T, 1)``, the rows of the grouped query
    ``(B, H_kv, G * T, D)`` (row ``i * T + j``: head ``kv * G + i``, token ``j``)."""
    return x.float().reshape(hkv, g, 1).expand(hkv, g, t).reshape(1, hkv, g * t, 1)


def _key_scores(codec: Codec, st: StreamState, qg: torch.Tensor, k_new: torch.Tensor | None) -> torch.Tensor:
    """``q . k`` per slot ``(B, H_kv, GT, slots)`` in slot order; archived keys in the coefficient domain."""
    b, h, _, d = st.tail.shape
    rot = codec.rotation(d, qg.device)
    q_rot = qg if rot is None else qg @ rot.T
    rows = codec.stored_rows(Encoded(*st[:4]), d)  # (B, H, NB, R, D)
    coef = torch.einsum("bhqd,bhnrd->bhqnr", q_rot, rows)
    archive = torch.einsum("bhqnr,pr->bhqnp", coef, codec.synthesis(qg.device)).flatten(-2)
    if codec.center:
        archive = archive + (qg * st.mean[:, :, None]).sum(-1, keepdim=True)
    parts = [qg @ st.sink.float().transpose(-1, -2), archive, qg @ st.tail.float().transpose(-1, -2)]
    if k_new is not None:
        parts.append(qg @ k_new.float().transpose(-1, -2))
    return torch.cat(parts, dim=-1)


def _value_sum(codec: Codec, st: StreamState, w: torch.Tensor, v_new: torch.Tensor | None) -> torch.Tensor:
    """``sum_slot w[slot] v[slot]`` ``(B, H_kv, GT, D)`` for weights in slot order; archive in the coefficient domain."""
    b, h, _, d = st.tail.shape
    ns, na, nt = codec.sinks, st.data.shape[2] * codec.group, codec.tail_capacity
    w_sink, w_arch, w_tail, w_new = w.split([ns, na, nt, w.shape[-1] - ns - na - nt], dim=-1)
    rows = codec.stored_rows(Encoded(*st[:4]), d)  # (B, H, NB, R, D)
    p_coef = torch.einsum("bhqnp,pr->bhqnr", w_arch.unflatten(-1, (rows.shape[2], codec.block_size)),
                          codec.synthesis(w.device))
    out = torch.einsum("bhqnr,bhnrd->bhqd", p_coef, rows)
    rot = codec.rotation(d, w.device)
    if rot is not None:
        out = out @ rot
    if codec.center:
        out = out + w_arch.sum(-1, keepdim=True) * st.mean[:, :, None]
    out = out + w_sink @ st.sink.float() + w_tail @ st.tail.float()
    if v_new is not None:
        out = out + w_new @ v_new.float()
    return out


def codec_attention_reference(q: torch.Tensor, k_state: list[torch.Tensor], v_state: list[torch.Tensor], spec_k: str,
                    spec_v: str, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                    mask: torch.Tensor | None = None, scale: float | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q (B, Hq, T, D)`` over the first ``length`` stored positions; ``(B, Hq, T, D)`` in q's dtype.

    ``k_new`` / ``v_new`` ``(B, H_kv, T_new, D)``: the current call's own keys and values (already appended), read
    exactly at the last ``T_new`` positions. GQA: query head ``i`` reads kv head ``i // (Hq // H_kv)``. ``mask``: bool
    (True = attend) or additive float, ``(1|B, 1|Hq, 1|T, L)`` over absolute positions ``0..L-1`` with
    ``L >= length``; without a mask every query sees every stored position. ``scale`` defaults to ``1 / sqrt(D)``.
    Accumulates in fp32 (raw rows of any dtype widened); a row that sees nothing gives zeros.

    Variants (each off by default), applied in this order to each logit ``s = (q . k) * scale``:

    - ``softcap`` (float > 0; Gemma 2, Grok): ``s = softcap * tanh(s / softcap)``;
    - ``alibi`` (``(Hq,)`` fp32 slopes): ``s += alibi[h] * pos`` for query head ``h`` and the key's position ``pos``
      (the position the mask is indexed by, :func:`slot_positions`). Softmax is shift invariant per row, so this
      equals BLOOM's ``slope * (pos - first non-pad position)`` and MPT's ``slope * (pos - (S - 1))`` biases;
    - then the mask's bias;
    - ``sinks`` (``(Hq,)``, any float dtype, used in fp32; GPT-OSS's ``s_aux``): one more logit per query head in each
      row's softmax, which takes probability mass and adds no value: ``p = exp(s - m) / (sum exp(s - m) +
      exp(sinks[h] - m))`` with ``m`` the max over the logits and the sink (transformers' gpt_oss
      ``eager_attention_forward``: the sink column concatenated, softmax, the column dropped). A row that sees no key
      gives zeros (all its mass on the sink).
    """
    ck, cv, ks, vs = check_attention_args(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, softcap, sinks,
                                          alibi)
    q_in, k_new, v_new, out_factors = attention_inputs(ck, cv, ks, vs, q, k_new, v_new)
    b, hq, t, d = q.shape
    hkv = ks.tail.shape[1]
    g = hq // hkv
    tn = 0 if k_new is None else k_new.shape[2]
    qg = q_in.float().reshape(b, hkv, g * t, d)
    k_pos, k_ok = slot_positions(ck, ks, tn)
    scores = _key_scores(ck, ks, qg, k_new) * (1.0 / math.sqrt(d) if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi is not None:
        scores = scores + per_row(alibi, hkv, g, t) * k_pos.float()
    if mask is not None:
        scores = scores + mask_bias(mask, k_pos, b, hkv, g, t)
    sink = None if sinks is None else per_row(sinks, hkv, g, t)
    probs = safe_softmax(scores.masked_fill(~k_ok, float("-inf")), sink)
    v_pos, v_ok = slot_positions(cv, vs, tn)
    n_pos = max(k_pos.shape[0], v_pos.shape[0])
    at_pos = probs.new_zeros(b, hkv, g * t, n_pos).scatter_add_(-1, k_pos.clamp(max=n_pos - 1).expand_as(probs), probs)
    w = at_pos.index_select(-1, v_pos.clamp(max=n_pos - 1)) * v_ok
    return attention_output(_value_sum(cv, vs, w, v_new).reshape(b, hq, t, d).to(q.dtype), out_factors)


@torch.library.custom_op("flashcodec::codec_attention", mutates_args=())
def codec_attention(q: torch.Tensor, k_state: list[torch.Tensor], v_state: list[torch.Tensor], spec_k: str,
                    spec_v: str, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                    mask: torch.Tensor | None = None, scale: float | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None) -> torch.Tensor:
    """The ``flashcodec::codec_attention`` op; its default kernel is :func:`codec_attention_reference` (the spec).
    ``softcap``, ``sinks`` and ``alibi`` come last, after ``scale``, so calls without them read as before."""
    return codec_attention_reference(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask, scale, softcap, sinks,
                                     alibi)


@codec_attention.register_fake
def _(q, k_state, v_state, spec_k, spec_v, k_new=None, v_new=None, mask=None, scale=None, softcap=None, sinks=None,
      alibi=None):
    check_variants(q, softcap, sinks, alibi)
    return torch.empty_like(q, memory_format=torch.contiguous_format)
