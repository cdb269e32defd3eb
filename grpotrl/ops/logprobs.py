"""Temperature-scaled per-token logprobs and entropy: pure tensor functions.

Letters: B rows, L = P + C sequence length, C completion width, V vocabulary.

INVARIANT I5: the logprob of completion token ``t`` is ``log_softmax(logits / T)[token]``
taken from the logit at input position ``P + t - 1``, with ``T`` the sampling temperature.
This module is the independent recomputation the guards compare TRL's fused head against.
"""

from __future__ import annotations

import torch


def completion_logits(logits: torch.Tensor, completion_width: int) -> torch.Tensor:
    """The logits that score completion tokens: positions ``P-1 .. L-2`` (I4's shift by one)."""
    return logits[:, -completion_width - 1 : -1, :]  # [B, C, V]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` gathered at ``tokens``, in fp32.

    >>> logits = torch.tensor([[[2.0, 0.0]]])  # one row, one token, V=2
    >>> round(token_logprobs(logits, torch.tensor([[0]]), temperature=2.0).item(), 6)  # log(e/(e+1))
    -0.313262
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score sampled tokens, got {temperature}")
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, C, V]
    return logps.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, C]


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / T)`` per position, in fp32.

    >>> round(entropy_from_logits(torch.zeros(1, 1, 4)).item(), 6)  # uniform over 4: log 4
    1.386294
    """
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, C, V]
    return -(logps.exp() * logps).sum(-1)  # [B, C]
