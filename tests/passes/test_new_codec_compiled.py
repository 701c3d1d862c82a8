"""The compile pass rewrites attention over a codec registered outside the package (``tests/toy_codec.py``): the
compiled decode reads its stored form through ``flashcodec::codec_attention`` and matches eager decoding."""

from __future__ import annotations

import torch
import toy_codec  # noqa: F401  (registers the "half" codec)
from passes_toy import PROMPT, ToyDecoder, greedy, prefill, twin

import flashcodec_fx as fx
from flashcodec_fx.codecs import make_codec


def test_compile_pass_rewrites_attention_over_it():
    torch._dynamo.reset()
    codec = make_codec("half", window=2)
    eager = ToyDecoder(codec=codec)
    model = twin(eager, codec=codec)
    be = fx.backend(strict=True, inductor=False)
    step = torch.compile(model, backend=be, fullgraph=True)
    with torch.no_grad():
        first = prefill(eager)
        assert torch.equal(prefill(model), first)
        want, _ = greedy(eager, first, PROMPT.shape[1], 12)
        got, _ = greedy(step, first, PROMPT.shape[1], 12)
    assert got == want and be.pass_.reports and all(r.rewritten == 2 and not r.skipped for r in be.pass_.reports)
    torch._dynamo.reset()
