"""``ops.reduction.aggregate_like_trl``: TRL 1.16's per-token loss reduction, one hand-worked case per
loss_type (tests/trainers/test_trl_hooks.py pins TRL's own lines for each).

Every case reduces the same microbatch, B=2 rows, C=3 tokens:

    per_token = [[1, 2, 3],        mask = [[1, 1, 0],      per_token * mask = [[1, 2, 0],
                 [4, 5, 6]]                [1, 0, 0]]                          [4, 0, 0]]

    row sums   = [1+2, 4]  = [3, 4]      token total = 7
    row counts = [2, 1]                  token count = 3
    row means  = [3/2, 4/1] = [1.5, 4]

Training with gradient_accumulation_steps=2, steps_per_generation=4, num_processes=2,
max_completion_length=4, num_items_in_batch=12 (the generation batch's loss tokens, all processes).
"""

import pytest
import torch

from grpotrl.ops.loss_types import LOSS_TYPES, Normaliser, named
from grpotrl.ops.reduction import aggregate_like_trl

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # [B=2, C=3]
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])  # [B, C]
SETTINGS = dict(max_completion_length=4, num_items_in_batch=torch.tensor(12), num_processes=2,
                gradient_accumulation_steps=2, steps_per_generation=4)

# loss_type -> (training, eval), worked out by hand from the module docstring's table
EXPECTED = {
    # mean of row means = (1.5 + 4) / 2 = 2.75; training divides by accumulation 2 -> 1.375
    "grpo": (1.375, 2.75),
    "sapo": (1.375, 2.75),
    # token total / token count = 7 / 3; training / 2 -> 7 / 6
    "bnpo": (7 / 6, 7 / 3),
    # token total / (B * max_completion_length) = 7 / (2 * 4) = 7 / 8; training / 2 -> 7 / 16
    "dr_grpo": (7 / 16, 7 / 8),
    # normaliser = 12 tokens / 2 processes = 6 per process (eval: 7 / 6);
    # training: 6 * accumulation 2 / steps_per_generation 4 = 3 per microbatch -> 7 / 3
    "cispo": (7 / 3, 7 / 6),
    "dapo": (7 / 3, 7 / 6),
    "vespo": (7 / 3, 7 / 6),
    # mean of row sums = (3 + 4) / 2 = 3.5; training / 2 -> 1.75
    "luspo": (1.75, 3.5),
}


@pytest.mark.parametrize("loss_type", sorted(EXPECTED))
def test_reduction_by_hand_per_loss_type(loss_type):
    train, evaluate = EXPECTED[loss_type]
    got = aggregate_like_trl(PER_TOKEN, MASK, loss_type, **SETTINGS)
    assert got.item() == pytest.approx(train, rel=1e-6)
    got = aggregate_like_trl(PER_TOKEN, MASK, loss_type, **SETTINGS, training=False)
    assert got.item() == pytest.approx(evaluate, rel=1e-6)


def test_every_loss_type_has_a_hand_worked_case():
    assert set(LOSS_TYPES) == set(EXPECTED)


def test_empty_rows_count_one_token_not_zero():
    # a row with no loss token: TRL clamps its count to 1 (no 0/0): grpo row means [1.5, 0/1 = 0] -> 0.75
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    got = aggregate_like_trl(PER_TOKEN, mask, "grpo", **{**SETTINGS, "gradient_accumulation_steps": 1})
    assert got.item() == pytest.approx(0.75)


def test_reduction_is_linear_so_a_term_can_ride_on_trls_loss():
    # GAD adds beta * reduce(kl) to TRL's reduce(loss): equal to reduce(loss + beta * kl)
    kl = torch.tensor([[0.5, -1.0, 7.0], [2.0, 3.0, 4.0]])
    for loss_type in EXPECTED:
        apart = aggregate_like_trl(PER_TOKEN, MASK, loss_type, **SETTINGS) \
            + 0.1 * aggregate_like_trl(kl, MASK, loss_type, **SETTINGS)
        together = aggregate_like_trl(PER_TOKEN + 0.1 * kl, MASK, loss_type, **SETTINGS)
        assert apart.item() == pytest.approx(together.item(), rel=1e-6), loss_type


def test_unknown_loss_type_and_missing_token_count_are_named():
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        aggregate_like_trl(PER_TOKEN, MASK, "ppo", **SETTINGS)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        aggregate_like_trl(PER_TOKEN, MASK, "dapo", **{**SETTINGS, "num_items_in_batch": None})


def test_unknown_loss_type_is_named_with_trls_list():
    with pytest.raises(ValueError, match="loss_type='ppo' is not one of TRL 1.16's: grpo, sapo, bnpo"):
        named("ppo")


def test_only_token_sum_loss_types_need_the_generation_batchs_token_count():
    # the ROW_TOKEN_MEAN, MICROBATCH_TOKENS, MAX_LENGTH_ROWS, ROWS normalisers never read num_items_in_batch
    for name, kind in LOSS_TYPES.items():
        assert kind.token_sum == (kind.normaliser is Normaliser.WINDOW_TOKENS), name
        if kind.token_sum:
            with pytest.raises(ValueError, match="num_items_in_batch"):
                aggregate_like_trl(PER_TOKEN, MASK, name, **{**SETTINGS, "num_items_in_batch": None})
        else:
            got = aggregate_like_trl(PER_TOKEN, MASK, name, **{**SETTINGS, "num_items_in_batch": None})
            assert got.item() == pytest.approx(EXPECTED[name][0], rel=1e-6), name


# One optimizer step of 4 rows in 2 microbatches of 2 rows (gradient_accumulation_steps=2 = steps_per_generation,
# num_items_in_batch = all 7 loss tokens), grouped two ways. Row i's per-token loss is i + 1 on each token:
#
#     rows 0..3: tokens [1, 1, 1], [2, 0, 0], [3, 3, 0], [4, 0, 0]   (loss, masked)   counts [3, 1, 2, 1]
#
# bnpo divides each microbatch by its own token count, then by GA 2:
#   {0, 1} + {2, 3}: (3 + 2) / 4 / 2 + (6 + 4) / 3 / 2 = 0.625 + 1.6667 = 2.2917
#   {0, 2} + {1, 3}: (3 + 6) / 5 / 2 + (2 + 4) / 2 / 2 = 0.9 + 1.5 = 2.4
# every other normaliser gives each row the same divisor in either grouping: the same sum.
STEP_LOSS = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [3.0, 3.0, 3.0], [4.0, 4.0, 4.0]])  # [4, C]
STEP_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]])
STEP = dict(max_completion_length=4, num_items_in_batch=torch.tensor(7), num_processes=1,
            gradient_accumulation_steps=2, steps_per_generation=2)


def _step_loss(loss_type, grouping):
    return sum(aggregate_like_trl(STEP_LOSS[list(g)], STEP_MASK[list(g)], loss_type, **STEP).item()
               for g in grouping)


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_grouping_free_means_the_step_loss_does_not_depend_on_the_microbatches(loss_type):
    """What ``trainers.padding_free.resolve_balance`` relies on to regroup an optimizer step's rows."""
    trl_grouping, regrouped = _step_loss(loss_type, [(0, 1), (2, 3)]), _step_loss(loss_type, [(0, 2), (1, 3)])
    if named(loss_type).grouping_free:
        assert regrouped == pytest.approx(trl_grouping, rel=1e-6)
    else:
        assert (trl_grouping, regrouped) == pytest.approx((5 / 4 / 2 + 10 / 3 / 2, 9 / 5 / 2 + 6 / 2 / 2), rel=1e-6)
