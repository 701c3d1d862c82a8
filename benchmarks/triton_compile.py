"""Compile every Triton kernel configuration for a GPU target without a GPU: API drift shows on a CPU machine.

The launchers (`flashcodec_fx.ops.triton_*`: attention, append, encode / decode / read; the vLLM plugin's paged
kernels) are called on CPU tensors with ``JITFunction.run`` replaced by a
recorder, so every launch they would make (kernel, argument types, constexprs, num_warps / num_stages) is
collected exactly as they build it; each distinct one is then compiled with ``triton.compile`` for
``GPUTarget("cuda", <arch>, 32)`` (ptxas included, bundled with triton) and ptxas' register / spill / shared
memory report is read back. Nothing runs on a device. Run it without ``TRITON_INTERPRET`` (the interpreter replaces
the compiler).

    python benchmarks/triton_compile.py --quick    # one configuration per code path (CI, both triton versions)
    python benchmarks/triton_compile.py            # every pair x bf16/fp16/fp32 x D=64/128 x GQA 1/4/8 x T=1/4 x masks
    python benchmarks/triton_compile.py --quick --kernels _read_kernel,_decode_groups_kernel   # only these kernels

Exit status 1 when a configuration fails to compile or needs more shared memory than the target has; the JSON
(``--out``) lists every configuration.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("triton_compile.py compiles kernels: run it without TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton._utils import find_paths_if, get_iterable_path  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402

from flashcodec_fx import PRESETS  # noqa: E402
from flashcodec_fx.codecs import make_codec  # noqa: E402
from flashcodec_fx.ops import empty_state  # noqa: E402
from flashcodec_fx.ops.triton.append import triton_append  # noqa: E402
from flashcodec_fx.ops.triton.attention import triton_codec_attention  # noqa: E402
from flashcodec_fx.ops.triton.blocks import triton_decode, triton_encode  # noqa: E402
from flashcodec_fx.ops.triton.read import triton_read  # noqa: E402
from flashcodec_fx.presets import preset_codecs  # noqa: E402
from flashcodec_fx.vllm.config import VLLM_PRESETS  # noqa: E402
from flashcodec_fx.vllm.page import RAW, StorePlan, page_format  # noqa: E402
from flashcodec_fx.vllm.triton import triton_paged_attention, triton_paged_store  # noqa: E402

# Stored forms beyond the presets (every code path of the kernels): float jpeg with dropped coefficients, pruned png
# (r=8 and its limit r=16), channel-axis codes whose scale group is one block (no fold: dequantized in registers),
# DCT keys with channel-axis scales over 128-token groups (the fold; 16 blocks encoded block by block), channel-axis
# values (the fold on the output), value blocks at an offset inside the tiles (other sinks), lloyd and
# uniform rows in one table with a rotation and a center.
FORMS = {
    "jpeg_k3": ("jpeg", {"block_size": 8, "keep_freqs": 3}),
    "png_pruned": ("png", {"block_size": 8, "keep_ratio": 0.5}),
    "png_r16_pruned": ("png", {"block_size": 16, "keep_ratio": 0.5}),
    "channel_unfolded": ("jpeg", {"block_size": 8, "quant_bits": (3, 2, 2, 1, 1, 1, 1, 1), "levels": ("int", "midrise"),
                                  "scale_axis": "channel", "group": 8, "sinks": 3}),
    "dct_keys": ("jpeg", {"block_size": 8, "quant_bits": (5, 3, 3, 2, 2, 2, 2, 2), "levels": ("uniform", "midrise"),
                          "scale_axis": "channel", "group": 128, "scale_search": True, "rotate": 1, "sinks": 4}),
    "channel_v": ("jpeg", {"block_size": 8, "quant_bits": (4, 2, 2, 2, 2, 2, 2, 2), "levels": ("uniform", "int"),
                           "scale_axis": "channel", "group": 64, "sinks": 4, "window": 3}),
    "token_offset": ("jpeg", {"block_size": 4, "quant_bits": 3, "levels": "midrise", "sinks": 1, "window": 5}),
    "mixed_rotated": ("jpeg", {"block_size": 2, "quant_bits": (6, 3), "levels": ("lloyd", "uniform"), "rotate": 3,
                               "center": True}),
    # trellis codes (levels="tcq"): per token, rotated and centered; a DCT table of trellis rows (every slice width)
    "tcq3": ("jpeg", {"block_size": 1, "quant_bits": 3, "levels": "tcq", "rotate": 1, "center": True,
                      "scale_search": True, "sinks": 4, "window": 16}),
    "tcq_table": ("jpeg", {"block_size": 4, "quant_bits": (4, 3, 2, 1), "levels": "tcq", "scale_search": True}),
}
# (key, value) pairs the quick set compiles, with (dtype, mask kind, new tokens) each: one configuration per code path
# (the 4bit, 2.5bit and 2bit presets take the 3bit preset's: lloyd token codes, centered or not, sinks, a window)
QUICK = {
    "preset 3bit": (torch.bfloat16, "bool", True),
    "preset int8": (torch.float32, None, False),
    "preset lossless": (torch.bfloat16, "additive", False),
    "jpeg_k3/png_pruned": (torch.bfloat16, None, False),
    "channel_unfolded/token_offset": (torch.bfloat16, "bool", False),
    "dct_keys/channel_v": (torch.float16, None, False),
    "mixed_rotated/mixed_rotated": (torch.bfloat16, None, True),
    "tcq_table/tcq3": (torch.bfloat16, "bool", True),
}
# encode / decode / read (the append's group encode and decode over every group; read's sinks, tail and new tokens
# around the decode): (pair of ``pairs()``, its stream (0 keys, 1 values), dtype, op), one per code path beyond the
# append's: lloyd token codes rotated and centered, DCT keys of 16 blocks per channel-axis group with the rotation and
# the search (decoded block by block), pruned png, float jpeg rows; read with and without sinks and a window
GROUPS_QUICK = (("preset 3bit", 0, torch.bfloat16, "encode"), ("dct_keys/dct_keys", 0, torch.float16, "encode"),
                ("dct_keys/dct_keys", 0, torch.float16, "decode"), ("jpeg_k3/png_pruned", 1, torch.bfloat16, "decode"),
                ("preset 3bit", 0, torch.bfloat16, "read"), ("dct_keys/dct_keys", 0, torch.float16, "read"),
                ("jpeg_k3/png_pruned", 0, torch.float32, "read"), ("tcq3/tcq3", 0, torch.bfloat16, "read"),
                ("tcq_table/tcq_table", 0, torch.float16, "decode"))
GROUP_OPS = ("encode", "decode", "read")
# The vLLM plugin's paged kernels (flashcodec_fx/vllm/triton): (format, dtype, GQA group, tokens per request, sinks),
# one per code path: raw pages (no codes), midrise codes without search and no raw rows (int8), lloyd codes with the
# search, rotation and raw anchors (4bit; 3bit: 3-bit keys as 2+1-bit slices), trellis codes (the Viterbi store, the
# windowed decode), decode and prefill tiles, sink logits on both, every dtype
PAGED_QUICK = (("raw", torch.bfloat16, 1, 1, False), ("int8", torch.float16, 4, 1, False),
               ("4bit", torch.float32, 8, 1, True), ("3bit", torch.bfloat16, 4, 16, True),
               ("3bit-tcq", torch.float16, 4, 1, False))
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")  # (the trellis encoder's launches turn fusion off)
# Shared memory one block may use (opt-in maximum, bytes): a kernel that needs more compiles but fails to launch
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


class Recorder:
    """Replaces ``JITFunction.run``: each launch becomes (kernel, signature, constexprs, options), deduplicated."""

    def __init__(self):
        self.launches: dict[str, tuple] = {}
        self.label = ""  # what the launches being recorded are for (a pair / codec and its options)
        self.labels: dict[str, str] = {}

    def __enter__(self):
        self._run = JITFunction.run
        recorder = self

        def run(fn, *args, grid, warmup, **kwargs):
            recorder.record(fn, args, kwargs)

        JITFunction.run = run
        return self

    def __exit__(self, *exc):
        JITFunction.run = self._run

    def record(self, fn: JITFunction, args: tuple, kwargs: dict) -> None:
        options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
        bound = dict(zip(fn.arg_names, args, strict=False)) | kwargs
        constexprs = {p.name: bound[p.name] for p in fn.params if p.is_constexpr}
        signature = {name: "constexpr" if name in constexprs else mangle_type(value) for name, value in bound.items()}
        for name, kind in signature.items():  # tuple elements specialized to constants (an int 1), as a launch finds
            for path in find_paths_if(kind, lambda _, v: v == "constexpr") if isinstance(kind, tuple) else ():
                constexprs[(fn.arg_names.index(name), *path)] = get_iterable_path(bound[name], path)
        key = f"{fn.__name__} {sorted(signature.items())} {sorted((str(k), str(v)) for k, v in constexprs.items())} " \
              f"{options}"
        self.launches.setdefault(key, (fn, signature, constexprs, options))
        self.labels.setdefault(key, self.label)


def _state(codec, b, h, groups, d, dtype, length):
    st = empty_state(codec, b, h, groups, d, dtype, "cpu")
    st.length.fill_(length)
    st.start.fill_(codec.sinks)
    return st


def _attention(ck, cv, dtype, d, g, t, mask_kind, new: bool = False) -> None:
    hkv, groups = 8, 4
    q = torch.zeros(1, hkv * g, t, d, dtype=dtype)
    ks, vs = _state(ck, 1, hkv, groups, d, dtype, 100), _state(cv, 1, hkv, groups, d, dtype, 100)
    width = 4 * max(ck.group, cv.group) + 64
    mask = None
    if mask_kind == "bool":
        mask = torch.ones(1, 1, t, width, dtype=torch.bool)
    elif mask_kind == "additive":
        mask = torch.zeros(1, hkv * g, t, width, dtype=dtype)
    k_new = v_new = torch.zeros(1, hkv, t, d, dtype=dtype) if new else None
    triton_codec_attention(q, list(ks), list(vs), ck.spec, cv.spec, k_new, v_new, mask)


def pairs() -> dict[str, tuple]:
    """(key codec, value codec) of every preset, and of every extra form (as keys and values, or paired so that
    value blocks sit at an offset, or channel-axis values behind channel-axis DCT keys)."""
    out = {}
    for name in PRESETS:
        out[f"preset {name}"] = preset_codecs(name, layer_idx=1)
    forms = {name: make_codec(mode, **opts) for name, (mode, opts) in FORMS.items()}
    out |= {f"{name}/{name}": (c, c) for name, c in forms.items()}
    out["jpeg_k3/png_pruned"] = (forms["jpeg_k3"], forms["png_pruned"])
    out["channel_unfolded/token_offset"] = (forms["channel_unfolded"], forms["token_offset"])
    out["dct_keys/channel_v"] = (forms["dct_keys"], forms["channel_v"])
    out["tcq_table/tcq3"] = (forms["tcq_table"], forms["tcq3"])
    return out


def _append(codec, dtype, d, t, memo: bool) -> None:
    groups = 4
    state = list(_state(codec, 1, 2, groups, d, dtype, 3))
    cap = codec.sinks + groups * codec.group
    x = torch.zeros(1, 2, t, d, dtype=dtype)
    triton_append(state, x, codec.spec, torch.zeros(1, 2, cap, d, dtype=dtype) if memo else None)


def _groups(codec, dtype, d: int, op: str) -> None:
    """``flashcodec::encode`` / ``decode`` / ``read`` (with a new token) of 2 heads of 4 groups (shapes only)."""
    groups = 4
    mean = torch.zeros(1, 2, d) if codec.center else None
    if op == "encode":
        triton_encode(torch.zeros(1, 2, groups * codec.group, d, dtype=dtype), codec.spec, mean)
    elif op == "decode":
        triton_decode(*codec.empty_archive((1, 2), groups, d, dtype, "cpu"), codec.spec, dtype, mean)
    else:
        triton_read(list(_state(codec, 1, 2, groups, d, dtype, 3)), codec.spec, torch.zeros(1, 2, 1, d, dtype=dtype))


def _paged(name: str, dtype: torch.dtype, d: int, g: int, tokens: int, sinks: bool, block_size: int = 16) -> None:
    """The vLLM plugin's store and attention on a 2-request batch of ``tokens`` tokens each (shapes only)."""
    fmt = page_format(name, 1, d, dtype)
    heads, requests = 2, 2
    cache = torch.zeros(8, heads, block_size, fmt.state_content_bytes(block_size), dtype=torch.uint8)
    n = requests * tokens
    key = torch.zeros(n, heads, d, dtype=dtype)
    slots = torch.zeros(n, dtype=torch.int64)
    triton_paged_store(fmt, key, key, cache, slots, StorePlan(slots, slots, slots))  # the raw rows, then the codes
    query = torch.zeros(n, heads * g, d, dtype=dtype)
    starts = torch.arange(requests + 1, dtype=torch.int32) * tokens
    triton_paged_attention(fmt, query, key, key, cache, torch.zeros(requests, 4, dtype=torch.int32),
                           torch.full((requests,), 40, dtype=torch.int32), starts, 0.125,
                           torch.zeros(heads * g) if sinks else None, torch.empty_like(query), tokens)


def launch_everything(quick: bool, recorder: Recorder) -> None:
    """Call every launcher over the configuration grid (CPU tensors; the recorder catches the launches). Quick: the
    pairs of ``QUICK`` at D=128 (attention with their dtype / mask / new tokens; append of each codec once, with a
    memo; encode / decode / read of ``GROUPS_QUICK``; the vLLM plugin's paged store and attention of
    ``PAGED_QUICK``);
    full: every pair x bf16/fp16/fp32 x D=64/128 x GQA 1/4/8 x T=1/4 x every mask kind, append with and without a
    memo, one token and a chunk, encode / decode / read of each codec; the paged kernels of every vLLM format x
    dtype x D x GQA x decode / chunk x block size 16 / 32."""
    all_pairs = pairs()
    if quick:
        appended = set()  # each codec's append once (in the first pair's dtype): its code path does not change
        for name, (dtype, mask_kind, new) in QUICK.items():
            ck, cv = all_pairs[name]
            recorder.label = f"{name} {str(dtype)[6:]} D=128 mask={mask_kind} new={new}"
            _attention(ck, cv, dtype, 128, 4, 4 if new else 1, mask_kind, new=new)
            for codec in (ck, cv):
                if codec.spec not in appended:
                    appended.add(codec.spec)
                    recorder.label = f"append {codec.spec} {str(dtype)[6:]} D=128"
                    _append(codec, dtype, 128, 1, memo=True)
        for name, stream, dtype, op in GROUPS_QUICK:
            codec = all_pairs[name][stream]
            recorder.label = f"{op} {codec.spec} {str(dtype)[6:]} D=128"
            _groups(codec, dtype, 128, op)
        for name, dtype, g, tokens, sinks in PAGED_QUICK:
            recorder.label = f"vllm {name} {str(dtype)[6:]} D=128 G={g} tokens={tokens} sinks={sinks}"
            _paged(name, dtype, 128, g, tokens, sinks)
        return
    for name, dtype, d, g, tokens, bs in itertools.product((*VLLM_PRESETS, RAW), [torch.bfloat16, torch.float16,
                                                           torch.float32], [128, 64], [1, 4, 8], [1, 16], [16, 32]):
        recorder.label = f"vllm {name} {str(dtype)[6:]} D={d} G={g} tokens={tokens} block_size={bs}"
        _paged(name, dtype, d, g, tokens, False, bs)
    for (name, (ck, cv)), dtype, d in itertools.product(all_pairs.items(),
                                                        [torch.bfloat16, torch.float16, torch.float32], [128, 64]):
        for g, t, mask_kind in itertools.product([1, 4, 8], [1, 4], [None, "bool", "additive"]):
            recorder.label = f"{name} {str(dtype)[6:]} D={d} G={g} T={t} mask={mask_kind}"
            _attention(ck, cv, dtype, d, g, t, mask_kind, new=t > 1)
        for codec, t, memo in itertools.product({ck.spec: ck, cv.spec: cv}.values(), [1, 9], [False, True]):
            recorder.label = f"append {codec.spec} {str(dtype)[6:]} D={d} T={t} memo={memo}"
            _append(codec, dtype, d, t, memo)
        for codec, op in itertools.product({ck.spec: ck, cv.spec: cv}.values(), GROUP_OPS):
            recorder.label = f"{op} {codec.spec} {str(dtype)[6:]} D={d}"
            _groups(codec, dtype, d, op)


def _ptxas_report(ptx: str, arch: int) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas  # the ptxas triton itself uses for this arch

    ptxas = get_ptxas(arch).path
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([ptxas, f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}", "-v", f.name,
                              "-o", os.devnull], capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spill.group(1)) if spill else None,
            "spill_load_bytes": int(spill.group(2)) if spill else None}


def _pointers(signature: dict, prefix: str = ""):
    """(name, type) of each pointer argument; tuple arguments flattened (``name.i``)."""
    for name, kind in signature.items():
        if isinstance(kind, tuple):
            yield from _pointers({f"{name}.{i}": k for i, k in enumerate(kind)}, prefix)
        elif kind.startswith("*"):
            yield prefix + name, kind


_JOB: tuple = ()  # (launches, labels, arch) of a compile_all run, inherited by its forked workers


def _compile_one(key: str) -> dict:
    """Compile launch ``key`` of ``_JOB`` for its target: the row of the JSON (ok, shared memory, ptxas' report)."""
    launches, labels, arch = _JOB
    fn, signature, constexprs, options = launches[key]
    row = {"kernel": fn.__name__, "for": labels[key], **options,
           "constexprs": {str(k): str(v) for k, v in constexprs.items()},
           "pointers": dict(_pointers(signature))}
    start = time.perf_counter()
    try:
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        shared = kernel.metadata.shared
        limit = SHARED_LIMIT.get(arch)
        row.update(ok=limit is None or shared <= limit, shared_bytes=shared, **_ptxas_report(kernel.asm["ptx"], arch))
        if not row["ok"]:
            row["error"] = f"needs {shared} B of shared memory, sm_{arch} has {limit}"
    except Exception as err:  # recorded and counted: a failure here is what this check exists to find
        row.update(ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    row["compile_s"] = round(time.perf_counter() - start, 2)
    status = "ok" if row["ok"] else "FAILED " + row["error"]
    print(f"{fn.__name__:16s} {row.get('registers')} regs, {row.get('spill_store_bytes')} B spilled, "
          f"{row.get('shared_bytes')} B shared, {row['compile_s']} s: {status}  [{row['for']}]", flush=True)
    return row


def compile_all(launches: dict, labels: dict, arch: int, jobs: int) -> list[dict]:
    """Every launch compiled, ``jobs`` at a time (forked workers: a compile is one core's work); rows in launch
    order."""
    global _JOB
    _JOB = (launches, labels, arch)
    keys = list(launches)
    if jobs == 1:
        return [_compile_one(key) for key in keys]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return pool.map(_compile_one, keys, chunksize=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one configuration per code path (see launch_everything)")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (default 90: H100/H200)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles at once (default: every core)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/triton_compile_<triton version>.json)")
    parser.add_argument("--kernels", help="compile only these kernels (comma-separated names, e.g. _read_kernel)")
    args = parser.parse_args()
    with Recorder() as recorder:
        launch_everything(args.quick, recorder)
    if args.kernels:
        wanted = set(args.kernels.split(","))
        recorder.launches = {k: v for k, v in recorder.launches.items() if v[0].__name__ in wanted}
        if not recorder.launches:
            sys.exit(f"--kernels {args.kernels}: no recorded launch of these kernels")
    print(f"{len(recorder.launches)} distinct kernel configurations, compiling for sm_{args.arch} "
          f"with triton {triton.__version__}", flush=True)
    rows = compile_all(recorder.launches, recorder.labels, args.arch, max(1, args.jobs))
    failed = [r for r in rows if not r["ok"]]
    from common import write_result

    path = write_result(f"triton_compile_{triton.__version__}", {
        "arch": args.arch, "quick": args.quick, "kernels": args.kernels, "configurations": len(rows),
        "failed": len(failed),
        "max_registers": max((r["registers"] or 0) for r in rows if r["ok"]) if len(failed) < len(rows) else None,
        "spilling": sum(1 for r in rows if r.get("spill_store_bytes")), "rows": rows}, out=args.out)
    print(f"{len(rows) - len(failed)} of {len(rows)} compiled; wrote {path}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
