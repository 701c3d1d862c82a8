"""`flashcodec_fx.kernels`: the kernel registry report reads torch's registry (what dispatch actually runs)."""

from __future__ import annotations

import importlib.util

import torch

from flashcodec_fx import kernels


def test_cpu_tensors_run_the_reference_kernels():
    registry = kernels.kernel_registry()
    assert sorted(registry) == sorted(kernels.OPS)
    assert registry["flashcodec::codec_attention"]["cpu"] == "flashcodec_fx.ops.attention.codec_attention"
    assert registry["flashcodec::append"]["cpu"] == "flashcodec_fx.ops.append.append"
    assert all(kernels.kernel_kind(k["cpu"]) == "reference" for k in registry.values())


def test_cuda_kernels_are_triton_exactly_when_triton_imports():
    registry = kernels.kernel_registry()
    triton = importlib.util.find_spec("triton") is not None
    for op, by_device in registry.items():
        assert kernels.kernel_kind(by_device["cuda"]) == ("triton" if triton else "reference"), op
    if triton:
        from flashcodec_fx.ops import triton_register

        assert {op: f"{fn.__module__}.{fn.__qualname__}" for op, fn in triton_register.KERNELS.items()} == \
            {op: by_device["cuda"] for op, by_device in registry.items()}


def test_a_kernel_registered_for_cpu_shows_up(monkeypatch):
    """A device-specific registration is reported as such (the report is not a list kept by hand)."""
    @torch.library.custom_op("flashcodec_kernels_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    def compiled_twice(x: torch.Tensor) -> torch.Tensor:
        return x + x

    twice.register_kernel("cpu")(compiled_twice)
    monkeypatch.setattr(kernels, "OPS", ("flashcodec_kernels_test::twice",))
    registry = kernels.kernel_registry()["flashcodec_kernels_test::twice"]
    assert registry["cpu"].endswith("test_a_kernel_registered_for_cpu_shows_up.<locals>.compiled_twice")
    assert registry["cuda"].endswith("test_a_kernel_registered_for_cpu_shows_up.<locals>.twice")
    assert torch.equal(twice(torch.ones(2)), torch.full((2,), 2.0))


def test_report_says_why():
    report = kernels.kernel_report()
    assert report["active"]["cpu"] == ["reference"]
    assert "reference" in report["why"]["cpu"]
    assert ("CUDA device:" in report["why"]["cuda"]) == torch.cuda.is_available()
    assert report["triton"]["importable"] == (importlib.util.find_spec("triton") is not None)
    assert report["ops"]["flashcodec::read"]["cpu"] == {"kernel": "flashcodec_fx.ops.read.read", "kind": "reference"}
