"""What README.md and docs/*.md name exists: files, relative links, ``flashcodec_fx`` symbols, ops, environment
variables, classes.

- a path in backticks (``ops/cpu/launch.py``, ``benchmarks/bench_e2e.py --quick``, ``test_cache.py::test_x``) or
  spelled out from the repository root (``tests/hf/...``) is a file of the repository: a path relative to the
  package, or a bare file name, names some file ending so; ``file.py::name`` and ``file.py``'s ``name`` define
  ``name`` there;
- a relative markdown link ``[text](path#anchor)`` resolves from the document's folder, and its anchor (also a
  same-page ``(#anchor)``) is the GitHub slug of a heading of the markdown file it names;
- ``flashcodec_fx.a.b`` / ``fx.b`` resolve by import and ``getattr``; ``torch.ops.flashcodec.x`` is a defined op;
- a ``FLASHCODEC_*`` variable is read somewhere in the code;
- a CamelCase name in backticks is defined or imported somewhere in the code (``EXTERNAL``: the few named only in
  prose, from other libraries).
"""

from __future__ import annotations

import functools
import importlib
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_DIRS = {".git", "__pycache__", "node_modules", "build", "dist"}
CODE_SUFFIXES = (".py", ".h", ".cpp", ".sh", ".toml", ".cfg", ".yml", ".yaml")
FILE_SUFFIXES = r"py|h|cpp|md|json|toml|sh|png|txt|jsonl|safetensors|yml|yaml"

TICKED = re.compile(r"`([^`\n]+)`")
PATH = re.compile(rf"(?<![\w./-])([\w.-]+(?:/[\w.-]+)*\.(?:{FILE_SUFFIXES}))(?:::(\w+))?(?![\w/-])")
ROOTED = re.compile(rf"(?<![\w./`-])((?:flashcodec_fx|tests|benchmarks|demo|docs)/[\w./-]+\.(?:{FILE_SUFFIXES}))\b")
OWNED = re.compile(r"`([\w/.-]+\.(?:py|h|cpp))`(?:'s| \()\s*`(\w+)`")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)|!\[[^\]\n]*\]\(([^)\s]+)\)")
DOTTED = re.compile(r"^(flashcodec_fx|fx|torch\.ops\.flashcodec)((?:\.\w+)+)")
ENV = re.compile(r"\bFLASHCODEC_[A-Z0-9_]+\b")
CAMEL = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")
# CamelCase names the docs take from other libraries that the code does not name: the module defining each (checked;
# one that the code names needs no entry).
EXTERNAL = {
    "FailOnRecompileLimitHit": "torch._dynamo.exc",
}


@functools.cache
def repository_files() -> tuple[str, ...]:
    """Every file of the checkout (posix paths from the root), virtual environments and caches excluded."""
    out = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if path.is_file() and not any(part in SKIP_DIRS or part.startswith(".") for part in rel.parts):
            out.append(rel.as_posix())
    return tuple(sorted(out))


@functools.cache
def code_text() -> str:
    """The source of the package, tests, benchmarks and demo (and pyproject.toml), concatenated."""
    this = Path(__file__).relative_to(ROOT).as_posix()  # it names what does not exist, to show the checks fail
    return "\n".join((ROOT / rel).read_text(errors="replace") for rel in repository_files()
                     if rel.endswith(CODE_SUFFIXES) and not rel.startswith("docs/") and rel != this)


def matching_files(name: str) -> list[str]:
    """Files of the checkout whose path is ``name`` or ends with ``/name``."""
    name = name.removeprefix("./")
    return [rel for rel in repository_files() if rel == name or rel.endswith("/" + name)]


def defines(rel: str, name: str) -> bool:
    text = (ROOT / rel).read_text(errors="replace")
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|\b{name}\s*\(", text, re.M) is not None


def doc_id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def ticked(path: Path) -> list[str]:
    return TICKED.findall(path.read_text())


def file_names(path: Path) -> list[tuple[str, str | None]]:
    """``(file, symbol)`` named in ``path``: paths inside backticks, and root-relative paths anywhere."""
    text = path.read_text()
    found = [(m.group(1), m.group(2)) for tick in TICKED.findall(text) if not re.search(r"[<>{}*]|://", tick)
             for m in PATH.finditer(tick)]
    found += [(m.group(1), None) for m in ROOTED.finditer(TICKED.sub("", text))]
    return found


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_named_files_exist(path):
    missing = [f"{name}::{symbol}" if symbol else name for name, symbol in file_names(path)
               if not matching_files(name)
               or (symbol is not None and not any(defines(rel, symbol) for rel in matching_files(name)))]
    assert not missing, f"{doc_id(path)} names files (or test functions) that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_named_functions_are_defined_in_their_files(path):
    wrong = [f"{name}: {symbol}" for name, symbol in OWNED.findall(path.read_text())
             if matching_files(name) and not any(defines(rel, symbol) for rel in matching_files(name))]
    assert not wrong, f"{doc_id(path)} places names in files that do not define them: {wrong}"


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of markdown file ``path``'s headings (outside code fences)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return frozenset(slug(m.group(1)) for m in re.finditer(r"^#{1,6} +(.+?) *$", text, re.M))


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_relative_links_resolve(path):
    broken = []
    for match in LINK.finditer(path.read_text()):
        target, _, anchor = (match.group(1) or match.group(2)).partition("#")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # a URL
            continue
        linked = path.parent / target if target else path
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{doc_id(path)} links to paths that do not exist: {broken}"


def resolves(dotted: str) -> bool:
    """``flashcodec_fx.a.b`` (``fx.`` = ``flashcodec_fx.``) by import then attributes; ``torch.ops.flashcodec.x``."""
    head, rest = DOTTED.match(dotted).groups()
    parts = [p for p in rest.split(".") if p]
    if head == "torch.ops.flashcodec":
        importlib.import_module("flashcodec_fx.ops")
        return hasattr(torch.ops.flashcodec, parts[0])
    module, names = "flashcodec_fx", list(parts)
    while names and ((ROOT / module.replace(".", "/") / names[0]).is_dir()
                     or (ROOT / module.replace(".", "/") / f"{names[0]}.py").is_file()):
        module = f"{module}.{names.pop(0)}"
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as err:  # an optional dependency (vLLM in its own venv): the name in the source
        if err.name == module or err.name.startswith("flashcodec_fx"):
            return False
        source = ROOT / module.replace(".", "/")
        source = source / "__init__.py" if source.is_dir() else source.with_suffix(".py")
        return not names or defines(source.relative_to(ROOT).as_posix(), names[0])
    for name in names:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_named_symbols_resolve(path):
    dotted = {m.group(0) for tick in ticked(path) for m in [DOTTED.match(tick.split("(")[0].strip())] if m}
    unresolved = sorted(d for d in dotted if not resolves(d))
    assert not unresolved, f"{doc_id(path)} names symbols that do not resolve: {unresolved}"


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_named_environment_variables_are_read(path):
    unread = sorted({v for v in ENV.findall(path.read_text()) if not re.search(rf"\b{v}\b", code_text())})
    assert not unread, f"{doc_id(path)} names environment variables no code reads: {unread}"


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_named_classes_exist(path):
    names = {tick.strip() for tick in ticked(path) if CAMEL.match(tick.strip())}
    unknown = sorted(n for n in names - set(EXTERNAL) if not re.search(rf"\b{n}\b", code_text()))
    assert not unknown, f"{doc_id(path)} names classes the code does not define or use: {unknown}"


@pytest.mark.parametrize(("name", "module"), sorted(EXTERNAL.items()))
def test_external_names_exist_where_listed_and_the_code_does_not_name_them(name, module):
    assert hasattr(importlib.import_module(module), name)
    assert not re.search(rf"\b{name}\b", code_text()), f"the code names {name}: delete its EXTERNAL entry"


def test_architecture_lists_the_state_fields_in_their_order():
    from flashcodec_fx.ops.state import StreamState

    listed = re.search(r"in its field order: (.*?)\.", (ROOT / "docs/architecture.md").read_text(), re.S)
    assert listed is not None and re.findall(r"`(\w+)`", listed.group(1)) == list(StreamState._fields)


def test_the_checks_can_fail(tmp_path):
    """Each check rejects a document naming what does not exist."""
    doc = tmp_path / "bad.md"
    doc.write_text("See `passes/lowering.py`'s `codec_attention_fused`, `tests/test_lowering.py`, [x](nowhere.md), "
                   "`flashcodec_fx.hf.attention.StepStatus`, `fx.NoSuchThing`, `torch.ops.flashcodec.lower`, "
                   "FLASHCODEC_LOWER and `StepStatusRecord`; `hf/layer.py`'s `no_such_function`; [y](#no-such-heading).\n\n"
                   "# A heading")
    assert {name for name, _ in file_names(doc)} >= {"passes/lowering.py", "tests/test_lowering.py"}
    assert not matching_files("passes/lowering.py") and not matching_files("tests/test_lowering.py")
    assert [m.group(1) for m in LINK.finditer(doc.read_text())] == ["nowhere.md", "#no-such-heading"]
    assert anchors(doc) == {"a-heading"} and slug("Install (CUDA): wired, `not` run") == "install-cuda-wired-not-run"
    assert not any(resolves(d) for d in ("flashcodec_fx.hf.attention.StepStatus", "fx.NoSuchThing",
                                         "torch.ops.flashcodec.lower"))
    assert resolves("fx.FlashCodecCache") and resolves("flashcodec_fx.hf.handoff.StepTable")
    assert not re.search(r"\bFLASHCODEC_LOWER\b", code_text()) and not re.search(r"\bStepStatusRecord\b", code_text())
    assert not defines("flashcodec_fx/hf/layer.py", "no_such_function") and defines("flashcodec_fx/hf/layer.py",
                                                                                   "fall_back_to_view")
    for check, named in ((test_named_files_exist, "lowering.py"),
                         (test_named_functions_are_defined_in_their_files, "no_such_function"),
                         (test_relative_links_resolve, "nowhere.md"), (test_relative_links_resolve, "no-such-heading"),
                         (test_named_symbols_resolve, "StepStatus"),
                         (test_named_environment_variables_are_read, "FLASHCODEC_LOWER"),
                         (test_named_classes_exist, "StepStatusRecord")):
        with pytest.raises(AssertionError, match=named):
            check(doc)
