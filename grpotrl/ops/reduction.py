"""TRL's reduction of a per-token loss to the scalar it backpropagates, as a function of its inputs.

``aggregate_like_trl`` restates the ``loss_type`` branches of trl 1.16's ``GRPOTrainer._compute_loss``
(``tests/test_trl_hooks.py`` pins TRL's lines) with every trainer field it read made an argument, as
verl's ``agg_loss(loss_mat, loss_mask, loss_agg_mode, ...)`` does. The reduction is linear in the
per-token values, so a term reduced here and added to TRL's loss equals the term added to TRL's
per-token loss before TRL reduced it: GAD's KL term rides on TRL's policy loss this way.

Letters: B rows of the microbatch, C completion width.
"""

from __future__ import annotations

import torch

from ..errors import InputError

LOSS_TYPES = ("grpo", "sapo", "bnpo", "dr_grpo", "cispo", "dapo", "vespo", "luspo")


def aggregate_like_trl(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, *, max_completion_length: int,
                       num_items_in_batch: torch.Tensor | None, num_processes: int,
                       gradient_accumulation_steps: int, steps_per_generation: int,
                       training: bool = True) -> torch.Tensor:
    """``per_token`` [B, C] over ``mask`` [B, C] (1 = in the loss) reduced to a scalar as TRL 1.16
    reduces its per-token loss for ``loss_type``:

    * ``grpo``, ``sapo``: the mean over rows of each row's token mean;
    * ``bnpo``: the token mean over the microbatch;
    * ``dr_grpo``: the token sum over ``B * max_completion_length``;
    * ``luspo``: the mean over rows of each row's token sum;
    * ``cispo``, ``dapo``, ``vespo``: the token sum over ``num_items_in_batch`` (the loss tokens of the
      whole generation batch, every process) per process, per microbatch of the accumulation window.

    In training the first four are divided by ``gradient_accumulation_steps`` (TRL's
    ``current_gradient_accumulation_steps``) and the last three's normaliser is scaled by
    ``gradient_accumulation_steps / steps_per_generation``; with ``training=False`` (TRL's eval mode)
    neither: eval neither splits nor accumulates the batch.

    >>> x, m = torch.tensor([[1.0, 3.0], [2.0, 9.0]]), torch.tensor([[1, 1], [1, 0]])
    >>> aggregate_like_trl(x, m, "bnpo", max_completion_length=2, num_items_in_batch=None, num_processes=1,
    ...                    gradient_accumulation_steps=1, steps_per_generation=1).item()  # (1 + 3 + 2) / 3
    2.0
    """
    accumulation = gradient_accumulation_steps if training else 1.0
    masked = per_token * mask  # [B, C]
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation  # [B] row means -> scalar
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / accumulation
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.size(0) * max_completion_length) / accumulation
    if loss_type in ("cispo", "dapo", "vespo"):
        if num_items_in_batch is None:
            raise InputError(f"loss_type={loss_type!r} normalises by num_items_in_batch (the generation batch's loss "
                             "tokens), but none was given; pass the batch's inputs['num_items_in_batch'].")
        normalizer = num_items_in_batch.clamp(min=1.0) / num_processes  # tokens per process
        if training:
            normalizer = normalizer * accumulation / steps_per_generation  # tokens per microbatch of the window
        return masked.sum() / normalizer
    if loss_type == "luspo":
        return masked.sum(-1).mean() / accumulation  # [B] row sums -> scalar
    raise InputError(f"loss_type={loss_type!r} has no TRL 1.16 reduction here; use one of {', '.join(LOSS_TYPES)}.")
