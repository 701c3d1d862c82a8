"""The C++ kernels' names for a stream's layout (ops/cpu/layout.py): generated from the Python declarations, part of
the build's hash, a static_assert on each count, and no state tensor, plan tensor or meta field read by position in
the hand-written sources."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import flashcodec_fx.ops.cpu.build as build
import flashcodec_fx.ops.cpu.layout as layout
import flashcodec_fx.ops.cpu.plan as cpu_plan
from flashcodec_fx.codecs import make_codec
from flashcodec_fx.ops.cpu.plan import CLASS_FIELDS, META_FIELDS, ROW_FIELDS, Plan, codec_plan, meta
from flashcodec_fx.ops.plan import stored_form_plan
from flashcodec_fx.ops.state import StreamState

CPU = Path(build.__file__).parent
ENUMS = {"StateField": ("State", StreamState._fields), "PlanField": ("Plan", Plan._fields),
         "MetaField": ("Meta", tuple(META_FIELDS)), "RowField": ("Row", ROW_FIELDS),
         "ClassField": ("Class", CLASS_FIELDS)}


def enums(text: str) -> dict[str, list[str]]:
    return {m.group(1): [e.strip() for e in m.group(2).split(",")]
            for m in re.finditer(r"enum (\w+) : int \{([^}]*)\};", text)}


def test_each_enum_is_its_declaration_in_order_with_its_count_asserted():
    text = layout.header()
    found = enums(text)
    assert set(found) == set(ENUMS)
    names = [name for values in found.values() for name in values]
    assert len(names) == len(set(names))  # no two fields share a C++ name
    for enum, (prefix, fields) in ENUMS.items():
        assert found[enum] == [layout.enumerator(prefix, f) for f in fields] + [f"k{prefix}Fields"]
        assert f"static_assert(k{prefix}Fields == {len(fields)}," in text
    assert found["StateField"][StreamState._fields.index("tail")] == "kStateTail"
    assert layout.enumerator("Class", "class_levels") == "kClassLevels"


def test_codec_meta_holds_each_meta_field_by_name_and_reads_it_from_its_place():
    text = layout.header()
    struct = text[text.index("struct CodecMeta {"):]
    for name, (ctype, _) in META_FIELDS.items():
        assert re.search(rf"^  {ctype} {name};$", struct, re.M)
        value = f"m[{layout.enumerator('Meta', name)}]"
        read = f"{name} = {value} != 0;" if ctype == "bool" else f"{name} = static_cast<{ctype}>({value});"
        assert read in struct
    for prefix, index, fields in (("Row", "j", ROW_FIELDS), ("Class", "k", CLASS_FIELDS)):
        for name in fields:
            assert f"  int {name}[kMaxRows];" in struct
            assert f"{name}[{index}] = static_cast<int>(m[{layout.enumerator(prefix, name)}]);" in struct


def test_the_meta_vector_follows_the_declarations():
    codec = make_codec("jpeg", block_size=4, keep_freqs=2, quant_bits=(4, 2), levels=("lloyd", "uniform"))
    plan = stored_form_plan(codec.spec, 16)
    values = codec_plan(plan.spec, 16, 4).meta.tolist()
    head = dict(zip(META_FIELDS, values, strict=False))
    assert head["jpeg"] == 1 and head["r"] == 4 and head["rows"] == 2 and head["sum_width"] == 4
    assert len(values) == len(META_FIELDS) + len(ROW_FIELDS) * plan.rows + len(CLASS_FIELDS) * plan.classes


def test_a_field_added_to_the_declaration_is_one_line(monkeypatch):
    """A throwaway field: one entry in META_FIELDS gives the meta vector its value in place, the header its
    enumerator, member and read, and the build a new name (the binary is rebuilt, never reused)."""
    before = build.build_name(build.source_text())
    plan = stored_form_plan(make_codec("png", block_size=4).spec, 16)
    fields = dict(META_FIELDS)
    fields["throwaway"] = ("int", lambda p, w: 7 * p.block_size)
    monkeypatch.setattr(cpu_plan, "META_FIELDS", fields)
    monkeypatch.setattr(layout, "META_FIELDS", fields)
    assert meta(plan, 8)[len(fields) - 1] == 28
    text = layout.header()
    assert "kMetaThrowaway, kMetaFields };" in text and f"static_assert(kMetaFields == {len(fields)}," in text
    assert "  int throwaway;" in text and "throwaway = static_cast<int>(m[kMetaThrowaway]);" in text
    assert build.build_name(build.source_text()) != before


def test_the_build_compiles_the_generated_header_first():
    source = build.source_text()
    assert source.startswith(layout.header())
    assert build.source_text((CPU / "bindings.cpp",)).startswith(layout.header())  # the vLLM plugin's build too


@pytest.mark.skipif(shutil.which(build.compiler()) is None, reason="no C++ compiler")
def test_the_static_asserts_catch_a_count_that_does_not_match(tmp_path):
    """The header compiles alone; a copy whose StateField enum lost a field (a stale or hand-edited header) does
    not: its static_assert names the declaration."""
    def compile_header(text: str) -> subprocess.CompletedProcess:
        path = tmp_path / "layout.cpp"
        path.write_text(text)
        return subprocess.run([build.compiler(), "-std=c++17", "-fsyntax-only", str(path)], capture_output=True,
                              text=True, timeout=120)

    text = layout.header()
    assert compile_header(text).returncode == 0
    stale = compile_header(text.replace(" kStateNorm,", ""))
    assert stale.returncode != 0 and "ops/state.py StreamState has 10 fields" in stale.stderr


def test_the_sources_address_state_and_plan_tensors_by_name():
    """No ``state[7]``, ``k_state[6]``, ``plan[4]`` or meta read by a running index in the hand-written C++ (names that
    only end in those letters, as ``best[4]``, are other arrays)."""
    positional = re.compile(r"\b(\w*_)?(state|st|plan)\[\d+\]|\bm\[i\+\+\]")
    for path in sorted(CPU.glob("*.[ch]*")):
        if path.suffix in (".h", ".cpp"):
            assert not positional.search(path.read_text()), path.name

