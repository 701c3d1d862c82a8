"""Compile every Triton kernel configuration for a GPU target without a GPU: API drift shows on a CPU machine.

The launchers (`flashcodec_fx.ops.triton_*`) are called on CPU tensors with ``JITFunction.run`` replaced by a
recorder, so every launch they would make (kernel, argument types, constexprs, num_warps / num_stages) is
collected exactly as they build it; each distinct one is then compiled with ``triton.compile`` for
``GPUTarget("cuda", <arch>, 32)`` (ptxas included, bundled with triton) and ptxas' register / spill / shared
memory report is read back. Nothing runs on a device. Run it without ``TRITON_INTERPRET`` (the interpreter replaces
the compiler).

    python benchmarks/triton_compile.py --quick    # one configuration per code path (CI, both triton versions)
    python benchmarks/triton_compile.py            # every pair x bf16/fp16/fp32 x D=64/128, GQA 1/4/8, T=1/4, masks

Exit status 1 when a configuration fails to compile; the JSON (``--out``) lists every configuration.
"""

from __future__ import annotations

import argparse
import itertools
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
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402

from flashcodec_fx import PRESETS  # noqa: E402
from flashcodec_fx.codecs import make_codec  # noqa: E402
from flashcodec_fx.hf.options import resolve_layer_codecs  # noqa: E402
from flashcodec_fx.ops import empty_state  # noqa: E402
from flashcodec_fx.ops.triton_attention import triton_codec_attention  # noqa: E402

# Stored forms beyond the presets (every code path of the kernels): float jpeg with dropped coefficients, pruned png
# (r=8 and its limit r=16), channel-axis codes whose scale group is one block (no fold: dequantized in registers),
# value blocks at an offset inside the tiles (other sinks), lloyd and uniform rows in one table with a rotation.
FORMS = {
    "jpeg_k3": ("jpeg", {"block_size": 8, "keep_freqs": 3}),
    "png_pruned": ("png", {"block_size": 8, "keep_ratio": 0.5}),
    "png_r16_pruned": ("png", {"block_size": 16, "keep_ratio": 0.5}),
    "channel_unfolded": ("jpeg", {"block_size": 8, "quant_bits": (3, 2, 2, 1, 1, 1, 1, 1), "levels": ("int", "midrise"),
                                  "scale_axis": "channel", "group": 8, "sinks": 3}),
    "token_offset": ("jpeg", {"block_size": 4, "quant_bits": 3, "levels": "midrise", "sinks": 1, "window": 5}),
    "mixed_rotated": ("jpeg", {"block_size": 2, "quant_bits": (6, 3), "levels": ("lloyd", "uniform"), "rotate": 3,
                               "center": True}),
}

LAUNCH_OPTIONS = ("num_warps", "num_stages")


class Recorder:
    """Replaces ``JITFunction.run``: each launch becomes (kernel, signature, constexprs, options), deduplicated."""

    def __init__(self):
        self.launches: dict[str, tuple] = {}

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
        key = f"{fn.__name__} {sorted(signature.items())} {sorted((k, str(v)) for k, v in constexprs.items())} {options}"
        self.launches.setdefault(key, (fn, signature, constexprs, options))


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
    value blocks sit at an offset)."""
    out = {}
    for name, options in PRESETS.items():
        layer = resolve_layer_codecs(options, layer_idx=1)
        out[f"preset {name}"] = (layer.key, layer.value)
    forms = {name: make_codec(mode, **opts) for name, (mode, opts) in FORMS.items()}
    out |= {f"{name}/{name}": (c, c) for name, c in forms.items()}
    out["jpeg_k3/png_pruned"] = (forms["jpeg_k3"], forms["png_pruned"])
    out["channel_unfolded/token_offset"] = (forms["channel_unfolded"], forms["token_offset"])
    return out


def launch_everything(quick: bool) -> None:
    """Call every launcher over the configuration grid (CPU tensors; the recorder catches the launches). Quick: one
    configuration per code path (each pair in bf16 at D=128 with a bool mask, the presets also with fp32 ``ieee``
    dots and with new tokens + an additive mask)."""
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    dims = [128] if quick else [128, 64]
    for name, (ck, cv) in pairs().items():
        for dtype, d in itertools.product(dtypes, dims):
            if quick:
                _attention(ck, cv, dtype, d, 4, 1, "bool")
                if name.startswith("preset"):
                    _attention(ck, cv, torch.float32, d, 4, 1, None)
                    _attention(ck, cv, dtype, d, 4, 4, "additive", new=True)
                continue
            for g, t, mask_kind in itertools.product([1, 4, 8], [1, 4], [None, "bool", "additive"]):
                _attention(ck, cv, dtype, d, g, t, mask_kind, new=t > 1)


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


def compile_all(launches: dict, arch: int) -> list[dict]:
    target = GPUTarget("cuda", arch, 32)
    rows = []
    for fn, signature, constexprs, options in launches.values():
        row = {"kernel": fn.__name__, **options,
               "constexprs": {k: str(v) for k, v in constexprs.items()},
               "pointers": {k: v for k, v in signature.items() if v.startswith("*")}}
        start = time.perf_counter()
        try:
            src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
            kernel = triton.compile(src, target=target, options=options)
            row.update(ok=True, shared_bytes=kernel.metadata.shared, **_ptxas_report(kernel.asm["ptx"], arch))
        except Exception as err:  # recorded and counted: a failure here is what this check exists to find
            row.update(ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        row["compile_s"] = round(time.perf_counter() - start, 2)
        rows.append(row)
        status = "ok" if row["ok"] else "FAILED " + row["error"]
        print(f"{fn.__name__:16s} {row.get('registers')} regs, {row.get('spill_store_bytes')} B spilled, "
              f"{row.get('shared_bytes')} B shared, {row['compile_s']} s: {status}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one configuration per code path (see launch_everything)")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (default 90: H100/H200)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/triton_compile_<triton version>.json)")
    args = parser.parse_args()
    with Recorder() as recorder:
        launch_everything(args.quick)
    print(f"{len(recorder.launches)} distinct kernel configurations, compiling for sm_{args.arch} "
          f"with triton {triton.__version__}", flush=True)
    rows = compile_all(recorder.launches, args.arch)
    failed = [r for r in rows if not r["ok"]]
    from common import write_result

    path = write_result(f"triton_compile_{triton.__version__}", {
        "arch": args.arch, "quick": args.quick, "configurations": len(rows), "failed": len(failed),
        "max_registers": max((r["registers"] or 0) for r in rows if r["ok"]) if len(failed) < len(rows) else None,
        "spilling": sum(1 for r in rows if r.get("spill_store_bytes")), "rows": rows}, out=args.out)
    print(f"{len(rows) - len(failed)} of {len(rows)} compiled; wrote {path}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
