"""Offloading traffic: the bytes one decode step moves between the device and the host, codec caches vs transformers'.

transformers' offloading (``Cache(offloading=True)``: ``cache_implementation="offloaded"`` / ``"offloaded_static"``)
moves every offloaded layer to the CPU after its update and back before the next one. This counts, per decode step,
the bytes of every tensor those moves hand to ``.to(device)`` or ``copy_``, device to host (``offload``) and back
(``prefetch``), for transformers' ``DynamicCache`` / ``StaticCache`` and for ``FlashCodecCache(offloading=True)``
(dynamic / static layout) with the lossless tier and the presets, which move their stored form (filled archive groups,
scales, raw sinks and tail, mean) and attend on it. ``vs_native`` compares the offload direction: on a CPU the native
caches' prefetch is a no-op (the host is the device), on CUDA it moves what the offload moved, as the codec's does.

Model: a random-init Llama with SmolLM2-135M's attention geometry (9 query / 3 KV heads, head_dim 64), 4 layers,
greedy decode after a random prompt of each length (the bytes depend on shapes and lengths, not on values). On CPU the
figures are the bytes a GPU run moves; the order of the moves is transformers' (prefetch the next layer, update,
offload this one) without CUDA streams, which a CPU cannot run. ``--device cuda`` runs transformers' own offloading
(the GPU check script does).

    python benchmarks/bench_offload.py --quick      # prompts 256 and 1024, bf16, seconds
    python benchmarks/bench_offload.py              # prompts 512, 2048, 8192 tokens, bf16 and fp32
    python benchmarks/bench_offload.py --device cuda --out benchmarks/results/gpu_check/offload_cuda.json
    python benchmarks/bench_offload.py --quick --prompts 64 --out /tmp/offload.json   # the GPU check's dry run
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
from common import write_result
from torch.overrides import TorchFunctionMode

TIERS = {"png (lossless)": dict(preset="lossless"), "int8": dict(preset="int8"), "4bit": dict(preset="4bit"),
         "3bit": dict(preset="3bit")}
LAYOUTS = ("dynamic", "static")
NEW_TOKENS = 8
VS_NATIVE = ("offload_bytes_per_step / the native cache's, same layout, prompt and dtype (device to host: what every "
             "offloaded layer moves after its update; prefetch moves the same bytes back, except the native caches' "
             "prefetch on a CPU, a no-op there since the host is the device)")


class TransferCounter(TorchFunctionMode):
    """Counts the bytes of every tensor moved with ``.to(device)`` (``.to(dtype)`` alone is not a move) or copied with
    ``copy_`` while active: inside ``offload`` / ``prefetch`` each of them is a device-host transfer (a codec layer
    copies its filled archive groups into buffers allocated on the other side)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and isinstance(args[0], torch.Tensor):
            moves = "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])
            if moves:
                self.bytes += args[0].nbytes
        elif func is torch.Tensor.copy_:
            self.bytes += args[1].nbytes
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_offloads(cache) -> Iterator[dict[str, TransferCounter]]:
    """Counts what ``cache``'s layers move in their ``offload`` (device to host) and ``prefetch`` (host to device)."""
    counters = {name: TransferCounter() for name in ("offload", "prefetch")}
    originals = []
    for layer in cache.layers:
        for name, counter in counters.items():
            method = getattr(layer, name)

            def counted(method=method, counter=counter):
                with counter:
                    method()

            originals.append((layer, name))
            setattr(layer, name, counted)
    try:
        yield counters
    finally:
        for layer, name in originals:
            delattr(layer, name)


def host_offloading(cache):
    """transformers' offloading order on a CPU (no CUDA streams to order the moves): prefetch the next layer,
    update, offload this one. Installed on one native cache instance."""
    def update(key_states, value_states, layer_idx, *args, **kwargs):
        cache.prefetch(layer_idx + 1, cache.only_non_sliding)
        out = cache.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        cache.offload(layer_idx, cache.only_non_sliding)
        return out

    cache.update = update
    return cache


def model_for(dtype: torch.dtype, device: str):
    import transformers

    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                      max_position_embeddings=16384, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def make_cache(model, tier: str | None, layout: str, max_len: int, device: str):
    from transformers.cache_utils import DynamicCache, StaticCache

    import flashcodec_fx as fx

    if tier is None:
        cache = DynamicCache(config=model.config, offloading=True) if layout == "dynamic" else \
            StaticCache(config=model.config, max_cache_len=max_len, offloading=True)
        return cache if device == "cuda" else host_offloading(cache)
    static = dict(layout="static", max_cache_len=max_len) if layout == "static" else {}
    return fx.FlashCodecCache.from_config(model.config, offloading=True, **TIERS[tier], **static)


def measure(model, prompt: int, tier: str | None, layout: str, device: str) -> dict:
    """Generate ``NEW_TOKENS`` greedy tokens after a random ``prompt``; bytes moved per decode step."""
    from flashcodec_fx._compat import GENERATE_CACHE_KWARG
    from flashcodec_fx.hf import apply_codec_attention, remove_codec_attention

    ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(prompt))
    cache = make_cache(model, tier, layout, prompt + NEW_TOKENS, device)
    if tier is not None:
        apply_codec_attention(model)
    try:
        with torch.no_grad(), counting_offloads(cache) as counters:
            model(ids[:, :-1].to(device), **{GENERATE_CACHE_KWARG: cache}, use_cache=True)
            prefill = {name: counter.bytes for name, counter in counters.items()}
            token = ids[:, -1:].to(device)
            for _ in range(NEW_TOKENS):
                logits = model(token, **{GENERATE_CACHE_KWARG: cache}, use_cache=True).logits
                token = logits[:, -1:].argmax(-1)
    finally:
        if tier is not None:
            remove_codec_attention(model)
    step = {name: (counters[name].bytes - prefill[name]) / NEW_TOKENS for name in counters}
    row = {"prompt": prompt, "layout": layout, "cache": tier or ("DynamicCache" if layout == "dynamic" else "StaticCache"),
           "prefill_offload_bytes": prefill["offload"], "offload_bytes_per_step": step["offload"],
           "prefetch_bytes_per_step": step["prefetch"]}
    if tier is not None:
        parts = cache.storage_breakdown()
        row.update(stored_bytes=parts["stored"], raw_equivalent=parts["raw_equivalent"],
                   bits_per_value=round(cache.bits_per_value(), 3))
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="prompts 256 and 1024, bf16 only")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--prompts", default=None, help="comma-separated prompt lengths (overrides the defaults)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/offload.json)")
    args = parser.parse_args(argv)
    prompts = (256, 1024) if args.quick else (512, 2048, 8192)
    if args.prompts:
        prompts = tuple(int(p) for p in args.prompts.split(","))
    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float32)
    rows = []
    for dtype in dtypes:
        model = model_for(dtype, args.device)
        for layout in LAYOUTS:
            for prompt in prompts:
                native = measure(model, prompt, None, layout, args.device)
                rows.append({"dtype": str(dtype).removeprefix("torch."), **native, "vs_native": 1.0})
                for tier in TIERS:
                    row = measure(model, prompt, tier, layout, args.device)
                    row["vs_native"] = round(row["offload_bytes_per_step"] / native["offload_bytes_per_step"], 4)
                    rows.append({"dtype": str(dtype).removeprefix("torch."), **row})
                    print(f"{rows[-1]['dtype']:9s} {layout:8s} prompt {prompt:5d} {tier:15s} offload "
                          f"{row['offload_bytes_per_step'] / 2**20:8.3f} MiB/step, prefetch "
                          f"{row['prefetch_bytes_per_step'] / 2**20:8.3f}  vs {native['cache']}: {row['vs_native']:.3f}")
    path = write_result("offload", {"new_tokens": NEW_TOKENS, "device": args.device, "meta_model": {
        "layers": 4, "kv_heads": 3, "head_dim": 64}, "vs_native": VS_NATIVE, "rows": rows}, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
