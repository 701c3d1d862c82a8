"""Every ```python block of README.md and docs/*.md runs, with every warning an error.

A block runs alone, in a fresh namespace. A block that needs objects from its surroundings says so in an HTML comment
on the line before its fence, ``<!-- doctest: NAMES -->``; the names this test understands are in ``PROVIDED``
(a tiny random-init Llama as ``model``, its prompt as ``ids``, a toy decoder over static caches as ``module``).
Code is changed only by ``SUBSTITUTIONS`` (each must apply where listed) and, on transformers < 5.24, by the cache
keyword (``cache=`` -> ``past_key_values=``, the only name those releases take). A block importing vLLM
(docs/vllm.md) runs only where vLLM is installed (its own venv); every block's changes to ``os.environ`` are undone.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")

from conftest import fresh_tiny_model, tiny_prompt  # noqa: E402

from flashcodec_fx._compat import GENERATE_CACHE_KWARG  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*doctest:\s*([\w\s]*?)\s*-->")
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
# (file, old, new, why): the generate() compile recipes run the same graph rewrite without Inductor's code generation
# (minutes of CPU per block otherwise; test_hf_compile covers Inductor through generate()). The compiled-forward recipe
# runs as written: the pass-only mode cannot run a rewritten prefill graph of transformers 5.17 (see
# tests/passes/test_wrapper_warning.py).
SUBSTITUTIONS = [
    ("docs/compile.md", 'compile=True)   # or compile={"strict": True, ...}', 'compile={"inductor": False})', "no codegen"),
    ("docs/compile.md", 'options={"strict": True})', 'options={"strict": True, "inductor": False})', "no codegen"),
    ("README.md", 'preset="int8", compile=True)', 'preset="int8", compile={"inductor": False})', "no codegen"),
]
# Known defects outside the docs, each asserted to still happen (a fix makes the test fail: then delete the entry).
# (file, code in the block, warning it raises, where the defect is)
KNOWN = [
    ("docs/compile.md", "model.forward = torch.compile", r"Dynamo detected a call to a `functools.lru_cache`-wrapped",
     "ops.prepare_device (called when a stream allocates) runs inside the compiled prefill, and Dynamo warns about "
     "triton_common.codec_matrices' lru_cache; it should not run under torch.compiler.is_compiling()"),
]
# torch 2.13's own import of its Inductor code generation warns this (not the docs' doing; hidden by Python's default
# filters outside __main__).
TORCH_INTERNAL = r"`torch\.jit\.script_method` is deprecated"


def provided(names: list[str]) -> dict:
    from passes.passes_toy import ToyDecoder

    makers = {"model": lambda: fresh_tiny_model("llama"), "ids": tiny_prompt, "module": ToyDecoder}
    unknown = sorted(set(names) - set(makers))
    assert not unknown, f"doctest marker names {unknown} are not provided by tests/test_docs.py"
    return {name: makers[name]() for name in names}


def blocks() -> list[pytest.param]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.fullmatch(before.strip())
            names = marker.group(1).split() if marker else []
            rel = path.relative_to(ROOT).as_posix()
            found.append(pytest.param(rel, match.group(1), names, id=f"{rel}:{line}"))
    return found


BLOCKS = blocks()


def test_every_doc_has_its_blocks_and_every_substitution_applies():
    files = {p.values[0] for p in BLOCKS}
    assert {"README.md", "docs/hf.md", "docs/compile.md"} <= files
    for rel, where, _, why in KNOWN:
        assert sum(where in code for path, code, _ in (p.values for p in BLOCKS) if path == rel) == 1, (rel, where, why)
    for rel, old, _, why in SUBSTITUTIONS:
        hits = sum(code.count(old) for path, code, _ in (p.values for p in BLOCKS) if path == rel)
        assert hits == 1, (rel, old, why)


def edited(rel: str, code: str) -> str:
    for path, old, new, _ in SUBSTITUTIONS:
        if path == rel:
            code = code.replace(old, new)
    if GENERATE_CACHE_KWARG != "cache":
        code = re.sub(r"(?<![\w.])cache=(?=\w)", f"{GENERATE_CACHE_KWARG}=", code)
    return code


@pytest.mark.parametrize(("rel", "code", "names"), BLOCKS)
def test_block_runs_without_warnings(rel, code, names, tmp_path, monkeypatch):
    namespace = {"__name__": f"doc_block_{rel}", **provided(names)}
    monkeypatch.chdir(tmp_path)  # a block writing files (debug dumps) writes them here
    torch._dynamo.reset()  # each block runs as a program of its own: no code compiled by an earlier block
    if re.search(r"^\s*(from|import) vllm\b", code, re.M):
        pytest.importorskip("vllm.entrypoints.llm", reason="needs vLLM (its own venv: docs/vllm.md)")
    known = [(warning, why) for path, where, warning, why in KNOWN if path == rel and where in code]
    with warnings.catch_warnings(), mock.patch.dict(os.environ):
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=TORCH_INTERNAL, category=DeprecationWarning)
        if known:
            with pytest.raises(Exception, match=known[0][0]):  # known[0][1] says where the defect is
                exec(compile(edited(rel, code), rel, "exec"), namespace)
        else:
            exec(compile(edited(rel, code), rel, "exec"), namespace)
