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


# ---------------------------------------------------------------- KL to the reference policy
#
# Per-token estimators of KL(pi || pi_ref) from the sampled token's logprobs (verl's names in
# brackets), and the exact KL over the vocabulary. ``logp`` and ``ref_logp`` are [B, C].

KL_ESTIMATORS = ("k1", "abs", "k2", "k3", "full")


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``log pi - log pi_ref`` [kl]: unbiased, high variance, can be negative.

    >>> kl_k1(torch.tensor([-1.0]), torch.tensor([-2.0])).tolist()
    [1.0]
    """
    return logp - ref_logp


def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``|log pi - log pi_ref|`` [abs]."""
    return (logp - ref_logp).abs()


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``0.5 (log pi - log pi_ref)^2`` [mse]: biased, low variance, never negative.

    >>> kl_k2(torch.tensor([-1.0]), torch.tensor([-3.0])).tolist()
    [2.0]
    """
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, clamp: float = 10.0) -> torch.Tensor:
    """``r - log r - 1`` with ``r = pi_ref / pi`` [low_var_kl]: unbiased, never negative.
    Clamped to [-clamp, clamp] as verl does (the exp overflows for far-off tokens).

    >>> round(kl_k3(torch.tensor([0.0]), torch.tensor([-1.0])).item(), 6)  # e^-1 + 1 - 1
    0.367879
    """
    log_r = ref_logp - logp
    return (torch.exp(log_r) - log_r - 1).clamp(min=-clamp, max=clamp)


def kl_full(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Exact ``KL(pi || pi_ref) = sum_v pi(v) (log pi(v) - log pi_ref(v))`` per position, from
    logits [B, C, V] at the sampling temperature; returns [B, C]. verl leaves it unimplemented.

    >>> lg, ref = torch.tensor([[[0.0, 0.0]]]), torch.tensor([[[0.0, -1e9]]])  # pi=(.5,.5), ref=(1,0)
    >>> kl_full(ref, lg).tolist()  # KL((1,0) || (.5,.5)) = log 2
    [[0.6931471824645996]]
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, C, V]
    ref = torch.log_softmax(ref_logits.float() / temperature, dim=-1)  # [B, C, V]
    return (logp.exp() * (logp - ref)).sum(-1)  # [B, C]


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """The sample-based estimators by name (``full`` needs logits: call ``kl_full``)."""
    if estimator == "k1":
        return kl_k1(logp, ref_logp)
    if estimator == "abs":
        return kl_abs(logp, ref_logp)
    if estimator == "k2":
        return kl_k2(logp, ref_logp)
    if estimator == "k3":
        return kl_k3(logp, ref_logp)
    raise ValueError(f"KL estimator {estimator!r}: use one of {KL_ESTIMATORS[:4]} (or kl_full with logits)")
