"""A health rule set to stop always yields its checkpoint and ``HealthStop``, whatever the save and
evaluation strategies, and that checkpoint resumes and deletes nothing: ``save_strategy="best"`` (an
evaluation at the stop step that finds no new best skips the Trainer's save), ``save_total_limit``
(the stop's save would rotate away the last checkpoint before the stop), ``save_only_model=True`` (a
weights-only checkpoint cannot resume). Also: NonFiniteRule never calls a step finite that it could
not check. Tiny random model, 4-token completions, a reward that is always 0 so that ``flat_rewards``
fires on the step its patience says."""

import logging
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import arithmetic_prompts

import grpotrl
from grpotrl import HealthStop
from grpotrl.checkpoints import checkpoint_problems, resume_files
from grpotrl.health.callbacks import NonFiniteRule, StepFindings, stop_save_settings


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def flat_stop(grpo_args, steps: int, **overrides):
    """Settings whose run ``flat_rewards`` stops at step ``steps``."""
    return grpo_args(max_completion_length=4, guard_steps=0, health_flat_reward_steps=steps,
                     health_rule_actions={"flat_rewards": "stop"}, **overrides)


def stopped(model, args, **kwargs) -> tuple[HealthStop, grpotrl.GRPOTrainer]:
    trainer = grpotrl.GRPOTrainer(model=model, reward_funcs=zero_reward, args=args,
                                  train_dataset=arithmetic_prompts(), **kwargs)
    with pytest.raises(HealthStop) as err:
        trainer.train()
    return err.value, trainer


def checkpoints_in(directory: str) -> list[str]:
    return sorted((n for n in os.listdir(directory) if n.startswith("checkpoint-")), key=lambda n: int(n[11:]))


def test_a_stop_under_save_strategy_best_saves_its_checkpoint_and_raises(tiny_llama, grpo_args):
    """Every step evaluates; rewards are all 0, so step 2's evaluation is no new best and the Trainer resets
    the save the rule asked for. The run used to return normally at step 2, with no HealthStop and only
    checkpoint-1 (step 1's best) on disk."""
    args = flat_stop(grpo_args, 2, max_steps=4, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8,
                     save_strategy="best", metric_for_best_model="eval_reward", greater_is_better=True)
    err, trainer = stopped(tiny_llama, args, eval_dataset=arithmetic_prompts(8))
    assert err.rule == "flat_rewards" and err.step == 2 and trainer.state.global_step == 2
    assert err.checkpoint == os.path.join(args.output_dir, "checkpoint-2")
    assert checkpoint_problems(err.checkpoint, resume_files(args, "grpo")) == []
    assert checkpoints_in(args.output_dir) == ["checkpoint-1", "checkpoint-2"]  # the best one is kept
    assert trainer.state.log_history[-1]["step"] == 2 and "eval_reward" in trainer.state.log_history[-1]


def test_the_stop_checkpoint_deletes_no_earlier_checkpoint_under_save_total_limit(tiny_llama, grpo_args):
    """save_total_limit=1: the stop's save at step 3 used to rotate away checkpoint-2, the last one saved
    before the rule fired, which may be the state to go back to."""
    args = flat_stop(grpo_args, 3, max_steps=6, save_strategy="steps", save_steps=2, save_total_limit=1)
    err, trainer = stopped(tiny_llama, args)
    assert err.step == 3
    assert checkpoints_in(args.output_dir) == ["checkpoint-2", "checkpoint-3"]
    assert trainer.args.save_total_limit == 1  # suspended for that one save only


def test_the_stop_checkpoint_under_save_only_model_is_full_and_resumes(tiny_llama, grpo_args):
    """save_only_model=True used to write a weights-only checkpoint that a resume refuses, while HealthStop
    said that resume_from_checkpoint works."""
    args = flat_stop(grpo_args, 2, max_steps=4, save_only_model=True)
    err, trainer = stopped(tiny_llama, args)
    assert "(resume_from_checkpoint works)" in str(err) and err.resumable
    assert checkpoint_problems(err.checkpoint, resume_files(args, "grpo")) == []
    assert trainer.args.save_only_model is True
    trainer.end()
    resumed = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=zero_reward, train_dataset=arithmetic_prompts(),
                                  args=grpo_args(max_steps=3, max_completion_length=4, guard_steps=0,
                                                 save_only_model=True, health_action="off"))
    resumed.train(resume_from_checkpoint=err.checkpoint)
    assert resumed.state.global_step == 3
    resumed.end()


def test_a_weights_only_stop_checkpoint_is_not_called_resumable():
    """A model sharded at load time cannot checkpoint its optimizer: the stop's save keeps save_only_model, and
    HealthStop says the checkpoint starts a new run only."""
    sharded = SimpleNamespace(is_distributed_loading_by_transformers=True)
    assert stop_save_settings(sharded, stopping=True) == {"save_total_limit": None}
    assert stop_save_settings(SimpleNamespace(), stopping=True) == {"save_total_limit": None, "save_only_model": False}
    assert stop_save_settings(SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[]))) == {}
    stop = HealthStop("flat_rewards", 2, "flat.", "/out/checkpoint-2", resumable=False)
    assert (stop.rules, stop.rule) == (("flat_rewards",), "flat_rewards")  # one rule: a tuple of one
    message = str(stop)
    assert "resume_from_checkpoint works" not in message
    assert "weights only, no optimizer or RNG state: it cannot resume this run" in message


def nonfinite_rule(losses: list, grads: list[torch.Tensor | None]) -> NonFiniteRule:
    """NonFiniteRule over a stand-in trainer whose step recorded ``losses`` and whose parameters hold ``grads``."""
    model = torch.nn.Module()
    for i, grad in enumerate(grads):
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = grad
        model.register_parameter(f"p{i}", p)
    trainer = SimpleNamespace(args=SimpleNamespace(health_rule_actions=None, health_action="auto"),
                              step_findings=StepFindings(losses=list(losses)), model=model,
                              accelerator=SimpleNamespace(num_processes=1))  # one process: nothing to agree on
    return NonFiniteRule(trainer)


def test_a_step_without_loss_or_gradient_is_unchecked_never_finite(caplog):
    """Nothing recorded (no loss in step_findings, no .grad: a loss path that records none under ZeRO) used to
    read as loss 0 and gradient norm 0, a healthy step."""
    rule = nonfinite_rule([], [None])
    state = SimpleNamespace(global_step=4)
    with caplog.at_level(logging.WARNING, logger="grpotrl"):
        for _ in range(2):
            rule.on_pre_optimizer_step(None, state, None)
            assert rule.check() is None
    warned = [r.getMessage() for r in caplog.records if "[non_finite]" in r.getMessage()]
    assert len(warned) == 1 and "NaN/inf is not checked" in warned[0]
    only_grad = nonfinite_rule([], [torch.tensor([3.0, 4.0])])
    only_grad.on_pre_optimizer_step(None, state, None)
    assert only_grad.check() == (False, 5.0, "loss not recorded, gradient norm 5 (after clipping, before the "
                                             "optimizer step)")
    only_loss = nonfinite_rule([torch.tensor(float("nan"))], [None])
    only_loss.on_pre_optimizer_step(None, state, None)
    broken, _, condition = only_loss.check()
    assert broken and condition.startswith("loss nan, gradient norm not in .grad")
