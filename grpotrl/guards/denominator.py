"""The loss's own denominator (I11): what TRL's loss divides each token by, read from the loss.

A normaliser off by the gradient-accumulation factor (a token-sum loss divided by one microbatch's tokens
instead of the accumulation window's) scales every update k times too small or large, and nothing
downstream notices. On guard steps the trainer reads, from the loss it is about to backpropagate,
the weight each loss token carries, and compares it with the normaliser recomputed here from the
completion mask, the accumulation window and the world size alone (never TRL's ``num_items_in_batch``).
What each ``loss_type`` divides by and which per-token loss it has comes from ``ops.loss_types``.

How the weight is read. TRL's loss is ``sum_t w_t * l_t`` over the microbatch's loss tokens, ``w_t =
1 / normaliser_t``. For the policy logprob ``logp_t`` the loss used, ``d loss / d logp_t = w_t * d l_t /
d logp_t``, and ``d l_t / d logp_t`` is known in closed form per ``loss_types.PerToken`` (``token_slope``):
``-A r`` for ``CLIPPED`` inside the clip range (``r`` the ratio), ``-A * 4 s (1 - s) * r`` for ``SAPO``
(``s = sigmoid(tau (r - 1))``), ``-A * min(r, epsilon_high)`` for ``CISPO``, ``-A * phi(w)`` for ``VESPO``
where ``phi(1) = 1``. So ``normaliser_t = token_slope_t / (d loss / d logp_t)``. A token whose advantage
is 0, whose ratio is clipped, or whose VESPO weight is not 1 (``w != 1``) carries no readable weight: it
is counted as unchecked, never passed as checked.

Letters: B rows of the microbatch, C completion width.
"""

from __future__ import annotations

import torch

from ..errors import InvariantError
from ..ops.loss_types import Normaliser, PerToken, named
from ..ops.masking import masked_mean


def expected_normaliser(loss_type: str, mask: torch.Tensor, *, max_completion_length: int, accumulation: int,
                        window_tokens: float | None, num_processes: int, steps_per_generation: int) -> torch.Tensor:
    """What each row's loss tokens must be divided by [B], for TRL 1.16's ``loss_type`` in training, from
    ``mask`` [B, C] (this microbatch's loss mask), ``accumulation`` (the microbatch count of this accumulation
    window, the Trainer's ``current_gradient_accumulation_steps``: ``gradient_accumulation_steps``, fewer on an
    epoch's last, partial window, which TRL divides by), and for a token-sum loss type ``window_tokens`` (the
    loss tokens of the whole generation batch, summed over all ``num_processes``). By its ``loss_types.Normaliser``:

    * ``ROW_TOKEN_MEAN``: each row's token mean, then the mean over rows: ``n_i * B * accumulation``;
    * ``MICROBATCH_TOKENS``: the microbatch's token mean: ``sum(mask) * accumulation``;
    * ``MAX_LENGTH_ROWS``: ``B * max_completion_length * accumulation``;
    * ``ROWS``: each row's token sum, mean over rows: ``B * accumulation``;
    * ``WINDOW_TOKENS``: the token count of one accumulation window, per process:
      ``window_tokens / num_processes * accumulation / steps_per_generation``.

    >>> m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    >>> expected_normaliser("grpo", m, max_completion_length=3, accumulation=2, window_tokens=None,
    ...                     num_processes=1, steps_per_generation=2).tolist()  # n_i * B * GA: 2*2*2, 1*2*2
    [8.0, 4.0]
    >>> expected_normaliser("dapo", m, max_completion_length=3, accumulation=2, window_tokens=6.0,
    ...                     num_processes=1, steps_per_generation=2).tolist()  # 6 tokens over the window
    [6.0, 6.0]
    """
    kind = named(loss_type).normaliser
    mask = mask.float()  # [B, C]
    B = mask.size(0)
    ones = torch.ones(B, device=mask.device)  # [B]
    if kind is Normaliser.ROW_TOKEN_MEAN:
        return mask.sum(-1).clamp(min=1.0) * B * accumulation  # [B]
    if kind is Normaliser.MICROBATCH_TOKENS:
        return ones * mask.sum().clamp(min=1.0) * accumulation
    if kind is Normaliser.MAX_LENGTH_ROWS:
        return ones * B * max_completion_length * accumulation
    if kind is Normaliser.ROWS:
        return ones * B * accumulation
    if kind is Normaliser.WINDOW_TOKENS:
        if window_tokens is None:
            raise ValueError(f"loss_type={loss_type!r} normalises by the generation batch's loss tokens: pass "
                             "window_tokens.")
        return ones * max(float(window_tokens), 1.0) / num_processes * accumulation / steps_per_generation
    raise ValueError(f"loss_type={loss_type!r}: no normaliser known for {kind}")


def token_slope(loss_type: str, advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, *,
                sequence_level: bool, epsilon_low: float, epsilon_high: float, delta: float | None = None,
                sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05) -> torch.Tensor:
    """``d l_t / d logp_t`` [B, C] of TRL 1.16's per-token policy loss ``l_t`` (before any reduction, by the
    loss type's ``loss_types.PerToken``), and NaN where it cannot be read: advantage 0, ratio clipped,
    VESPO's weight not 1. ``advantages`` [B] or [B, C]; ``log_ratio`` [B, C] = ``logp - old_logp`` (0
    on-policy). Under ``sequence_level`` the ratio is the row's mean over ``mask``: the slope then holds for
    a row whose tokens share one weight (every TRL loss type), summed over the row.

    >>> a, z, m = torch.tensor([2.0, 0.0]), torch.zeros(2, 1), torch.ones(2, 1)
    >>> token_slope("dapo", a, z, m, sequence_level=False, epsilon_low=0.2, epsilon_high=0.2).tolist()
    [[-2.0], [nan]]
    """
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # [B, 1] or [B, C]
    if sequence_level:
        log_ratio = masked_mean(log_ratio, mask, dim=-1, keepdim=True)
    family = named(loss_type).per_token
    r = torch.exp(log_ratio)  # [B, C] or [B, 1]
    if family is PerToken.CLIPPED:
        inside = (r > 1 - epsilon_low) & (r < 1 + epsilon_high)
        if delta is not None:
            inside = inside & (r < delta)
        slope = torch.where(inside, -adv * r, torch.nan)
    elif family is PerToken.SAPO:
        tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        s = torch.sigmoid(tau * (r - 1))
        slope = -adv * 4 * s * (1 - s) * r
    elif family is PerToken.CISPO:
        slope = -adv * torch.clamp(r, max=epsilon_high)
    elif family is PerToken.VESPO:  # phi(w) = 1 at w = 1 only: the sequence's summed log-ratio must be 0
        seq = (log_ratio * mask).sum(-1, keepdim=True) if not sequence_level else log_ratio
        slope = torch.where(seq.abs() < 1e-6, -adv, torch.nan)
    else:
        raise ValueError(f"loss_type={loss_type!r}: no per-token slope known for {family}")
    slope = slope.expand_as(mask) if slope.shape != mask.shape else slope  # [B, C]
    return torch.where(slope == 0, torch.nan, slope)


def check_denominator(loss_type: str, grad: torch.Tensor, slope: torch.Tensor, expected: torch.Tensor,
                      mask: torch.Tensor, rtol: float = 1e-4, tiny: float = 1024 * torch.finfo(torch.float32).tiny
                      ) -> dict[str, float]:
    """The normaliser the loss used, ``slope / grad`` per loss token (``grad`` [B, C] = d loss / d logp,
    ``slope`` [B, C] from ``token_slope``, NaN where unreadable), against ``expected`` [B]
    (``expected_normaliser``) within ``rtol``. Raises ``InvariantError`` naming the loss type, the
    expected and the found normaliser; a NaN or inf gradient on a loss token is an error too (nothing
    can be verified there). A token whose expected gradient ``slope / expected`` is below ``tiny`` (1024
    x the smallest normal number of the logprobs' dtype: an advantage scaled towards 0 by an importance
    ratio, say) is unreadable: its gradient may round to 0 or lose its precision. Returns ``{"guards/denominator_checked_share", ...max_rel_error}``."""
    on = mask.bool()  # [B, C]
    if not torch.isfinite(grad[on]).all():
        raise InvariantError("I11", f"loss_type={loss_type!r}: d loss / d logp is NaN or inf on a loss token, so the "
                                    "loss's normaliser cannot be read. Look for a non-finite loss term first.")
    want = expected.unsqueeze(1).expand_as(slope)  # [B, C]
    readable = on & torch.isfinite(slope) & ((slope / want).abs() >= tiny)  # [B, C]
    found = slope / grad  # [B, C]; a token with gradient 0 reads as inf: the loss gave it no weight
    rel = ((found - want).abs() / want).masked_fill(~readable, 0.0)  # [B, C]
    worst = float(rel.max()) if readable.any() else 0.0
    if worst > rtol or not torch.isfinite(rel).all():
        i, t = divmod(int(torch.nan_to_num(rel, posinf=float("inf")).argmax()), rel.size(1))
        raise InvariantError(
            "I11", f"loss_type={loss_type!r}: the loss divides row {i}'s tokens by {float(found[i, t]):.6g} (found), "
                   f"but the normaliser recomputed from the completion mask, the accumulation window and the world "
                   f"size is {float(want[i, t]):.6g} (expected): every update is scaled by "
                   f"{float(want[i, t] / found[i, t]):.4g}. Check how the loss counts tokens over gradient "
                   "accumulation.")
    total = int(on.sum())
    return {"guards/denominator_checked_share": int(readable.sum()) / total if total else 0.0,
            "guards/denominator_max_rel_error": worst}
