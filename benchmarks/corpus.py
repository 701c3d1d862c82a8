"""Real text for the quality benchmarks, shipped under ``benchmarks/data`` (sources in ``data/SOURCES.md``), and
non-overlapping token windows cut from it.

    from corpus import STREAMING_TEXTS, load_tokens, windows
    batch = windows(load_tokens(tokenizer, STREAMING_TEXTS), 6, 1024, leading_tokens(tokenizer))  # (6, 1024)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).resolve().parent / "data"
TEXTS = {
    "alice29": DATA / "alice29.txt",  # Lewis Carroll, Alice's Adventures in Wonderland (1865)
    "lcet10": DATA / "lcet10.txt",  # Library of Congress, Workshop on Electronic Texts, proceedings (1992)
    "pride": DATA / "corpus.txt",  # Jane Austen, Pride and Prejudice (1813), chapters 1-3
    "difflib": DATA / "difflib_py311.txt",  # CPython 3.11.7's Lib/difflib.py (source code with docstrings)
}
VERBATIM = frozenset({"difflib"})  # source code: read as it is (line breaks and indentation are part of the text)
STREAMING_TEXTS = ("alice29", "lcet10")  # bench_ppl's streaming protocol: ~38k + ~100k tokens
KINDS = {"prose": STREAMING_TEXTS, "dialogue": ("pride",), "code": ("difflib",)}  # bench_ppl --texts


def read_text(name: str) -> str:
    """The text ``name`` (a key of :data:`TEXTS`) with hard line wraps undone: paragraphs (separated by blank lines)
    become single lines, runs of spaces one space, CRLF plain newlines. Source code (:data:`VERBATIM`) is read as
    it is, CRLF plain newlines."""
    if name not in TEXTS:
        raise ValueError(f"name must be one of {sorted(TEXTS)}, got {name!r}")
    raw = TEXTS[name].read_text(encoding="utf-8").replace("\r\n", "\n")
    if name in VERBATIM:
        return raw
    paragraphs = (re.sub(r"\s+", " ", block).strip() for block in re.split(r"\n\s*\n", raw))
    return "\n\n".join(p for p in paragraphs if p)


def kind_texts(kinds: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The texts of the kinds ``kinds`` (keys of :data:`KINDS`), in order, each once."""
    unknown = [k for k in kinds if k not in KINDS]
    if not kinds or unknown:
        raise ValueError(f"kinds must be a non-empty list of {sorted(KINDS)}, got {list(kinds)!r}")
    return tuple(dict.fromkeys(name for kind in kinds for name in KINDS[kind]))


def load_tokens(tokenizer: Any, names: tuple[str, ...] | list[str]) -> list[torch.Tensor]:
    """One ``(N_i,)`` int64 token tensor per text in ``names`` (each tokenized on its own, no special tokens)."""
    return [torch.tensor(tokenizer(read_text(name), add_special_tokens=False)["input_ids"], dtype=torch.int64)
            for name in names]


def leading_tokens(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before any text (Gemma's ``<bos>``; none for SmolLM2)."""
    return list(tokenizer("")["input_ids"])


def windows(texts: list[torch.Tensor], count: int, length: int, prefix: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
    """``count`` non-overlapping windows ``(count, length)``, each ``prefix`` (e.g. the model's BOS, as a document
    would start) then ``length - len(prefix)`` consecutive text tokens. Window ``i`` comes from text
    ``i % len(texts)``; a text holding ``k`` of them is cut into ``k`` equal segments and each window is centred in
    its segment (so front matter and closing lists at a text's two ends are mostly avoided)."""
    if count < 1 or length <= len(prefix):
        raise ValueError(f"count must be >= 1 and length > len(prefix), got count={count}, length={length}, "
                         f"prefix of {len(prefix)}")
    head, length = torch.tensor(list(prefix), dtype=torch.int64), length - len(prefix)
    if not texts:
        raise ValueError("texts must hold at least one token tensor")
    per_text = [len(range(i, count, len(texts))) for i in range(len(texts))]
    starts = []
    for ids, k in zip(texts, per_text, strict=True):
        if k and ids.numel() < k * length:
            raise ValueError(f"a text of {ids.numel()} tokens cannot hold {k} non-overlapping windows of {length}")
        segment = ids.numel() // max(k, 1)  # >= length, so windows never overlap
        starts.append([j * segment + (segment - length) // 2 for j in range(k)])
    rows = [torch.cat([head, texts[i % len(texts)][starts[i % len(texts)][i // len(texts)]:][:length]])
            for i in range(count)]
    return torch.stack(rows)
