"""Two health rules that stop on the same step stop the run once: one checkpoint, one ``HealthStop`` that
names every rule that stopped and each one's reason. Tiny random model, 4-token completions, a reward that
is always 0 (``flat_rewards`` fires on step 1) and ``health_min_entropy`` far above any entropy a
model has (``entropy_collapse`` fires on step 1 too), both set to stop."""

import os

import pytest
from conftest import arithmetic_prompts

import grpotrl
from grpotrl import HealthStop
from grpotrl.checkpoints import checkpoint_problems, resume_files


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.parametrize("save_strategy", ["no", "best"])
def test_two_rules_stopping_on_one_step_raise_one_health_stop_naming_both(tiny_llama, grpo_args, save_strategy):
    """The first rule's ``on_save`` used to raise ``HealthStop`` for itself alone: the second rule's stop and
    its reason were lost. ``save_strategy="best"`` without an evaluation takes the rules' own save
    (``on_epoch_end``), which must happen once too."""
    best = dict(metric_for_best_model="reward") if save_strategy == "best" else {}
    args = grpo_args(max_steps=3, max_completion_length=4, guard_steps=0, save_strategy=save_strategy, **best,
                     health_patience=1, health_flat_reward_steps=1, health_min_entropy=1e6,
                     health_rule_actions={"flat_rewards": "stop", "entropy_collapse": "stop"})
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=zero_reward, args=args,
                                  train_dataset=arithmetic_prompts())
    saves = []
    original = trainer._save_checkpoint
    trainer._save_checkpoint = lambda model, trial: (saves.append(trainer.state.global_step),
                                                     original(model, trial))[1]
    with pytest.raises(HealthStop) as caught:
        trainer.train()
    err = caught.value
    assert saves == [1] and trainer.state.global_step == 1
    assert err.step == 1 and err.rules == ("entropy_collapse", "flat_rewards")  # the rules' order in the callbacks
    assert err.rule == "entropy_collapse, flat_rewards"  # one string, as before
    text = str(err)
    assert text.startswith("[health: entropy_collapse, flat_rewards] step 1: ")
    assert "entropy_collapse: mean token entropy" in text and "< health_min_entropy=1000000.0" in text
    assert "flat_rewards: every group's rewards are all equal" in text
    assert err.checkpoint == os.path.join(args.output_dir, "checkpoint-1") and err.resumable
    assert text.count("Checkpoint saved to") == 1
    assert checkpoint_problems(err.checkpoint, resume_files(args, "grpo")) == []
    assert not any(rule.stopping for rule in trainer.callback_handler.callbacks
                   if isinstance(rule, grpotrl.health.callbacks.HealthRule))  # nothing left pending
