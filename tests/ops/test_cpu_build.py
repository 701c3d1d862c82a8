"""Building the CPU kernels: the one-time warning and the reference fallback, the FLASHCODEC_KERNELS switch, the
build cache key."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.cpp_extension
from _cpu_cases import codec, filled

import flashcodec_fx.ops.cpu as cpu
import flashcodec_fx.ops.cpu.build as build
import flashcodec_fx.ops.cpu.launch as launch
from flashcodec_fx.ops.append import append_reference
from flashcodec_fx.ops.attention import codec_attention_reference


def failed_build():
    raise OSError("no C++ compiler found (simulated)")


def test_a_failed_build_warns_once_and_reports_why():
    ext = build.Extension(failed_build)
    with pytest.warns(RuntimeWarning, match="could not be built.*no C\\+\\+ compiler"):
        assert ext.module() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ext.module() is None  # no second warning, no second attempt
    assert "no C++ compiler" in ext.error


def test_the_launchers_run_the_reference_when_the_build_failed(monkeypatch):
    failed = build.Extension(failed_build)
    with pytest.warns(RuntimeWarning):
        failed.module()
    monkeypatch.setattr(launch, "EXTENSION", failed)
    c = codec("channel-key")
    x = torch.randn(1, 2, 30, 16)
    state, ref = filled(c, x, [29]), filled(c, x, [29])
    launch.cpu_append(state, x[:, :, 29:], c.spec)
    append_reference(ref, x[:, :, 29:], c.spec)
    assert all(torch.equal(a, b) for a, b in zip(state, ref, strict=True))
    q = torch.randn(1, 4, 1, 16)
    assert torch.equal(launch.cpu_codec_attention(q, state, state, c.spec, c.spec),
                       codec_attention_reference(q, state, state, c.spec, c.spec))


def registered(monkeypatch, mode: str | None) -> list[str]:
    """The ops ``register()`` registers CPU kernels for under ``FLASHCODEC_KERNELS=mode``."""
    calls = []
    monkeypatch.setattr(torch.library, "register_kernel", lambda op, device, fn: calls.append((op, device)))
    if mode is None:
        monkeypatch.delenv(cpu.ENV, raising=False)
    else:
        monkeypatch.setenv(cpu.ENV, mode)
    cpu.register()
    return calls


def test_switch_reference_keeps_the_reference_ops(monkeypatch):
    assert registered(monkeypatch, "reference") == []


def test_switch_auto_registers_both_kernels_without_building(monkeypatch):
    never = build.Extension(lambda: pytest.fail("auto must build on first use, not at registration"))
    monkeypatch.setattr(cpu, "EXTENSION", never)
    want = [("flashcodec::codec_attention", "cpu"), ("flashcodec::append", "cpu")]
    assert registered(monkeypatch, None) == registered(monkeypatch, "auto") == want


def test_switch_fast_refuses_a_failed_build(monkeypatch):
    failed = build.Extension(failed_build)
    monkeypatch.setattr(cpu, "EXTENSION", failed)
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="FLASHCODEC_KERNELS=fast.*no C\\+\\+ compiler"):
        registered(monkeypatch, "fast")


def test_switch_rejects_unknown_values(monkeypatch):
    with pytest.raises(ValueError, match="FLASHCODEC_KERNELS must be one of"):
        registered(monkeypatch, "fastest")


def test_build_name_changes_with_the_source_and_the_cpu(monkeypatch):
    source = build.source_text()
    name = build.build_name(source)
    assert name == build.build_name(source) and name.startswith("flashcodec_cpu_")
    assert build.build_name(source + "\n// edit") != name
    monkeypatch.setattr(build, "_cpu_flags", lambda: "another cpu")
    assert build.build_name(source) != name


def test_the_cache_folder_is_the_user_cache(monkeypatch, tmp_path):
    """The build goes to cache_dir()/cpu_kernels/<name> ($FLASHCODEC_CACHE here), created on demand."""
    monkeypatch.setenv("FLASHCODEC_CACHE", str(tmp_path))
    seen = {}

    def fake_load_inline(name, **kwargs):
        seen.update(kwargs, name=name)
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", fake_load_inline)
    assert build.compile_extension() == "module"
    assert seen["build_directory"] == str(tmp_path / "cpu_kernels" / seen["name"])
    assert list(seen["extra_cflags"]) == list(build.CFLAGS) and "-fopenmp" in seen["extra_cflags"]
