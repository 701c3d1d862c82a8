"""bench_trellis.py --streams on a tiny random Llama: each stream's error is a fraction of its energy, it falls with
every bit a preset adds to that stream, and `int8` is near exact."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import bench_trellis  # noqa: E402
from conftest import tiny_model, tiny_prompt  # noqa: E402


def test_stream_errors_fall_with_the_bits_of_each_stream():
    model = tiny_model("llama")
    states = bench_trellis.raw_states(model, tiny_prompt(batch=2, length=224))
    errors = {p: bench_trellis.stream_errors(model, states, p) for p in ("int8", "4bit", "3bit", "2bit", "3bit-tcq")}
    for stream in ("keys", "values"):
        got = [errors[p][stream] for p in ("int8", "4bit", "3bit", "2bit")]
        assert got == sorted(got) and 0 < got[0] < 1e-3 and got[-1] < 1, (stream, got)
        assert 0 < errors["3bit-tcq"][stream] < errors["3bit"][stream], stream
