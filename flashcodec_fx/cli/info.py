"""``flashcodec info``: versions, the device, and which kernel serves each op on CPU and on CUDA, and why."""

from __future__ import annotations

import argparse
import json
import os
import platform
from typing import Any

from .. import _compat

VERSIONED = ("torch", "transformers", "triton", "gradio", "tqdm")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("info", help="versions, device, active kernels (CPU and CUDA) and why",
                                   description=__doc__)
    parser.add_argument("--json", action="store_true", help="print everything as one JSON object")
    parser.set_defaults(handler=run)


def collect() -> dict[str, Any]:
    """Everything ``info`` prints: versions (None: not installed) against the floors and transformers' tested range,
    warnings (a version outside them), device, kernel report."""
    import torch

    from .. import __version__
    from ..kernel_report import kernel_report
    from ..provenance import version

    floors = {"torch": _compat.TORCH_FLOOR, "transformers": _compat.TRANSFORMERS_FLOOR, "triton": _compat.TRITON_FLOOR}
    return {
        "versions": {"flashcodec_fx": __version__, "python": platform.python_version(),
                     **{dist: version(dist) for dist in VERSIONED}},
        "floors": {dist: ".".join(map(str, floor)) for dist, floor in floors.items()},
        "tested": {"transformers": " .. ".join(".".join(map(str, end)) for end in _compat.TRANSFORMERS_TESTED)},
        "warnings": [w for w in (_compat.transformers_untested(_compat.TRANSFORMERS),) if w is not None],
        "device": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                   "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                   "torch_cuda_build": torch.version.cuda},
        "generate_cache_keyword": _compat.GENERATE_CACHE_KWARG,
        "kernels": kernel_report(),
    }


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    versions, floors, tested = report["versions"], report["floors"], report["tested"]
    print("versions")
    for dist, have in versions.items():
        floor = f" (tested {tested[dist]})" if dist in tested else f" (needs >= {floors[dist]})" if dist in floors else ""
        print(f"  {dist:<14} {have or 'not installed'}{floor}")
    for warning in report["warnings"]:
        print(f"WARNING: {warning}")
    device = report["device"]
    build = f"for CUDA {device['torch_cuda_build']}" if device["torch_cuda_build"] else "CPU-only"
    print(f"device\n  CPU: {device['cpu_count']} cores, torch uses {device['torch_threads']} threads"
          f"\n  CUDA: {device['cuda'] or 'none'} (torch built {build})")
    print(f"transformers cache keyword of generate(): {report['generate_cache_keyword']}=")
    kernels = report["kernels"]
    print("kernels (torch.ops.flashcodec)")
    for device_name in ("cpu", "cuda"):
        print(f"  {device_name}: {', '.join(kernels['active'][device_name])}: {kernels['why'][device_name]}")
        for op, by_device in kernels["ops"].items():
            print(f"    {op:<28} {by_device[device_name]['kernel']}")
    return 0
