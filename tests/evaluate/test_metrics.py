"""flashcodec_fx.evaluate.metrics: KL, NLL and token match on hand-checkable inputs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcodec_fx.evaluate import mean_kl, nll, token_kl, token_match, token_nll


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.integers(2, 40))
def test_kl_is_zero_on_itself_and_positive_otherwise(seed, vocab):
    gen = torch.Generator().manual_seed(seed)
    ref = torch.log_softmax(3 * torch.randn(2, 3, vocab, generator=gen), -1)
    other = torch.log_softmax(3 * torch.randn(2, 3, vocab, generator=gen), -1)
    assert torch.equal(token_kl(ref, ref), torch.zeros(2, 3))
    assert mean_kl(ref, ref) == 0.0
    assert bool((token_kl(ref, other) > 0).all())
    assert mean_kl(ref, other) == pytest.approx(float(token_kl(ref, other).mean()))


def test_kl_of_two_point_distributions_matches_the_formula():
    p, q = torch.tensor([0.25, 0.75]), torch.tensor([0.5, 0.5])
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert float(token_kl(p.log(), q.log())) == pytest.approx(expected, rel=1e-6)


def test_nll_picks_the_target_log_prob():
    logprobs = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    targets = torch.tensor([[1, 2]])
    torch.testing.assert_close(token_nll(logprobs, targets), -torch.log(torch.tensor([[0.25, 0.8]])))
    assert nll(logprobs, targets) == pytest.approx(-(math.log(0.25) + math.log(0.8)) / 2, rel=1e-6)


def test_token_match():
    assert token_match(torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 2, 0, 4]])) == (0.75, 2)
    assert token_match(torch.tensor([[1, 2]]), torch.tensor([[1, 2]])) == (1.0, 2)
    assert token_match(torch.tensor([[1, 2]]), torch.tensor([[0, 2]])) == (0.5, 0)
