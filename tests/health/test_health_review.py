"""Health rules must not stop a healthy run and must not pass one they cannot verify: a microbatch with no
loss token is no entropy reading (TRL logs 0.0 for it), fp16's loss scaler overflows by design, and a NaN is
never read as healthy. Stand-in trainers for the rule's arithmetic; one tiny-model run for the end-to-end
case (2-token completions, every one truncated under ``mask_truncated_completions``)."""

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import arithmetic_prompts, length_reward

import grpotrl
from grpotrl.health.callbacks import EntropyRule, NonFiniteRule, StepFindings


def entropy_rule(metrics: dict[str, list]) -> EntropyRule:
    """EntropyRule over a stand-in trainer whose step appended ``metrics`` to TRL's lists."""
    trainer = SimpleNamespace(args=SimpleNamespace(health_rule_actions=None, health_action="auto"),
                              metric_values=lambda: metrics)
    return EntropyRule(trainer, patience=1, min_entropy=0.02)


def test_entropy_of_a_microbatch_without_loss_tokens_is_not_a_collapse():
    # TRL's entropy per microbatch: 0.0 for a microbatch whose every row was truncated (0 / clamp(0, 1));
    # grpotrl's entropy/sample_mean of it is NaN. Step of two microbatches: [0.0 (no token), 0.9]
    # -> the step's entropy is 0.9, not (0 + 0.9) / 2 = 0.45
    rule = entropy_rule({"entropy": [0.0, 0.9], "entropy/sample_mean": [math.nan, 0.85]})
    assert rule.check() == (False, 0.9, "mean token entropy 0.9 < health_min_entropy=0.02")
    # every microbatch without a loss token: the step observed no entropy (neither broken nor healthy)
    assert entropy_rule({"entropy": [0.0, 0.0], "entropy/sample_mean": [math.nan, math.nan]}).check() is None
    # a real entropy of 0.001 stays a collapse: its rows do have tokens
    broken, value, _ = entropy_rule({"entropy": [0.001], "entropy/sample_mean": [0.001]}).check()
    assert broken and value == 0.001


def test_a_nan_entropy_is_broken_never_healthy():
    # NaN logits: TRL's entropy NaN, so are the per-sample means. NaN < 0.02 is False: it used to pass
    broken, value, condition = entropy_rule({"entropy": [math.nan], "entropy/sample_mean": [math.nan]}).check()
    assert broken and math.isnan(value) and "NaN" in condition


def test_every_completion_truncated_is_not_an_entropy_collapse(tiny_llama, grpo_args):
    """A random tiny model (entropy ~ln V) with 2-token completions that never stop, under
    mask_truncated_completions: no loss token anywhere, TRL logs entropy 0.0. The rule set to stop with
    patience 1 used to stop this run at step 1: "mean token entropy 0 < health_min_entropy=0.02"."""
    args = grpo_args(max_steps=1, max_completion_length=2, mask_truncated_completions=True, guard_steps=0,
                     generation_kwargs={"sequence_bias": [[[0], -100.0], [[2], -100.0]]},
                     health_patience=1, health_rule_actions={"entropy_collapse": "stop"})
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts())
    trainer.train()  # no HealthStop
    assert trainer.state.global_step == 1
    assert trainer.state.log_history[0]["completions/clipped_ratio"] == 1.0  # every row truncated, as built


def nonfinite_rule(loss: float, grad: float, scale: float | None) -> NonFiniteRule:
    """NonFiniteRule over a stand-in trainer: one recorded loss, one parameter whose .grad is ``grad``, and
    fp16's loss scaler at ``scale`` (None: no scaler, as in bf16 / fp32)."""
    model = torch.nn.Module()
    model.register_parameter("p", torch.nn.Parameter(torch.zeros(2)))
    model.p.grad = torch.tensor([grad, 0.0])
    scaler = torch.amp.GradScaler("cpu", init_scale=scale) if scale is not None else None
    trainer = SimpleNamespace(args=SimpleNamespace(health_rule_actions=None, health_action="auto"),
                              step_findings=StepFindings(losses=[torch.tensor(loss)]), model=model,
                              accelerator=SimpleNamespace(num_processes=1, scaler=scaler))
    return NonFiniteRule(trainer)


def test_fp16_loss_scaler_overflow_is_not_a_non_finite_stop():
    """fp16=True: accelerate's GradScaler starts at 2^16 and grows until a step overflows; that step's unscaled
    .grad holds inf (the loss is finite), the scaler skips the update and halves its scale. The rule used to
    stop a healthy fp16 run there and drop the gradients."""
    state = SimpleNamespace(global_step=0)
    rule = nonfinite_rule(loss=0.7, grad=math.inf, scale=65536.0)
    rule.on_pre_optimizer_step(None, state, None)
    broken, value, condition = rule.check()
    assert not broken and value == math.inf
    assert "fp16 loss scale 65536: the scaler skips this update" in condition
    assert rule.trainer.model.p.grad is not None  # left to the scaler
    # at a scale < 1 the unscaled gradient overflows too: broken, and the update is dropped
    low = nonfinite_rule(loss=0.7, grad=math.inf, scale=0.5)
    low.on_pre_optimizer_step(None, state, None)
    assert low.check()[0] and low.trainer.model.p.grad is None
    # a NaN loss is broken at any scale
    nan_loss = nonfinite_rule(loss=math.nan, grad=math.inf, scale=65536.0)
    nan_loss.on_pre_optimizer_step(None, state, None)
    assert nan_loss.check()[0]
    # no scaler (bf16, fp32): an inf gradient is broken, as before
    plain = nonfinite_rule(loss=0.7, grad=math.inf, scale=None)
    plain.on_pre_optimizer_step(None, state, None)
    assert plain.check()[0]


def test_flat_group_share_by_hand():
    from grpotrl import health

    # G=4: [1, 1, 1, 1] flat; [0, 0, 0, 0] flat; [1, 0, 0, 0] not; [nan, 3, 3, nan] flat (scored rows equal);
    # [nan, nan, nan, 5] flat (one scored: its advantage is 0). 4 of 5 groups flat
    nan = math.nan
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, nan, 3, 3, nan, nan, nan, nan, 5])  # [B=20]
    assert health.flat_group_share(rewards, 4) == 0.8
    # num_generations=2: [0.5, 0.5] flat, [0.5, 0.5 + 1e-3] not (beyond isclose's rtol 1e-5)
    assert health.flat_group_share(torch.tensor([0.5, 0.5, 0.5, 0.501]), 2) == 0.5


def test_flat_rewards_fires_on_flat_groups_under_batch_scaling():
    """scale_rewards='batch': TRL's frac_reward_zero_std is 1 only when the whole batch's std is 0. Every group
    flat at its own value (advantages all 0: nothing trains) read 0 there, and the rule never fired."""
    from grpotrl.health.callbacks import FlatRewardRule

    metrics = {"frac_reward_zero_std": [0.0], "rewards/flat_group_share": [1.0], "rewards/zero_share": [0.5]}
    trainer = SimpleNamespace(args=SimpleNamespace(health_rule_actions=None, health_action="auto"),
                              metric_values=lambda: metrics)
    assert FlatRewardRule(trainer, 1).check() == (True, 1.0, "every group's rewards are all equal "
                                                             "(50% of rewards exactly 0)")
    # without grpotrl's share (a trainer that does not log it): TRL's, as before
    metrics.pop("rewards/flat_group_share")
    assert FlatRewardRule(trainer, 1).check()[0] is False


def test_flat_rewards_stops_a_run_whose_groups_are_flat_at_different_values_under_batch_scaling(tiny_llama,
                                                                                              grpo_args):
    """A reward of the prompt alone: every group flat (at 1 or at 0), nothing trains; under scale_rewards='batch'
    TRL's frac_reward_zero_std reads 0, grpotrl's GRPO trainer logs rewards/flat_group_share 1 and the rule stops."""
    from grpotrl import HealthStop

    def by_prompt(prompts, completions, **kwargs):
        return [float("1 +" in str(p)) for p in prompts]  # half the prompts 1, half 0

    rows = arithmetic_prompts()
    assert 0 < sum("1 +" in str(r["prompt"]) for r in rows) < len(rows)
    args = grpo_args(max_steps=3, scale_rewards="batch", health_flat_reward_steps=2, max_completion_length=4,
                     health_rule_actions={"flat_rewards": "stop"}, guard_steps=0)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=by_prompt, args=args, train_dataset=rows)
    with pytest.raises(HealthStop, match="every group's rewards are all equal") as err:
        trainer.train()
    assert err.value.rule == "flat_rewards" and err.value.step == 2
    logged = [h for h in trainer.state.log_history if "rewards/flat_group_share" in h]
    assert logged and all(h["rewards/flat_group_share"] == 1.0 for h in logged)


def test_the_step_entropy_weights_each_microbatch_by_its_loss_tokens():
    # TRL's entropy is a token mean per microbatch; the step's is the token mean of all of them:
    # (0.01 * 3000 + 1.0 * 3) / 3003 = 0.010989..., a collapse; the mean of the two values, 0.505, hid it
    rule = entropy_rule({"entropy": [0.01, 1.0], "entropy/loss_tokens": [3000.0, 3.0],
                         "entropy/sample_mean": [0.01, 1.0]})
    broken, value, _ = rule.check()
    assert broken and value == pytest.approx(33.0 / 3003)
    # a microbatch without a loss token weighs 0 (TRL's 0.0 is no reading); a NaN counts as broken whatever its weight
    assert entropy_rule({"entropy": [0.0, 0.9], "entropy/loss_tokens": [0.0, 40.0]}).check()[:2] == (False, 0.9)
    assert entropy_rule({"entropy": [0.0], "entropy/loss_tokens": [0.0]}).check() is None
    broken, value, _ = entropy_rule({"entropy": [math.nan, 0.9], "entropy/loss_tokens": [0.0, 40.0]}).check()
    assert broken and math.isnan(value)


def test_the_loss_tokens_logged_beside_the_entropy_are_the_loss_masks(tiny_llama, grpo_args):
    """One microbatch a step (8 rows, accumulation 1), no truncation mask: the loss tokens are the completion
    tokens, TRL's ``completions/mean_length`` x 8 rows."""
    args = grpo_args(max_steps=2, max_completion_length=6, guard_steps=0, health_report_steps=0)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "entropy" in h]
    assert len(logs) == 2
    for h in logs:
        assert h["entropy/loss_tokens"] == pytest.approx(h["completions/mean_length"] * 8)
