"""The quick subset (``-m "not slow"``, docs/testing.md): the ``slow`` marker is registered, every entry of
``conftest.SLOW`` names a test that exists, the marks land on exactly those tests, and every test folder keeps quick
tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import SLOW, pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[1]


def test_the_slow_marker_is_registered():
    tomllib = pytest.importorskip("tomllib")
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(marker.startswith("slow:") for marker in markers)


@pytest.mark.parametrize("entry", SLOW)
def test_each_slow_entry_names_a_test_that_exists(entry):
    path, _, name = entry.partition("::")
    assert (ROOT / path).is_file(), f"{path}: no such test module (update conftest.SLOW)"
    if name:
        function = re.split(r"[\[:]", name)[0]
        assert re.search(rf"^\s*(def|class) {re.escape(function)}\b", (ROOT / path).read_text(), re.M), entry


def test_every_test_folder_keeps_quick_tests():
    whole = {entry for entry in SLOW if "::" not in entry}
    folders = {path.parent for path in (ROOT / "tests").rglob("test_*.py")}
    for folder in folders:
        modules = {str(path.relative_to(ROOT)) for path in folder.glob("test_*.py")}
        assert modules - whole, f"every module of {folder.relative_to(ROOT)} is slow: the quick subset misses it"


class Item:
    def __init__(self, nodeid):
        self.nodeid, self.markers = nodeid, []

    def add_marker(self, marker):
        self.markers.append(marker.name)


def test_the_marks_land_on_the_listed_modules_tests_and_cases_only():
    test = "tests/hf/test_hf_view_exact.py::test_a_compiled_update_returns_the_same_views"
    assert test in SLOW and "tests/hf/test_hf_assisted.py" in SLOW
    items = [Item(f"{test}[4bit]"), Item(test), Item(f"{test}_elsewhere"), Item("tests/hf/test_hf_assisted.py::test_x[a]"),
             Item("tests/hf/test_hf_assisted_more.py::test_x"), Item("tests/hf/test_hf_cache.py::test_y")]
    pytest_collection_modifyitems(None, items)
    assert [item.markers for item in items] == [["slow"], ["slow"], [], ["slow"], [], []]
