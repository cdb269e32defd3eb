"""Per-task GRPO policy losses from tensors: TRL 1.16's per-token policy loss and its reduction
(``trl.GRPOTrainer._compute_loss``), restated for a subset of a microbatch's rows.

``MultiTaskGRPOTrainer`` (CAGrad) needs each task's policy loss ``L_k`` (its rows' share of the
loss TRL reduces over the whole microbatch) and the regulariser ``beta * KL - c * H (+ aux)``.
TRL's loss is linear in the per-token loss and the per-token loss is computed row by row, so
``L_k`` is the per-token loss of task k's rows reduced with the whole microbatch's normaliser, and
``sum_k L_k + regulariser`` is TRL's loss. The trainer checks exactly that against TRL's own loss
on guard steps (``multitask._check_terms_add_up``), so a TRL release that changes its loss stops
training instead of training on a stale restatement.

Shapes: ``n`` rows of the subset, ``B`` rows of the microbatch, ``C`` completion tokens;
advantages ``[n]`` (or ``[n, C]``); everything per token ``[n, C]``. Anchor: verl's
``agg_loss(loss_mat, loss_mask, loss_agg_mode)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .loss_types import PerToken, named
from .losses import kl_loss_term
from .masking import masked_mean
from .reduction import Reduction, reduce_rows


@dataclass(frozen=True)
class PolicyLoss:
    """TRL's per-token policy loss settings (``GRPOConfig`` fields of the same names; ``epsilon_low``
    is ``epsilon``, ``off_policy_threshold`` is ``off_policy_mask_threshold``)."""

    loss_type: str
    importance_sampling_level: str = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_threshold: float | None = None

    def __post_init__(self):
        named(self.loss_type)  # a ValueError naming an unknown loss_type
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(f"importance_sampling_level={self.importance_sampling_level!r}: 'token' or 'sequence'")


def log_importance_weights(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, mask: torch.Tensor,
                           level: str) -> torch.Tensor:
    """``log(pi / pi_old)`` per token ``[n, C]``, or its masked mean per row ``[n, 1]`` (``level='sequence'``).

    >>> log_importance_weights(torch.tensor([[0.5, 1.0]]), torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]),
    ...                        "sequence").tolist()
    [[0.5]]
    """
    log_ratio = per_token_logps - old_per_token_logps  # [n, C]
    if level == "token":
        return log_ratio
    return masked_mean(log_ratio, mask, dim=-1, keepdim=True)  # [n, 1]


def off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor, sampling_per_token_logps: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[n, 1]``: 1 keeps a row (advantage >= 0, or its mean ``log pi_sampler - log pi`` <= ``threshold``),
    0 drops it (DeepSeek-V3.2's off-policy sequence mask; a NaN sampler logprob counts as 0)."""
    kl = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0)  # [n, C]
    mean_kl = masked_mean(kl, mask, dim=1, keepdim=True)  # [n, 1]
    return ((advantages >= 0) | (mean_kl <= threshold)).to(dtype=mask.dtype)


@torch.no_grad()
def vespo_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                  importance_sampling_ratio: torch.Tensor | None, settings: PolicyLoss) -> torch.Tensor:
    """VESPO's gamma weight per row ``[n, 1]``, ``phi(w) = e^lambda w^k e^(-lambda w)`` of the sequence's
    ratio ``w = exp(sum_t log(pi / pi_old))`` (times the sampler correction when given), in log space
    with TRL's clamps; ``k``, ``lambda`` by the advantage's sign. No gradient (a coefficient)."""
    lower = math.log(1e-8)
    seq = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)  # [n, 1]
    if importance_sampling_ratio is not None:
        seq += torch.sum(torch.clamp(torch.log(importance_sampling_ratio), lower, 20.0), dim=-1, keepdim=True)
    log_w = torch.clamp(seq, lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, settings.vespo_k_pos, settings.vespo_k_neg)
    lam = torch.where(nonneg, settings.vespo_lambda_pos, settings.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def per_token_policy_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor | None,
                          advantages: torch.Tensor, mask: torch.Tensor, settings: PolicyLoss, *,
                          importance_sampling_ratio: torch.Tensor | None = None,
                          sampling_per_token_logps: torch.Tensor | None = None,
                          entropy_mask: torch.Tensor | None = None) -> torch.Tensor:
    """TRL's per-token policy loss ``[n, C]`` (``[n, 1]`` for a sequence-level ratio), before the
    reduction and without KL, by the loss type's ``loss_types.PerToken``: the clipped ratio (``delta``
    caps it from above), CISPO's clipped-weight REINFORCE, SAPO's sigmoid gate or VESPO's gamma weight;
    then the off-policy mask, the high-entropy token mask and the sampler correction
    ``importance_sampling_ratio`` (inside the weight instead where the loss type ``folds_sampler_ratio``).
    ``old_per_token_logps`` None: on-policy, ``per_token_logps.detach()``; ``sampling_per_token_logps``
    None: the old logprobs."""
    s, kind = settings, named(settings.loss_type)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # [n, 1] or [n, C]
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps  # [n, C]
    log_weights = log_importance_weights(per_token_logps, old, mask, s.importance_sampling_level)
    coef_1 = torch.exp(log_weights)  # [n, C] or [n, 1]
    if kind.per_token is PerToken.CISPO:
        loss = -torch.clamp(coef_1, max=s.epsilon_high).detach() * adv * per_token_logps
    elif kind.per_token is PerToken.SAPO:
        temperatures = torch.where(adv > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
        loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * adv
    elif kind.per_token is PerToken.VESPO:
        phi = vespo_weights(adv, per_token_logps - old, mask, importance_sampling_ratio, s)  # [n, 1]
        loss = -phi * adv * per_token_logps
    elif kind.per_token is PerToken.CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - s.epsilon_low, 1 + s.epsilon_high)
        if s.delta is not None:
            coef_1 = torch.clamp(coef_1, max=s.delta)
        loss = -torch.min(coef_1 * adv, coef_2 * adv)
    else:
        raise ValueError(f"loss_type={s.loss_type!r}: no per-token loss for {kind.per_token}")
    if s.off_policy_threshold is not None:
        sampled = old if sampling_per_token_logps is None else sampling_per_token_logps
        loss = loss * off_policy_mask(adv, per_token_logps, sampled, mask, s.off_policy_threshold)
    if entropy_mask is not None:
        loss = loss * entropy_mask
    if importance_sampling_ratio is not None and not kind.folds_sampler_ratio:
        loss = loss * importance_sampling_ratio
    return loss


def policy_loss_terms(per_token_logps: dict, rows: dict, old_per_token_logps: torch.Tensor | None,
                      advantages: torch.Tensor, mask: torch.Tensor, settings: PolicyLoss, reduction: Reduction, *,
                      importance_sampling_ratio: torch.Tensor | None = None,
                      sampling_per_token_logps: torch.Tensor | None = None,
                      entropy_mask: torch.Tensor | None = None) -> dict:
    """``{k: L_k}``: each task's policy loss, its rows' share of TRL's policy loss of the microbatch.
    ``rows[k]`` [n_k] indexes task k's rows in the microbatch (empty: a zero term), ``per_token_logps[k]``
    [n_k, C] their logprobs (each task's own forward, so a term's backward walks its own rows); every
    other tensor is the microbatch's ``[B, ...]``. Their sum is TRL's policy loss (without KL, the
    entropy bonus and the MoE aux loss: ``regulariser``)."""
    def pick(t, r):
        return None if t is None else t[r]

    terms = {}
    for k, logps in per_token_logps.items():
        r = rows[k]
        loss = per_token_policy_loss(logps, pick(old_per_token_logps, r), advantages[r], mask[r], settings,
                                     importance_sampling_ratio=pick(importance_sampling_ratio, r),
                                     sampling_per_token_logps=pick(sampling_per_token_logps, r),
                                     entropy_mask=pick(entropy_mask, r))
        terms[k] = reduce_rows(loss, mask[r], reduction)
    return terms


def regulariser(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor | None,
                ref_per_token_logps: torch.Tensor | None, entropies: torch.Tensor | None, mask: torch.Tensor,
                settings: PolicyLoss, reduction: Reduction, *, beta: float, bias_correction_kl: bool = False,
                kl_estimator: str = "k3", entropy_coef: float = 0.0, entropy_mask: torch.Tensor | None = None,
                aux_loss: torch.Tensor | None = None, aux_coef: float = 0.0) -> torch.Tensor:
    """What grpotrl's GRPO loss adds to TRL's policy loss, a scalar: ``beta`` times the per-token KL to the
    reference (``losses.kl_loss_term`` with ``kl_estimator``, k3 by default, times the per-token importance
    ratio with ``bias_correction_kl``) reduced as the policy loss; minus ``entropy_coef`` times the mean entropy
    over the loss mask (times ``entropy_mask``), over ``accumulation``; plus ``aux_coef`` times the
    MoE aux loss over ``accumulation``. All tensors ``[B, C]``, the whole microbatch."""
    total = torch.zeros((), dtype=per_token_logps.dtype, device=per_token_logps.device)
    if beta != 0.0:
        kl = kl_loss_term(per_token_logps, ref_per_token_logps, old_per_token_logps, kl_estimator,
                          bias_correction_kl)  # [B, C]
        total = total + reduce_rows(beta * kl, mask, reduction)
    if entropies is not None and entropy_coef != 0.0:
        effective = mask if entropy_mask is None else mask * entropy_mask  # [B, C]
        total = total - entropy_coef * ((entropies * effective).sum() / effective.sum().clamp(min=1.0)
                                        / reduction.accumulation)
    if aux_loss is not None and aux_coef != 0.0:
        total = total + aux_coef * aux_loss / reduction.accumulation
    return total
