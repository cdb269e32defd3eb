"""One token per row drawn from a categorical distribution: torch's own draw, without its host synchronisation
and, on CPU, in half its time.

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

On CPU torch computes the ``B x V`` draws one at a time (``exponential_``'s serial kernel: a 64-bit uniform
``u`` from the generator, then ``-log1p(-u)`` in double, rounded to the tensor's dtype): 65 ms for SmolLM2's
``[64, 49152]``, a seventh of a decoding step of 64 rows. ``exponential_draws`` takes the same uniforms from the
same generator (``torch.rand`` in float64 draws them exactly as ``exponential_`` does) and the logarithm
vectorised: 34 ms (docs/cost.md). The vectorised ``log1p``
can differ from the C library's by a unit in the last place of a double (8% of values); rounded to float32
that matters only for a double within a few units of a float32 rounding boundary (about 3 in 10^8), and those
few are computed again with the C library's ``log1p``: the float32 draws are torch's, bit for bit.
"""

from __future__ import annotations

import math

import torch

# device types where ``exponential_draws`` computes torch's draws faster than torch's own exponential_ (measured:
# docs/cost.md); the dtype it does so for (transformers samples from float32 probabilities)
FAST_DRAW_ON = ("cpu",)
FAST_DRAW_DTYPE = torch.float32
_LOW_BITS = (1 << 29) - 1  # the 29 bits of a double's mantissa that rounding to float32 drops
_MIDPOINT = 1 << 28  # their value exactly between two float32 values
_SLACK = 8  # units in the last place of a double by which the vectorised log1p may differ from the C library's


def draw_one(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``torch.multinomial(probs, 1, generator=generator)`` for ``probs`` [B, V] (non-negative, finite, rows
    not all zero; they need not sum to 1), without its host synchronisation: the token index [B, 1] (int64).
    Nothing is checked here: see ``invalid_rows``."""
    q = exponential_draws(probs, generator)  # [B, V], Exp(1) draws
    return torch.argmax(probs / q, dim=-1, keepdim=True)  # [B, 1]


def exponential_draws(like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``torch.empty_like(like).exponential_(1, generator=generator)``: the same values, bit for bit, and the
    generator left in the same state; on ``FAST_DRAW_ON`` devices, for a contiguous ``FAST_DRAW_DTYPE`` tensor,
    computed from float64 uniforms with a vectorised logarithm (module docstring), elsewhere torch's own."""
    if like.device.type not in FAST_DRAW_ON or like.dtype != FAST_DRAW_DTYPE or not like.is_contiguous():
        return torch.empty_like(like).exponential_(1, generator=generator)
    u = torch.rand(like.shape, dtype=torch.float64, generator=generator)  # the uniforms exponential_ would draw
    d = torch.log1p(u.neg()).neg_()  # -log1p(-u) in double, vectorised
    q = d.to(FAST_DRAW_DTYPE)
    near = (d.view(torch.int64) & _LOW_BITS).sub_(_MIDPOINT).abs_() <= _SLACK  # could round the other way
    flat_q, flat_u = q.view(-1), u.view(-1)
    for i in near.view(-1).nonzero().view(-1).tolist():  # about 3 in 10^8 entries
        flat_q[i] = -math.log1p(-flat_u[i].item())  # the C library's log1p, as exponential_'s kernel
    return q


def invalid_rows(probs: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows of ``probs`` [B, V] that ``torch.multinomial`` refuses (an entry that is NaN,
    infinite or negative, or a row that sums to 0), computed on the device, with no synchronisation."""
    # torch's own test, per row, in two reductions: a NaN makes the max NaN (not < inf); the max > 0 once the
    # min is >= 0 is a row that does not sum to 0
    low, high = probs.amin(dim=-1), probs.amax(dim=-1)  # [B], [B]
    return ~((high < torch.inf) & (low >= 0) & (high > 0))  # [B]
