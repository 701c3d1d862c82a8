"""benchmarks/corpus.py: the shipped texts are the files their sources name, and windows never overlap."""

from __future__ import annotations

import hashlib

import pytest
import torch
from corpus import DATA, KINDS, TEXTS, kind_texts, read_text, windows
from hypothesis import given, settings
from hypothesis import strategies as st

SHA256 = {"alice29": "7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0",
          "lcet10": "5314ba1dbb03f471df88bec6cd120a938ef60d0fd3511c5c1dce61bf7463245f",
          "difflib": "0c6afc23568d55b3e9ac914f9c5361e3033e778aa5b58d3cc82835fc5c638679"}


@pytest.mark.parametrize("name", sorted(SHA256))
def test_texts_are_the_files_named_in_sources(name):
    assert hashlib.sha256(TEXTS[name].read_bytes()).hexdigest() == SHA256[name]
    sources = (DATA / "SOURCES.md").read_text()
    assert f"`{TEXTS[name].name}`" in sources and SHA256[name][:8] in sources and SHA256[name][-4:] in sources


def test_read_text_joins_wrapped_lines_into_paragraphs():
    text = read_text("alice29")
    assert "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing" in text
    assert "\r" not in text and "  " not in text
    with pytest.raises(ValueError, match="name must be one of"):
        read_text("moby")


def test_source_code_is_read_verbatim_and_kinds_name_their_texts():
    assert read_text("difflib") == TEXTS["difflib"].read_text(encoding="utf-8")
    assert "\n    def " in read_text("difflib")
    assert kind_texts(["dialogue", "prose", "dialogue"]) == ("pride", *KINDS["prose"])
    with pytest.raises(ValueError, match="kinds must be a non-empty list"):
        kind_texts(["poetry"])


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(50, 3000), min_size=1, max_size=3), count=st.integers(1, 9),
       length=st.integers(2, 60), bos=st.booleans())
def test_windows_come_from_the_texts_in_turn_and_never_overlap(sizes, count, length, bos):
    texts = [torch.arange(n) + 10_000 * (i + 1) for i, n in enumerate(sizes)]  # token = text id, position
    prefix = [1] if bos else []
    needed = [len(range(i, count, len(texts))) * (length - len(prefix)) for i in range(len(texts))]
    if any(n > size for n, size in zip(needed, sizes, strict=True)):
        with pytest.raises(ValueError, match="non-overlapping"):
            windows(texts, count, length, prefix)
        return
    batch = windows(texts, count, length, prefix)
    assert batch.shape == (count, length)
    body = batch[:, len(prefix):]
    assert bool((batch[:, : len(prefix)] == 1).all())
    seen = set()
    for i, row in enumerate(body.tolist()):
        assert row[0] // 10_000 == i % len(texts) + 1  # window i from text i % len(texts)
        assert row == list(range(row[0], row[0] + len(row)))  # consecutive text tokens
        assert not seen & set(row)
        seen |= set(row)
