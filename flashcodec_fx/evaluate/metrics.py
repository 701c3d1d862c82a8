"""Quality metrics between next-token distributions (given as fp32 log-probs) and token sequences."""

from __future__ import annotations

import torch


def nll(logprobs: torch.Tensor, target_ids: torch.Tensor) -> float:
    """Mean negative log-likelihood (nats/token) of ``target_ids (B, T)`` under ``logprobs (B, T, V)``."""
    return float(token_nll(logprobs, target_ids).mean())


def token_nll(logprobs: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token ``(B, T)`` of ``target_ids (B, T)`` under ``logprobs (B, T, V)``."""
    return -logprobs.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)


def token_kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) per position ``(...)`` between next-token distributions given as log-probs
    ``(..., V)``."""
    return (reference.exp() * (reference - other)).sum(-1)


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference || other) between next-token distributions given as log-probs."""
    return float(token_kl(reference, other).mean())


def token_match(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, int]:
    """(fraction of identical tokens, length of the common prefix) between two ``(1, N)`` token sequences."""
    same = (reference == other).flatten()
    prefix = int(same.numel() if bool(same.all()) else int(same.to(torch.int8).argmin()))
    return float(same.float().mean()), prefix
