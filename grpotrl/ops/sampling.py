"""One token per row drawn from a categorical distribution without a host synchronisation.

Letters: B rows, V vocabulary.

``torch.multinomial(probs, 1)`` (torch 2.9-2.13, ``aten/src/ATen/native/Distributions.cpp``, its path for
one sample) draws ``q ~ Exp(1)`` for every entry with the default generator and returns
``argmax(probs / q)`` (the exponential form of the Gumbel-max trick: ``P(argmax = v) = probs[v] / sum``).
Before it, it checks the probabilities with ``((max < inf) & (min >= 0)).item()``, and after it that no row
sums to 0: host synchronisations at every call, so at every token in transformers' decoding loop, where the
host then waits for the device before it can queue the next step.

``draw_one`` makes the same draws with the same generator in the same order and the same division and
argmax, so it returns the very tokens ``torch.multinomial`` would (pinned by ``tests/ops/test_sampling.py``
against torch on CPU). Instead of the check it returns each row's validity as a tensor, for the caller to
read once, after the loop (``invalid_rows``).
"""

from __future__ import annotations

import torch


def draw_one(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``torch.multinomial(probs, 1, generator=generator)`` for ``probs`` [B, V] (non-negative, finite, rows
    not all zero; they need not sum to 1), without its host synchronisation: the token index [B, 1] (int64).
    Nothing is checked here: see ``invalid_rows``."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)  # [B, V], Exp(1) draws
    return torch.argmax(probs / q, dim=-1, keepdim=True)  # [B, 1]


def invalid_rows(probs: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows of ``probs`` [B, V] that ``torch.multinomial`` refuses (an entry that is NaN,
    infinite or negative, or a row that sums to 0), computed on the device, with no synchronisation."""
    # torch's own test, per row, in two reductions: a NaN makes the max NaN (not < inf); the max > 0 once the
    # min is >= 0 is a row that does not sum to 0
    low, high = probs.amin(dim=-1), probs.amax(dim=-1)  # [B], [B]
    return ~((high < torch.inf) & (low >= 0) & (high > 0))  # [B]
