"""Which kernel serves each ``torch.ops.flashcodec`` op on CPU and on CUDA, and why (read from torch's registry).

``flashcodec_fx.ops`` registers the plain-torch reference of every op as its default kernel (every device) and,
when Triton imports, the Triton launchers as the CUDA kernels. The answer comes from torch's op registry, not from a
list kept by hand, so any other device-specific kernel (a compiled CPU kernel, say) shows up here as well.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from . import ops  # noqa: F401  (ops: registers every kernel)
from .ops.reference import op_kernels

OPS = tuple(f"flashcodec::{name}" for name in ("encode", "decode", "append", "read", "codec_attention",
                                               "append_attention"))
DEVICES = ("cpu", "cuda")


def kernel_kind(function: str) -> str:
    """``"triton"``, ``"cpu"`` (the C++ kernels of ``ops/cpu``), ``"reference"`` (plain torch, the spec) or the
    kernel's full name for anything else."""
    if function.startswith("flashcodec_fx.ops.triton."):
        return "triton"
    if function.startswith("flashcodec_fx.ops.cpu."):
        return "cpu"
    return "reference" if function.startswith("flashcodec_fx.ops.") else function


def _qualified(fn: Any) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def kernel_registry() -> dict[str, dict[str, str]]:
    """``{op: {device: "module.function"}}`` for every flashcodec op on ``cpu`` and ``cuda``: the kernel torch
    dispatches a tensor of that device to (a device-specific registration, else the op's default kernel)."""
    registry = {}
    for op in OPS:
        kernels = op_kernels(op)
        registry[op] = {device: _qualified(kernels.get(device, kernels[None])) for device in DEVICES}
    return registry


def triton_status() -> dict[str, Any]:
    """``{"importable", "version", "why"}`` of Triton in this environment."""
    if importlib.util.find_spec("triton") is None:
        return {"importable": False, "version": None, "why": "Triton is not installed (pip install 'flashcodec-fx[triton]')"}
    try:
        import triton
    except ImportError as err:
        return {"importable": False, "version": None, "why": f"Triton does not import: {err}"}
    return {"importable": True, "version": triton.__version__, "why": f"Triton {triton.__version__} imports"}


def kernel_report() -> dict[str, Any]:
    """The registry with each kernel's kind per device, Triton and CUDA status, and one line per device saying why
    those kernels are the active ones."""
    registry = kernel_registry()
    kinds = {device: sorted({kernel_kind(kernels[device]) for kernels in registry.values()}) for device in DEVICES}
    triton = triton_status()
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if kinds["cpu"] == ["reference"]:
        cpu_why = "no CPU kernel is registered: the plain-torch reference (the spec) serves CPU tensors"
    else:
        cpu_why = f"CPU kernels registered: {', '.join(kinds['cpu'])}"
    on_triton = [op.split("::")[1] for op, kernels in registry.items() if kernel_kind(kernels["cuda"]) == "triton"]
    if on_triton:
        others = [op.split("::")[1] for op in registry if op.split("::")[1] not in on_triton]
        cuda_why = (f"{triton['why']}: Triton kernels serve {', '.join(on_triton)} on CUDA devices of compute "
                    f"capability >= 8.0 (older ones run the reference)")
        if others:
            cuda_why += f"; the plain-torch reference serves {', '.join(others)} on CUDA too"
    else:
        cuda_why = f"{triton['why']}: the reference serves CUDA tensors too"
    cuda_why += f"; CUDA device: {cuda}" if cuda else "; no CUDA device on this machine"
    return {"ops": {op: {device: {"kernel": name, "kind": kernel_kind(name)} for device, name in kernels.items()}
                    for op, kernels in registry.items()},
            "active": kinds, "why": {"cpu": cpu_why, "cuda": cuda_why}, "triton": triton, "cuda_device": cuda}
