"""I7 on a microbatch where the entropy bonus acts on no token (``guards.check_entropy_sign``, ``acts``).

TRL's bonus is ``c * sum(H * m) / max(sum(m), 1)`` over its effective mask ``m`` (the loss mask times the
top-entropy mask). Where ``m`` is empty (every row truncated under ``mask_truncated_completions``, an all-zero
tool mask, no token of this process above the top-entropy threshold) the bonus is ``c * 0 / 1``: the loss has
no entropy gradient whatever the sign, so ``d loss / d H`` must be 0 there, and the sign is not read."""

import pytest
import torch

from grpotrl import guards
from grpotrl.errors import InvariantError

C = 0.1


def trl_bonus_loss(H: torch.Tensor, mask: torch.Tensor, coef: float = C) -> torch.Tensor:
    """TRL 1.16's ``policy - c * H`` with a policy term that reads no entropy (GA 1)."""
    policy = torch.tensor(0.3)
    return policy - coef * (H * mask).sum() / mask.sum().clamp(min=1.0)


def test_I7_an_empty_bonus_mask_expects_slope_0_not_minus_c():
    H = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)  # [B=1, C=3]
    empty = torch.zeros(1, 3)
    loss = trl_bonus_loss(H, empty)
    # d loss / d H = -c * 0 / 1 = 0: correct for a bonus over no token
    assert guards.check_entropy_sign(loss, H, C, 1.0, "the GRPO loss", acts=False) == 0.0
    # read as if the bonus acted, it is "missing": what stopped correct runs
    with pytest.raises(InvariantError, match=r"\[I7\].*the bonus is missing"):
        guards.check_entropy_sign(loss, H, C, 1.0, "the GRPO loss", acts=True)


def test_I7_a_loss_that_reads_entropy_outside_an_empty_bonus_mask_is_stopped():
    """The bonus taken over every completion token (not the loss's tokens) while the loss mask is empty: the
    slope is -c, but no token carries the bonus, so the loss reads entropies it does not train on."""
    H = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    loss = trl_bonus_loss(H, torch.ones(1, 3))
    with pytest.raises(InvariantError, match=r"\[I7\].*must be \+0: the bonus acts on no token of this microbatch"):
        guards.check_entropy_sign(loss, H, C, 1.0, "the GRPO loss", acts=False)


def test_I7_a_microbatch_with_bonus_tokens_still_needs_minus_c():
    H = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert guards.check_entropy_sign(trl_bonus_loss(H, mask), H, C, 1.0, "the GRPO loss") == pytest.approx(-C)
    with pytest.raises(InvariantError, match=r"\[I7\].*the bonus is missing"):  # the bonus dropped on real tokens
        guards.check_entropy_sign(trl_bonus_loss(H, mask, coef=0.0), H, C, 1.0, "the GRPO loss")
    with pytest.raises(InvariantError, match=r"\[I7\].*coefficient in force is c = -0.1"):  # acts or not
        guards.check_entropy_sign(trl_bonus_loss(H, torch.zeros(1, 3)), H, -C, 1.0, "the GRPO loss", acts=False)
