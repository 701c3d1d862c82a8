"""`flashcodec_fx.kernel_report`: the kernel registry report reads torch's registry (what dispatch actually runs)."""

from __future__ import annotations

import importlib.util

import torch

from flashcodec_fx import kernel_report
from flashcodec_fx.ops import cpu


def test_cpu_tensors_run_the_cpu_kernels_where_they_exist():
    """codec_attention, append and append_attention run the C++ kernels of ``ops/cpu`` on CPU (unless
    ``FLASHCODEC_KERNELS=reference``), every other op the reference."""
    registry = kernel_report.kernel_registry()
    assert sorted(registry) == sorted(kernel_report.OPS)
    fast = cpu.kernel_mode() != "reference"
    want = {"flashcodec::codec_attention": ("flashcodec_fx.ops.cpu.launch.cpu_codec_attention" if fast
                                            else "flashcodec_fx.ops.reference.attention.codec_attention"),
            "flashcodec::append": ("flashcodec_fx.ops.cpu.launch.cpu_append" if fast
                                   else "flashcodec_fx.ops.reference.append.append"),
            "flashcodec::append_attention": (
                "flashcodec_fx.ops.cpu.launch.cpu_append_attention" if fast
                else "flashcodec_fx.ops.reference.append_attention.append_attention_reference")}
    for op, by_device in registry.items():
        if op in want:
            assert by_device["cpu"] == want[op]
        assert kernel_report.kernel_kind(by_device["cpu"]) == ("cpu" if fast and op in want else "reference"), op


def test_cuda_kernels_are_triton_exactly_where_triton_has_one():
    """With Triton, the ops of ``triton_gate.KERNELS`` (every op) run Triton on CUDA; without Triton, every op
    runs the reference."""
    registry = kernel_report.kernel_registry()
    triton = importlib.util.find_spec("triton") is not None
    on_triton = set()
    if triton:
        from flashcodec_fx.ops.triton import gate as triton_gate

        on_triton = set(triton_gate.KERNELS)
        assert on_triton == set(kernel_report.OPS)
        for op, fn in triton_gate.KERNELS.items():
            assert registry[op]["cuda"] == f"{fn.__module__}.{fn.__qualname__}"
    for op, by_device in registry.items():
        assert kernel_report.kernel_kind(by_device["cuda"]) == ("triton" if op in on_triton else "reference"), op
    why = kernel_report.kernel_report()["why"]["cuda"]
    for op in on_triton:
        assert op.split("::")[1] in why.split("; the plain-torch")[0]


def test_a_kernel_registered_for_cpu_shows_up(monkeypatch):
    """A device-specific registration is reported as such (the report is not a list kept by hand)."""
    @torch.library.custom_op("flashcodec_kernels_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    def compiled_twice(x: torch.Tensor) -> torch.Tensor:
        return x + x

    twice.register_kernel("cpu")(compiled_twice)
    monkeypatch.setattr(kernel_report, "OPS", ("flashcodec_kernels_test::twice",))
    registry = kernel_report.kernel_registry()["flashcodec_kernels_test::twice"]
    assert registry["cpu"].endswith("test_a_kernel_registered_for_cpu_shows_up.<locals>.compiled_twice")
    assert registry["cuda"].endswith("test_a_kernel_registered_for_cpu_shows_up.<locals>.twice")
    assert torch.equal(twice(torch.ones(2)), torch.full((2,), 2.0))


def test_report_says_why():
    report = kernel_report.kernel_report()
    fast = cpu.kernel_mode() != "reference"
    assert report["active"]["cpu"] == (["cpu", "reference"] if fast else ["reference"])
    assert ("CPU kernels registered: cpu, reference" if fast else "reference") in report["why"]["cpu"]
    assert ("CUDA device:" in report["why"]["cuda"]) == torch.cuda.is_available()
    assert report["triton"]["importable"] == (importlib.util.find_spec("triton") is not None)
    assert report["ops"]["flashcodec::read"]["cpu"] == {"kernel": "flashcodec_fx.ops.reference.read.read", "kind": "reference"}
