"""A toy decoder owning a static, unmemoized CodecKVCache per layer, and helpers to decode with it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import flashcodec_fx as fc
from flashcodec_fx.passes import backend

VOCAB, HIDDEN, HQ, HKV, HEAD_DIM, CAPACITY = 64, 32, 4, 2, 16, 96


class ToyDecoder(torch.nn.Module):
    """Embedding -> ``layers`` attention blocks over codec caches -> logits; ``forward(ids (B, T), pos (T,))``.

    ``gqa``: "repeat" (transformers' repeat_kv), "enable" (``enable_gqa=True``). ``mask``: "bool", "float"
    (additive, -inf) or "none". ``cache``: "codec" (static, memoize=False), "memo" (static, memoized view) or
    "raw" (plain preallocated tensors, no codec). ``is_causal``: SDPA's flag instead of a mask (prefill-style).
    ``value_codec``: the values' codec when it differs from the keys' (``codec``).
    """

    def __init__(self, codec=None, gqa: str = "repeat", mask: str = "bool", cache: str = "codec", layers: int = 2,
                 is_causal: bool = False, seed: int = 0, value_codec=None):
        super().__init__()
        torch.manual_seed(seed)
        self.gqa, self.mask, self.cache_kind, self.is_causal = gqa, mask, cache, is_causal
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, (HQ + 2 * HKV) * HEAD_DIM) for _ in range(layers))
        self.out = torch.nn.ModuleList(torch.nn.Linear(HQ * HEAD_DIM, HIDDEN) for _ in range(layers))
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        codec = codec or fc.make_codec("png", block_size=8)
        if cache == "raw":
            for i in range(layers):
                self.register_buffer(f"k{i}", torch.zeros(1, HKV, CAPACITY, HEAD_DIM))
                self.register_buffer(f"v{i}", torch.zeros(1, HKV, CAPACITY, HEAD_DIM))
        else:
            self.caches = [fc.CodecKVCache(codec, value_codec, layout="static", max_length=CAPACITY,
                                           memoize=cache == "memo") for _ in range(layers)]

    def _kv(self, i: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        if self.cache_kind == "raw":
            kb, vb = getattr(self, f"k{i}"), getattr(self, f"v{i}")
            kb.index_copy_(2, pos, k)
            vb.index_copy_(2, pos, v)
            return kb, vb
        self.caches[i].append(k, v)
        return self.caches[i].read()

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.embed(ids)
        for i, (qkv, out) in enumerate(zip(self.qkv, self.out, strict=True)):
            q, k, v = qkv(x).view(b, t, HQ + 2 * HKV, HEAD_DIM).transpose(1, 2).split([HQ, HKV, HKV], dim=1)
            k, v = self._kv(i, k.contiguous(), v.contiguous(), pos)
            length = k.shape[2]
            allowed = (torch.arange(length, device=ids.device)[None, :] <= pos[:, None])[None, None]
            mask = {"bool": allowed, "none": None,
                    "float": torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))}[self.mask]
            if self.is_causal:
                mask = None
            if self.gqa == "repeat":
                n = HQ // HKV
                k = k[:, :, None].expand(b, HKV, n, length, HEAD_DIM).reshape(b, HQ, length, HEAD_DIM)
                v = v[:, :, None].expand(b, HKV, n, length, HEAD_DIM).reshape(b, HQ, length, HEAD_DIM)
                att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.is_causal)
            else:
                att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.is_causal, enable_gqa=True)
            x = x + out(att.transpose(1, 2).reshape(b, t, HQ * HEAD_DIM))
        return self.head(x)

    def reset(self) -> None:
        if self.cache_kind == "raw":
            for buf in self.buffers():
                buf.zero_()
        else:
            for cache in self.caches:
                cache.reset()


def twin(model: ToyDecoder, **kwargs) -> ToyDecoder:
    """An independent copy (own caches) with the same weights."""
    other = ToyDecoder(**kwargs)
    other.load_state_dict(model.state_dict())
    return other


PROMPT = torch.tensor([[5, 9, 11, 3, 7, 21, 8, 2, 40, 17, 33]])


def prefill(model: ToyDecoder, prompt: torch.Tensor = PROMPT) -> torch.Tensor:
    """Eager prefill; returns the first greedy token ``(1, 1)``."""
    model.reset()
    logits = model(prompt, torch.arange(prompt.shape[1]))
    return logits[:, -1:].argmax(-1)


def greedy(step, first: torch.Tensor, start: int, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decode with ``step(ids (1, 1), pos (1,))``; returns tokens and per-step logits."""
    tokens, logits, tok = [], [], first
    for i in range(steps):
        out = step(tok, torch.tensor([start + i]))
        logits.append(out[:, -1])
        tok = out[:, -1:].argmax(-1)
        tokens.append(int(tok))
    return tokens, logits


class Compiled:
    """A toy decoder, its eager twin and the compiled decode step with the backend that compiled it."""

    def __init__(self, tmp, strict: bool = True, **kwargs):
        self.eager = ToyDecoder(**kwargs)
        self.model = twin(self.eager, **kwargs)
        self.backend = backend(strict=strict, debug=str(tmp))
        self.debug_dir = tmp
        self.step = torch.compile(self.model, backend=self.backend, fullgraph=True)
