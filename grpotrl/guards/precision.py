"""What two correct forwards of one model may differ by in a compute dtype, and the tolerances every
numeric guard takes from it (INVARIANTS I5, I7, I10, I11).

In fp32 two forwards that differ only in batch shape or layout agree to ~1e-5 nats per token, so the
guards compare token by token against a small tolerance. In bf16 and fp16 they do not: kernels are not
batch-invariant, and a logit keeps 8 (fp16: 11) mantissa bits, so a forward of the same weights on
another batch shape (the padding-free packed rows against the padded batch, a microbatch against the
whole generation batch) moves most tokens by ~1e-3 nats and a few by a rounding step of a large logit:
up to ~0.25 nats measured on SmolLM2, up to ~1 nat reported on GPUs. A per-token maximum then either
false-alarms or allows anything. Low precision is therefore checked with statistics that bf16 noise
does not move and each fault class does (``Tolerances``; figures in docs/guarantees.md):

* a temperature error moves every token along one known direction, ``d logp / d (1 / T)``
  (``ops.logprobs.temperature_slope``): fitted over the microbatch's tokens, the temperature the loss
  used is read to ~0.1% whatever the noise (``ops.logprobs.fit_along``);
* a layout error (other position ids, packed rows that see each other, another model) moves the bulk
  of the tokens, or whole rows: the median gap over all tokens and the worst row's mean gap. bf16
  noise is sparse (its median is ~1e-3 nats: most tokens agree to the last bit) and spread over rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def compute_dtype(model, bf16: bool = False, fp16: bool = False) -> torch.dtype:
    """The dtype a trainer's forwards compute in: autocast's where ``bf16`` / ``fp16`` is set (accelerate's
    mixed precision, whatever the weights), else the lowest-precision floating dtype among the model's
    parameters (weights loaded in bf16; a quantized model's float parameters), else fp32.

    >>> compute_dtype(torch.nn.Linear(2, 2)), compute_dtype(torch.nn.Linear(2, 2), bf16=True)
    (torch.float32, torch.bfloat16)
    >>> compute_dtype(torch.nn.Linear(2, 2).to(torch.float16))
    torch.float16
    """
    if fp16:
        return torch.float16
    if bf16:
        return torch.bfloat16
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} if model is not None else set()
    for low in LOW_PRECISION:
        if low in dtypes:
            return low
    return torch.float32


@dataclass(frozen=True)
class Tolerances:
    """What the numeric guards allow between two correct forwards computing in ``dtype``.

    ``low_precision`` False (fp32): token by token. I5: ``|gap| <= logprob_atol x max(1, logit scale)``
    (``guard_logprob_atol``); I7's entropy values ``<= entropy_atol``; I10 ``<= identity_max`` per token.
    ``low_precision`` True (bf16, fp16): statistics over the microbatch's loss tokens. I5 and I7: the fitted
    scale (temperature for logprobs, ``H_used / H_ref`` for entropies) within ``scale_rtol`` (+ 4 standard
    errors); I5, I7 and I10: the median gap ``<= median_gap`` and no row whose mean gap exceeds ``row_gap``
    (rows of at least ``row_min_tokens`` tokens); I10 also the mean gap ``<= identity_mean``.
    I11: each token's weight in the loss within ``denominator_rtol`` of its normaliser (fp32 arithmetic
    on the loss's logprobs: bf16 only reaches it through the ratio)."""

    dtype: torch.dtype
    logprob_atol: float = 1e-5
    entropy_atol: float = 1e-3
    identity_max: float = 1e-4
    scale_rtol: float = 0.01
    median_gap: float = 0.02
    row_gap: float = 0.5
    row_min_tokens: int = 4
    identity_mean: float = 0.05
    denominator_rtol: float = 1e-4

    @property
    def low_precision(self) -> bool:
        return self.dtype in LOW_PRECISION

    @property
    def name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, "fp32")

    def within_rounding(self, stats: "GapStatistics") -> bool:
        """Low precision: a gap's median and worst row's mean are what rounding moves (False for NaN)."""
        return stats.median <= self.median_gap and stats.row_mean <= self.row_gap


def tolerances(dtype: torch.dtype, logprob_atol: float = 1e-5) -> Tolerances:
    """The guards' tolerances for forwards computing in ``dtype`` (``compute_dtype``); ``logprob_atol``:
    the config's ``guard_logprob_atol``, I5's fp32 per-token tolerance.

    >>> t = tolerances(torch.bfloat16)
    >>> t.low_precision, t.name, t.median_gap, t.denominator_rtol
    (True, 'bf16', 0.02, 0.01)
    >>> tolerances(torch.float32, 1e-5).low_precision
    False
    """
    if dtype in LOW_PRECISION:
        return Tolerances(dtype, logprob_atol=logprob_atol, denominator_rtol=1e-2)
    return Tolerances(torch.float32, logprob_atol=logprob_atol)


@dataclass(frozen=True)
class GapStatistics:
    """Statistics of a per-token gap over the loss tokens (``gap_statistics``): the median ``|gap|``, the
    worst row's mean ``|gap|`` (rows of at least ``row_min_tokens`` tokens; 0 when none) and that row,
    the mean and max ``|gap|`` and the token count."""

    median: float
    row_mean: float
    row: int
    mean: float
    max: float
    tokens: int


def gap_statistics(gap: torch.Tensor, mask: torch.Tensor, row_min_tokens: int) -> GapStatistics:
    """``GapStatistics`` of ``gap`` [B, C] over ``mask`` [B, C] (one host sync).

    >>> gap = torch.tensor([[0.0, 0.0, 0.0, 0.1], [2.0, 2.0, 2.0, 2.0]])  # 7 tokens on: median 0.1
    >>> s = gap_statistics(gap, torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), row_min_tokens=3)
    >>> round(s.median, 6), round(s.row_mean, 6), s.row, s.tokens, round(s.max, 6)
    (0.1, 2.0, 1, 7, 2.0)
    """
    on = mask.bool()  # [B, C]
    absolute = torch.where(on, gap.detach().float().abs(), 0.0)  # [B, C]
    counts = on.sum(1)  # [B]
    rows = torch.where(counts >= row_min_tokens, absolute.sum(1) / counts.clamp(min=1), 0.0)  # [B]
    n = on.sum()
    values = absolute[on]  # [N]
    median = values.median() if values.numel() else absolute.new_zeros(())
    packed = torch.stack([median, rows.max() if rows.numel() else absolute.new_zeros(()), rows.argmax().float()
                          if rows.numel() else absolute.new_zeros(()), absolute.sum() / n.clamp(min=1),
                          absolute.max() if absolute.numel() else absolute.new_zeros(()), n.float()]).tolist()
    return GapStatistics(packed[0], packed[1], int(packed[2]), packed[3], packed[4], int(packed[5]))
