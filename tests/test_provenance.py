"""provenance.metadata: what every JSON result records about where it was measured."""

from __future__ import annotations

import json

from flashcodec_fx import provenance


def test_metadata_records_machine_versions_and_commit():
    meta = provenance.metadata()
    machine = meta["machine"]
    assert machine["cpu_count"] >= 1 and machine["torch_threads"] >= 1
    simd = machine["cpu_simd"]
    assert simd is None or set(simd) <= set(provenance.SIMD_FLAGS)
    assert meta["versions"]["torch"] is not None
    assert set(provenance.git_state()) == {"git_commit", "git_dirty"}


def test_cpu_simd_reads_the_flags_line(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma avx512f amx_tile\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path,
                                                                         *a, **k))
    assert provenance.cpu_simd() == ["avx2", "fma", "avx512f", "amx_tile"]


def test_write_json_prefixes_the_metadata(tmp_path):
    path = provenance.write_json(tmp_path / "sub" / "r.json", "demo", {"rows": [1]})
    stored = json.loads(path.read_text())
    assert stored["benchmark"] == "demo" and stored["rows"] == [1]
    assert "cpu_simd" in stored["machine"] and "date" in stored


def test_cpu_simd_is_none_without_cpuinfo(tmp_path, monkeypatch):
    real_open = open
    missing = tmp_path / "absent"
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(missing if path == "/proc/cpuinfo" else path,
                                                                         *a, **k))
    assert provenance.cpu_simd() is None
