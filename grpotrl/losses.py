"""Loss-side tensor math: pure functions.

Letters: B rows, C completion width.
"""

from __future__ import annotations

import math

import torch


def importance_sampling_ratio(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                              mode: str = "sequence_mask", clip_min: float | None = None,
                              clip_max: float | None = 3.0) -> torch.Tensor:
    """TRL's truncated importance-sampling correction (its vLLM knobs), as a function.

    ``ratio = exp(trainer - sampler)`` per token (``token_*``, [B, C]) or per sequence summed
    over the mask (``sequence_*``, [B, 1]); ``*_truncate`` clamps it to [clip_min, clip_max],
    ``*_mask`` zeroes ratios outside. Tokens outside ``mask`` and NaN gaps count as ratio 1.

    >>> t, s, m = torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, -2.0]]), torch.ones(1, 2)
    >>> importance_sampling_ratio(t, s, m, "token_truncate", clip_max=2.0).tolist()  # exp(0), exp(1) -> 2
    [[1.0, 2.0]]
    >>> importance_sampling_ratio(t, s, m, "sequence_mask", clip_max=3.0).tolist()  # exp(1) = 2.718 <= 3
    [[2.7182817459106445]]
    """
    diff = torch.nan_to_num((trainer_logps - sampler_logps) * mask, nan=0.0)  # [B, C]
    if mode.startswith("sequence_"):
        diff = diff.sum(dim=-1, keepdim=True)  # [B, 1]
    elif not mode.startswith("token_"):
        raise ValueError(f"importance sampling mode {mode!r}: use token_/sequence_ + truncate/mask")
    ratio = torch.exp(diff)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode.endswith("_mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"importance sampling mode {mode!r}: use token_/sequence_ + truncate/mask")
