"""I11, the loss's own denominator: on guard steps the weight each loss token carries in TRL's
loss, read from the loss's gradient, equals 1 / the normaliser recomputed from the completion mask, the
accumulation window and the world size (``grpotrl/guards/denominator.py``)."""
import pytest
import torch
from conftest import arithmetic_prompts, length_reward

import grpotrl
from grpotrl.errors import InvariantError
from grpotrl.guards.denominator import check_denominator, expected_normaliser, token_slope
from grpotrl.ops.loss_types import LOSS_TYPES, PerToken

MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])  # row 0: 3 loss tokens, row 1: 1; B = 2, C = 4

NORMALISER_BY_HAND = {
    "grpo": [3 * 2 * 2, 1 * 2 * 2],  # n_i * B * GA
    "sapo": [12, 4],
    "bnpo": [4 * 2, 4 * 2],  # the microbatch's 4 tokens * GA
    "dr_grpo": [2 * 6 * 2, 24],  # B * max_completion_length (6) * GA
    "luspo": [2 * 2, 4],  # B * GA
    "dapo": [10 / 2 * 2 / 2] * 2,  # 10 window tokens over 2 processes, GA 2, steps_per_generation 2: 5
    "cispo": [5.0, 5.0],
    "vespo": [5.0, 5.0],
}


@pytest.mark.parametrize("loss_type, want", NORMALISER_BY_HAND.items())
def test_I11_expected_normaliser_by_hand(loss_type, want):
    got = expected_normaliser(loss_type, MASK, max_completion_length=6, accumulation=2, window_tokens=10.0,
                              num_processes=2, steps_per_generation=2)
    assert got.tolist() == pytest.approx(want)


def test_I11_every_loss_type_of_the_table_has_a_hand_worked_normaliser():
    assert set(NORMALISER_BY_HAND) == set(LOSS_TYPES)


def test_I11_token_sum_loss_types_need_the_window_tokens_and_unknown_ones_are_named():
    for name, kind in LOSS_TYPES.items():
        if kind.token_sum:
            with pytest.raises(ValueError, match=f"loss_type='{name}'.*window_tokens"):
                expected_normaliser(name, MASK, max_completion_length=6, accumulation=2, window_tokens=None,
                                    num_processes=2, steps_per_generation=2)
        else:
            got = expected_normaliser(name, MASK, max_completion_length=6, accumulation=2, window_tokens=None,
                                      num_processes=2, steps_per_generation=2)
            assert got.tolist() == pytest.approx(NORMALISER_BY_HAND[name]), name
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        expected_normaliser("ppo", MASK, max_completion_length=6, accumulation=2, window_tokens=10.0,
                            num_processes=2, steps_per_generation=2)
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        token_slope("ppo", torch.ones(2), torch.zeros(2, 4), MASK, sequence_level=False, epsilon_low=0.2,
                    epsilon_high=0.2)


def test_I11_token_slope_by_hand():
    """d l_t / d logp_t at the ratio r, advantage A = 2: the clipped family -A r inside the clip, unreadable
    outside; sapo -A 4 s (1 - s) r, which is -A at r = 1; cispo -A min(r, eps_high); A = 0 unreadable."""
    adv, mask = torch.tensor([2.0, 0.0]), torch.ones(2, 2)
    log_ratio = torch.tensor([[0.0, 0.5], [0.0, 0.0]])  # r = 1 and e^0.5 = 1.6487 (clipped at 1.2)
    kw = dict(sequence_level=False, epsilon_low=0.2, epsilon_high=0.2)
    dapo = token_slope("dapo", adv, log_ratio, mask, **kw)
    assert dapo[0, 0].item() == -2.0 and dapo[0, 1].isnan() and dapo[1].isnan().all()
    sapo = token_slope("sapo", adv, log_ratio, mask, **kw)
    assert sapo[0, 0].item() == pytest.approx(-2.0)
    assert torch.isnan(sapo[1]).all()
    cispo = token_slope("cispo", adv, log_ratio, mask, **kw)
    assert cispo[0].tolist() == pytest.approx([-2.0 * 0.2, -2.0 * 0.2])  # min(r, 0.2) = 0.2 for both
    # vespo: phi(w) = 1 only where the row's summed log-ratio is 0: row 0 sums 0.5 (unreadable), row 1 has A = 0
    vespo = token_slope("vespo", adv, log_ratio, mask, **kw)
    assert vespo.isnan().all()
    vespo = token_slope("vespo", adv, torch.zeros(2, 2), mask, **kw)
    assert vespo[0].tolist() == [-2.0, -2.0] and vespo[1].isnan().all()


def test_I11_loss_types_of_one_per_token_family_share_one_slope():
    """The slope is the family's (``PerToken``), whatever the normaliser: e.g. grpo, bnpo, dr_grpo, dapo, luspo."""
    adv, mask = torch.tensor([2.0, -1.0]), torch.ones(2, 3)
    log_ratio = torch.tensor([[0.0, 0.1, 0.5], [-0.1, 0.0, 0.05]])
    kw = dict(sequence_level=False, epsilon_low=0.2, epsilon_high=0.2)
    for family in PerToken:
        names = [name for name, kind in LOSS_TYPES.items() if kind.per_token is family]
        first = token_slope(names[0], adv, log_ratio, mask, **kw)
        for name in names[1:]:
            assert torch.equal(token_slope(name, adv, log_ratio, mask, **kw).isnan(), first.isnan()), name
            assert torch.allclose(token_slope(name, adv, log_ratio, mask, **kw).nan_to_num(), first.nan_to_num())


def test_I11_check_denominator_names_the_loss_type_expected_and_found():
    grad = torch.tensor([[-0.5, -0.5]])  # d loss / d logp = w * slope, slope -2 (A = 2): w = 1/4
    slope = torch.tensor([[-2.0, -2.0]])
    metrics = check_denominator("dapo", grad, slope, torch.tensor([4.0]), torch.ones(1, 2))
    assert metrics["guards/denominator_checked_share"] == 1.0
    with pytest.raises(InvariantError, match=r"loss_type='dapo'.* by 4 \(found\).* is 8 \(expected\)"):
        check_denominator("dapo", grad, slope, torch.tensor([8.0]), torch.ones(1, 2))
    with pytest.raises(InvariantError, match="NaN or inf"):
        check_denominator("dapo", torch.tensor([[float("nan"), 1.0]]), slope, torch.tensor([4.0]), torch.ones(1, 2))


def test_I11_a_token_whose_expected_gradient_underflows_is_unreadable_not_a_stop():
    """An advantage an importance ratio scaled to ~1e-40 (a sampler far from the trainer): its expected
    gradient 1e-40 / 4 is below float32's normal range, and the loss's gradient rounds to 0 there. Found
    in the merged suite: read as 'divides by inf'. It is counted as unchecked; the other token still is."""
    grad = torch.tensor([[-0.5, 0.0]])
    slope = torch.tensor([[-2.0, -1e-40]])
    metrics = check_denominator("dapo", grad, slope, torch.tensor([4.0]), torch.ones(1, 2))
    assert metrics["guards/denominator_checked_share"] == 0.5
    with pytest.raises(InvariantError, match=r"by -?inf \(found\)"):  # a normal-range slope with no gradient stops
        check_denominator("dapo", torch.tensor([[-0.5, 0.0]]), torch.tensor([[-2.0, -2.0]]), torch.tensor([4.0]),
                          torch.ones(1, 2))


class MicrobatchTokenDapo(grpotrl.GRPOTrainer):
    """The bug class of trl#5619, reintroduced: dapo divides each microbatch by its own token count instead of
    the accumulation window's. TRL's normaliser is num_items_in_batch / world * GA / steps_per_generation;
    with GA = steps_per_generation = 2 on one process, handing it the microbatch's count makes it exactly that."""

    def _compute_loss(self, model, inputs):
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        return super()._compute_loss(model, {**inputs, "num_items_in_batch": mask.sum()})


def test_I11_dapo_by_the_microbatch_tokens_is_stopped_at_step_1(tiny_llama, grpo_args):
    trainer = MicrobatchTokenDapo(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                  args=grpo_args(loss_type="dapo", gradient_accumulation_steps=2, max_steps=1))
    with pytest.raises(InvariantError, match=r"I11.*loss_type='dapo'.*\(found\).*\(expected\)"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_I11_every_loss_type_passes_with_accumulation(tiny_llama, grpo_args, loss_type, accumulation):
    """Control: TRL 1.16's own loss, every loss type, GA 1 and 2: the check runs, reads most tokens, passes."""
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                  args=grpo_args(loss_type=loss_type, gradient_accumulation_steps=accumulation,
                                                 max_steps=1))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "guards/denominator_checked_share" in h]
    assert logged and logged[0]["guards/denominator_checked_share"] > 0.3, logged
    assert logged[0]["guards/denominator_max_rel_error"] < 1e-4


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_I11_an_epochs_last_partial_window_is_read_with_its_real_accumulation_count(tiny_llama, grpo_args,
                                                                                   loss_type):
    """3 prompts x 4 completions, one prompt per microbatch, gradient_accumulation_steps 2: the epoch is a window
    of 2 microbatches, then one of 1. TRL (and the Trainer) divide that last window by
    ``current_gradient_accumulation_steps`` = 1, not the configured 2; I11 expects the same, so the correct update
    passes (read with the configured 2, it stopped: 'divides row 0's tokens by 44, expected 88')."""
    args = grpo_args(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
                     steps_per_generation=1, max_steps=-1, num_train_epochs=1, loss_type=loss_type)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(3),
                                  args=args)
    trainer.train()
    assert trainer.state.global_step == 2  # the full window, then the partial one
    logged = [h for h in trainer.state.log_history if "guards/denominator_checked_share" in h]
    assert len(logged) == 2 and all(h["guards/denominator_checked_share"] > 0.3 for h in logged), logged
    assert max(h["guards/denominator_max_rel_error"] for h in logged) < 1e-4
