"""The CUDA registration's capability gate and the codec matrices made when a stream is allocated (CPU: faked)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _triton_cases import DEVICES, codec, smooth, stored_state, to

from flashcodec_fx import CodecStream
from flashcodec_fx.ops import triton_register
from flashcodec_fx.ops.triton_common import _matrices, codec_matrices


@pytest.fixture
def fake_capability(monkeypatch):
    """``set(index -> (major, minor))`` replaces the CUDA capability query; the per-device choice cache is reset."""
    table = {}
    monkeypatch.setattr(triton_register, "_capability", lambda index: table[index])
    triton_register.kernel_choice.cache_clear()
    yield table.update
    triton_register.kernel_choice.cache_clear()


def test_devices_below_sm80_get_the_reference_with_one_warning(fake_capability):
    fake_capability({0: (7, 5), 1: (9, 0), 2: (8, 0)})
    with pytest.warns(triton_register.OldGPUFallback, match="cuda:0 has compute capability 7.5.*8.0 or newer"):
        assert triton_register.kernel_choice(torch.device("cuda", 0)) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cached per device: no second warning, no second query
        assert triton_register.kernel_choice(torch.device("cuda", 0)) == "reference"
        assert triton_register.kernel_choice(torch.device("cuda", 1)) == "triton"
        assert triton_register.kernel_choice(torch.device("cuda", 2)) == "triton"


@pytest.mark.parametrize("device", DEVICES)
def test_the_gated_kernel_runs_what_the_choice_says(monkeypatch, device):
    """The registered CUDA kernel dispatches per call on the tensor's device; called here directly with the choice
    forced: "reference" runs the plain-torch op, "triton" the launcher (bit for bit each)."""
    from flashcodec_fx.ops.attention import codec_attention
    from flashcodec_fx.ops.triton_attention import triton_codec_attention

    ck, cv = codec("jpeg_k8_int8"), codec("png")
    ks, vs = stored_state(ck, smooth(1, 2, 21, 16, torch.float32, "cpu", 1), 4), \
        stored_state(cv, smooth(1, 2, 21, 16, torch.float32, "cpu", 2), 4)
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(0))
    args = (*to(device, q, *ks[:4], *vs[:4], ks[4]), ck.spec, cv.spec)
    reference = codec_attention._init_fn
    kernel = triton_register.gated(triton_codec_attention, reference)
    assert kernel.__qualname__ == "triton_codec_attention"  # the kernel report names the launcher
    monkeypatch.setattr(triton_register, "kernel_choice", lambda device: "reference")
    assert torch.equal(kernel(*args), reference(*args))
    monkeypatch.setattr(triton_register, "kernel_choice", lambda device: "triton")
    assert torch.equal(kernel(*args), triton_codec_attention(*args))


def test_a_stream_creates_its_codec_matrices_when_it_allocates():
    """The first kernel call inside a CUDA-graph capture must find the codec matrices on the device already: the
    stream creates them with its storage, and the kernels' lookup returns those very tensors."""
    c = codec("jpeg_k3")
    _matrices.cache_clear()
    stream = CodecStream(c, "static", max_length=32)
    assert _matrices.cache_info().currsize == 0
    stream.append(smooth(1, 2, 5, 16, torch.float32, "cpu", 0))
    assert _matrices.cache_info().currsize == 1
    made = _matrices(tuple(c.spec), torch.device("cpu"))
    assert all(a is b for a, b in zip(codec_matrices(c, "cpu"), made, strict=True))
    assert _matrices.cache_info().misses == 1  # no second creation
