"""flashcodec_fx.evaluate.drive: greedy, teacher forcing and the streaming protocol on tiny random models."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from conftest import fresh_tiny_model, tiny_prompt  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from flashcodec_fx.evaluate import (  # noqa: E402
    RAW,
    Tier,
    greedy,
    greedy_and_forced,
    make_cache,
    stream_steps,
    streamed_logprobs,
    streaming,
    teacher_forced,
    token_kl,
    token_match,
)

NEW_TOKENS = 24
LOSSY = Tier("png keep=0.25", {"mode": "png", "keep_ratio": 0.25})  # pruned deltas: lossy on the tiny model


def _full_forward(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), -1)


def test_teacher_forcing_matches_one_full_forward_on_the_raw_cache():
    model = fresh_tiny_model("llama")
    ids = tiny_prompt(2, 14)
    forced = teacher_forced(model, ids[:, :6], ids[:, 6:], DynamicCache(config=model.config))
    torch.testing.assert_close(forced, _full_forward(model, ids)[:, 5:-1], atol=1e-4, rtol=1e-4)


def test_single_pass_equals_separate_greedy_and_teacher_forcing_after_a_divergence():
    model = fresh_tiny_model("llama")
    ids = tiny_prompt(1, 20)
    ref = greedy(model, ids, make_cache(model, RAW), NEW_TOKENS)
    alone = greedy(model, ids, make_cache(model, LOSSY), NEW_TOKENS)
    both = greedy_and_forced(model, ids, ref.tokens, make_cache(model, LOSSY))
    assert token_match(ref.tokens, alone.tokens)[1] < NEW_TOKENS - 1  # it does diverge, early enough to matter
    assert torch.equal(both.tokens, alone.tokens)
    torch.testing.assert_close(both.logprobs, teacher_forced(model, ids, ref.tokens, make_cache(model, LOSSY)))
    assert both.decode_steps == (NEW_TOKENS - 1) + (NEW_TOKENS - 1 - token_match(ref.tokens, alone.tokens)[1])


@settings(max_examples=60, deadline=None)
@given(length=st.integers(2, 300), data=st.data())
def test_stream_steps_feed_every_token_once_and_score_every_target_once(length, data):
    prefill = data.draw(st.integers(1, length - 1))
    chunk = data.draw(st.integers(1, 40))
    steps = stream_steps(length, prefill, chunk)
    fed = [p for f, _ in steps for p in range(f.start, f.stop)]
    scored = [p for _, t in steps for p in range(t.start, t.stop)]
    assert fed == list(range(length)) and scored == list(range(prefill, length))
    assert steps[0] == (slice(0, prefill), slice(prefill, prefill + 1))
    for f, t in steps[1:]:
        assert 1 <= f.stop - f.start <= chunk and t.start == f.start + 1  # a chunk's positions predict one further on
    assert all(f.stop - f.start == chunk for f, _ in steps[1:-1])


def test_stream_steps_reject_bad_arguments():
    with pytest.raises(ValueError, match="prefill"):
        stream_steps(10, 10, 4)
    with pytest.raises(ValueError, match="chunk"):
        stream_steps(10, 4, 0)
    with pytest.raises(TypeError, match="chunk"):
        stream_steps(10, 4, 2.0)


class _RecordingCache(DynamicCache):
    """A raw cache that records how many tokens each update of layer 0 appends and how many it returns."""

    def __init__(self, config):
        super().__init__(config=config)
        self.calls = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == 0:
            self.calls.append((key_states.shape[-2], keys.shape[-2]))
        return keys, values


def test_streaming_feeds_prefill_then_chunks_through_the_cache_and_equals_a_full_forward():
    model = fresh_tiny_model("llama")
    ids = tiny_prompt(2, 30)
    cache = _RecordingCache(model.config)
    steps = list(streaming(model, ids, cache, prefill=7, chunk=5))
    assert cache.calls == [(7, 7), (5, 12), (5, 17), (5, 22), (5, 27), (3, 30)]  # chunks read the cached history
    assert [s.targets for s in steps] == [t for _, t in stream_steps(30, 7, 5)]
    assert [s.logprobs.shape[1] for s in steps] == [1, 5, 5, 5, 5, 2]
    logprobs = torch.cat([s.logprobs for s in steps], 1)
    torch.testing.assert_close(logprobs, _full_forward(model, ids)[:, 6:-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(streamed_logprobs(model, ids, DynamicCache(config=model.config), 7, 5), logprobs)


def test_streaming_kl_is_zero_on_the_same_tier_and_positive_on_a_lossy_one():
    model = fresh_tiny_model("llama")
    ids = tiny_prompt(1, 40)
    ref = streamed_logprobs(model, ids, make_cache(model, RAW), 8, 8)
    again = streamed_logprobs(model, ids, make_cache(model, RAW), 8, 8)
    lossy = streamed_logprobs(model, ids, make_cache(model, LOSSY), 8, 8)
    assert torch.equal(token_kl(ref, again), torch.zeros(1, 32))
    kl = token_kl(ref, lossy)
    assert kl[0, 0] == pytest.approx(0.0, abs=1e-6)  # the prefill's own prediction reads no compressed history
    assert float(kl[0, 1:].mean()) > 1e-4
