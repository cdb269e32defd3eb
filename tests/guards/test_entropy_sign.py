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


@pytest.mark.parametrize("coef", [1e-5, 1e-3, 0.1, 2.0])
def test_I7_a_flipped_sign_is_stopped_however_small_c(coef):
    """A bonus that enters as ``+ c * H`` is 2c off ``-c``: relative to c, it is caught at c = 1e-5 too
    (an absolute tolerance of 1e-4 let every flipped c <= 5e-5 through)."""
    H = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    mask = torch.ones(1, 3)
    assert guards.check_entropy_sign(trl_bonus_loss(H, mask, coef), H, coef, 1.0, "the loss") == pytest.approx(-coef)
    with pytest.raises(InvariantError, match=r"\[I7\].*FLIPPED sign"):
        guards.check_entropy_sign(trl_bonus_loss(H, mask, -coef), H, coef, 1.0, "the loss")


def test_I7_half_precision_entropies_round_the_slope_within_the_tolerance():
    """bf16 entropies round each token's weight c / n to 8 bits, the same way on every token: at c = 0.1 over 6
    tokens the slope is -0.100342, 0.34% off, which is rounding, not a wrong weight."""
    H = torch.tensor([[1.0, 2.0, 3.0, 1.5, 0.5, 2.5]], dtype=torch.bfloat16, requires_grad=True)
    slope = guards.check_entropy_sign(trl_bonus_loss(H, torch.ones(1, 6), 0.1), H, 0.1, 1.0, "the loss")
    assert slope == pytest.approx(-0.100342, abs=1e-6)
    with pytest.raises(InvariantError, match=r"\[I7\].*the bonus is missing"):
        guards.check_entropy_sign(trl_bonus_loss(H, torch.ones(1, 6), 0.0), H, 0.1, 1.0, "the loss")
