"""Building the CPU kernels: the one-time warning and the reference fallback, the FLASHCODEC_KERNELS switch, the
build cache (keyed by what the binary depends on, built once under a lock, loaded without a rebuild)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.utils.cpp_extension
from _cpu_cases import codec, filled

import flashcodec_fx.ops.cpu as cpu
import flashcodec_fx.ops.cpu.build as build
import flashcodec_fx.ops.cpu.launch as launch
from flashcodec_fx.ops.reference.append import append_reference
from flashcodec_fx.ops.reference.attention import codec_attention_reference


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


def test_build_key_is_what_the_binary_depends_on(monkeypatch):
    """The name changes with the sources, the flags, the compiler, torch and the CPU, and not with the Python
    environment's paths (two venvs with the same torch share a build)."""
    source = build.source_text()
    name = build.build_name(source)
    assert name == build.build_name(source) and name.startswith("flashcodec_cpu_")
    assert build.build_name(source + "\n// edit") != name
    monkeypatch.setattr(sys, "executable", "/elsewhere/venv/bin/python")
    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv")
    monkeypatch.setenv("VIRTUAL_ENV", "/elsewhere/venv")
    assert build.build_name(source) == name
    for attr, value in [("_cpu_flags", lambda: "another cpu"), ("cflags", lambda: ("-O2",)),
                        ("_compiler_version", lambda cxx: "g++ 99"), ("LDFLAGS", ("-lm",))]:
        with monkeypatch.context() as patch:
            patch.setattr(build, attr, value)
            assert build.build_name(source) != name, attr
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__version__", "0.0.1")
        assert build.build_name(source) != name


def test_isa_flags_are_native_and_nothing_else():
    x86 = "fpu sse2 avx avx2 fma f16c"
    assert build.isa_cflags("x86_64", x86) == ("-march=native",)
    assert build.isa_cflags("x86_64", x86 + " avx512f avx512bw") == ("-march=native", "-mprefer-vector-width=512")
    assert build.isa_cflags("aarch64", "fp asimd") == ("-mcpu=native",)
    assert build.isa_cflags("riscv64", "") == ()
    assert set(build.BASE_CFLAGS) <= set(build.cflags()) and "-fopenmp" in build.cflags()


def fake_compile(calls):
    def compile_fn(name, source, folder):
        calls.append(folder)
        (folder / f"{name}.so").write_text("binary")
        return "built module", folder / f"{name}.so"
    return compile_fn


def test_a_build_is_announced_published_and_then_loaded_as_it_is(monkeypatch, tmp_path, capfd):
    """The first call builds in a scratch folder, says so, and publishes cache_dir()/cpu_kernels/<name>/<name>.so;
    later calls load that binary without compiling or saying anything."""
    monkeypatch.setenv("FLASHCODEC_CACHE", str(tmp_path))
    loaded = []
    monkeypatch.setattr(build, "load_binary", lambda name, path: loaded.append(path) or "loaded module")
    calls = []
    assert build.compile_extension(fake_compile(calls)) == "built module"
    name = build.build_name(build.source_text())
    folder = tmp_path / "cpu_kernels" / name
    assert len(calls) == 1 and calls[0].parent == folder and not calls[0].exists()  # the scratch folder is gone
    assert (folder / f"{name}.so").read_text() == "binary" and (folder / "key.json").exists()
    assert f"{build.BUILDING} in {folder}" in capfd.readouterr().err
    assert build.compile_extension(fake_compile(calls)) == "loaded module"
    assert len(calls) == 1 and loaded == [folder / f"{name}.so"]
    assert build.BUILDING not in capfd.readouterr().err


def test_a_failed_build_publishes_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHCODEC_CACHE", str(tmp_path))

    def broken(name, source, folder):
        (folder / "half.o").write_text("")
        raise RuntimeError("compiler error (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        build.compile_extension(broken)
    folder = tmp_path / "cpu_kernels" / build.build_name(build.source_text())
    assert sorted(p.name for p in folder.iterdir()) == ["build.lock"]


def test_compile_sources_calls_load_inline_with_the_flags(monkeypatch, tmp_path):
    seen = {}

    def fake_load_inline(name, **kwargs):
        seen.update(kwargs, name=name)
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", fake_load_inline)
    assert build.compile_sources("flashcodec_cpu_x", "source", tmp_path) == ("module", tmp_path / "flashcodec_cpu_x.so")
    assert seen["build_directory"] == str(tmp_path) and seen["cpp_sources"] == ["source"]
    assert list(seen["extra_cflags"]) == list(build.cflags()) and list(seen["extra_ldflags"]) == list(build.LDFLAGS)


RACER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import flashcodec_fx.ops.cpu.build as build
    root = Path(sys.argv[1])
    (root / f"ready-{sys.argv[2]}").touch()
    while len(list(root.glob("ready-*"))) < 2:  # both processes call at the same moment
        time.sleep(0.01)

    def compile_fn(name, source, folder):
        with open(root / "compiles", "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(3)  # a build takes a while: the other process arrives meanwhile
        (folder / f"{name}.so").write_text(f"built by {os.getpid()}")
        return f"built by {os.getpid()}", folder / f"{name}.so"

    build.load_binary = lambda name, path: path.read_text()
    print("RESULT", build.compile_extension(compile_fn))
""")


def test_two_processes_building_at_once(tmp_path):
    """Two processes that need the kernels at the same moment: one builds (and says so), the other waits for the
    lock (and says so), then loads the first one's binary: one build, the same module for both."""
    env = {**__import__("os").environ, "FLASHCODEC_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    compiles = (tmp_path / "compiles").read_text().split()
    assert len(compiles) == 1
    results = [next(line for line in out.splitlines() if line.startswith("RESULT")) for out, _ in outs]
    assert results == [f"RESULT built by {compiles[0]}"] * 2
    errs = [err for _, err in outs]
    assert sum(build.BUILDING in err for err in errs) == 1 and sum(build.WAITING in err for err in errs) == 1
