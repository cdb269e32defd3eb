"""TRL's reduction of a per-token loss to the scalar it backpropagates, as a function of its inputs.

``aggregate_like_trl`` restates the reduction branches of trl 1.16's ``GRPOTrainer._compute_loss``, one
per ``loss_types.Normaliser`` (``tests/trainers/test_trl_hooks.py`` pins TRL's lines and which loss type takes which
branch), with every trainer field it read made an argument, as verl's ``agg_loss(loss_mat, loss_mask,
loss_agg_mode, ...)`` does. The reduction is linear in the per-token values, so a term reduced here and
added to TRL's loss equals the term added to TRL's per-token loss before TRL reduced it: GAD's KL term
rides on TRL's policy loss this way.

Letters: B rows of the microbatch, C completion width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .loss_types import Normaliser, named
from .masking import masked_mean


@dataclass(frozen=True)
class Reduction:
    """What TRL divides one training microbatch's summed per-token loss by (``loss_type``'s
    ``loss_types.Normaliser``): ``rows`` B, ``tokens`` the microbatch's loss-mask sum, ``accumulation`` the
    gradient-accumulation steps; for a token-sum loss type ``num_items_in_batch`` (the generation batch's
    tokens, all processes), ``num_processes`` and ``steps_per_generation``."""

    loss_type: str
    rows: int
    tokens: torch.Tensor | float
    max_completion_length: int
    accumulation: float = 1.0
    num_items_in_batch: torch.Tensor | float | None = None
    num_processes: int = 1
    steps_per_generation: int = 1


def reduce_rows(per_token_loss: torch.Tensor, mask: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    """These rows' share of the loss TRL reduces over the whole microbatch (training mode), a scalar:
    summed over any split of the microbatch's rows, the shares are TRL's loss. By the loss type's normaliser:

    * ``ROW_TOKEN_MEAN``: the rows' token means, over ``B * accumulation``;
    * ``MICROBATCH_TOKENS``: their token sum over the microbatch's ``tokens * accumulation``;
    * ``MAX_LENGTH_ROWS``: their token sum over ``B * max_completion_length * accumulation``;
    * ``ROWS``: their row sums over ``B * accumulation``;
    * ``WINDOW_TOKENS``: their token sum over ``num_items_in_batch / num_processes * accumulation /
      steps_per_generation``.

    >>> reduce_rows(torch.tensor([[1.0, 3.0]]), torch.ones(1, 2), Reduction("grpo", rows=4, tokens=8.0,
    ...                                                                       max_completion_length=2)).item()
    0.5
    """
    r, kind = reduction, named(reduction.loss_type).normaliser
    masked = per_token_loss * mask  # [n, C]
    if kind is Normaliser.ROW_TOKEN_MEAN:
        return masked_mean(per_token_loss, mask, dim=-1).sum() / r.rows / r.accumulation
    if kind is Normaliser.MICROBATCH_TOKENS:
        return masked.sum() / torch.as_tensor(r.tokens).clamp(min=1.0) / r.accumulation
    if kind is Normaliser.MAX_LENGTH_ROWS:
        return masked.sum() / (r.rows * r.max_completion_length) / r.accumulation
    if kind is Normaliser.ROWS:
        return masked.sum(-1).sum() / r.rows / r.accumulation
    if kind is Normaliser.WINDOW_TOKENS:
        normaliser = torch.as_tensor(r.num_items_in_batch).clamp(min=1.0) / r.num_processes
        return masked.sum() / (normaliser * r.accumulation / r.steps_per_generation)
    raise ValueError(f"loss_type={r.loss_type!r}: no reduction for its normaliser {kind}")


def aggregate_like_trl(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, *, max_completion_length: int,
                       num_items_in_batch: torch.Tensor | None, num_processes: int,
                       gradient_accumulation_steps: int, steps_per_generation: int,
                       training: bool = True) -> torch.Tensor:
    """``per_token`` [B, C] over ``mask`` [B, C] (1 = in the loss) reduced to a scalar as TRL 1.16
    reduces its per-token loss for ``loss_type``, by its normaliser (``loss_types.Normaliser``):

    * ``ROW_TOKEN_MEAN``: the mean over rows of each row's token mean;
    * ``MICROBATCH_TOKENS``: the token mean over the microbatch;
    * ``MAX_LENGTH_ROWS``: the token sum over ``B * max_completion_length``;
    * ``ROWS``: the mean over rows of each row's token sum;
    * ``WINDOW_TOKENS``: the token sum over ``num_items_in_batch`` (the loss tokens of the whole
      generation batch, every process) per process, per microbatch of the accumulation window.

    In training the first four are divided by ``gradient_accumulation_steps`` (TRL's
    ``current_gradient_accumulation_steps``) and the last one's normaliser is scaled by
    ``gradient_accumulation_steps / steps_per_generation``; with ``training=False`` (TRL's eval mode)
    neither: eval neither splits nor accumulates the batch.

    >>> x, m = torch.tensor([[1.0, 3.0], [2.0, 9.0]]), torch.tensor([[1, 1], [1, 0]])
    >>> aggregate_like_trl(x, m, "bnpo", max_completion_length=2, num_items_in_batch=None, num_processes=1,
    ...                    gradient_accumulation_steps=1, steps_per_generation=1).item()  # (1 + 3 + 2) / 3
    2.0
    """
    if named(loss_type).token_sum and num_items_in_batch is None:
        raise ValueError(f"loss_type={loss_type!r} normalises by num_items_in_batch (the generation batch's loss "
                         "tokens), but none was given; pass the batch's inputs['num_items_in_batch'].")
    return reduce_rows(per_token, mask, Reduction(
        loss_type, rows=per_token.size(0), tokens=mask.sum(), max_completion_length=max_completion_length,
        accumulation=gradient_accumulation_steps if training else 1.0, num_items_in_batch=num_items_in_batch,
        num_processes=num_processes, steps_per_generation=steps_per_generation if training else 1))
