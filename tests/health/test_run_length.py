"""Health rules that cannot work in the run they are given: ``one_token`` where every completion is one token
long (its share is 1 on every step, healthy or not), and a rule whose patience exceeds the run's optimizer steps
(it can never fire). Asked for (``health_rule_actions``, or a patience other than its default) they are refused
before the first step; on by default they are off for the run, said in one line. The config refuses what it
can (``tests/configs/test_health_settings.py``); these are the cases only the trainer knows: a run by
``num_train_epochs``, whose step count exists at train start, and a TRL config, whose health fields the trainer
completes."""

import logging

import pytest
import trl
from conftest import arithmetic_prompts, length_reward

import grpotrl
from grpotrl.errors import InputError

HEALTH_LOG = "grpotrl.health.callbacks"


def _trainer(model, args, n_prompts=16):
    return grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, args=args,
                               train_dataset=arithmetic_prompts(n_prompts))


def test_one_token_is_off_where_every_completion_is_one_token(tiny_llama, grpo_args, caplog):
    """max_completion_length 1 under health_action 'stop' with patience 1: one_token's share is 1 on every step,
    so the rule stopped this healthy run at step 1. It is off for the run, with one warning (health_action asked
    every rule to stop); the run trains its 2 steps."""
    args = grpo_args(max_completion_length=1, guard_steps=0, health_action="stop", health_patience=1,
                     health_min_entropy=0.0, health_flat_reward_steps=0, health_report_steps=0,
                     health_rule_actions={"chat_header": "off"})
    with caplog.at_level(logging.INFO, logger=HEALTH_LOG):
        trainer = _trainer(tiny_llama, args)
        trainer.train()  # no HealthStop
    assert trainer.state.global_step == 2
    assert [h["completions/one_token_share"] for h in trainer.state.log_history[:2]] == [1.0, 1.0]  # as built
    lines = [r for r in caplog.records if "one_token is off for this run" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert "with max_completion_length=1 every completion is one token long" in lines[0].getMessage()


def test_an_epoch_run_shorter_than_an_asked_rules_patience_is_refused_at_train_start(tiny_llama, grpo_args):
    """max_steps -1: the run's length (4 prompts x 4 generations, 8 rows a step: 2 steps) is known at train
    start only. entropy_collapse set to stop at the default patience 5 can never stop it: refused there, before
    the first step."""
    trainer = _trainer(tiny_llama, grpo_args(max_steps=-1, num_train_epochs=1, guard_steps=0,
                                             health_rule_actions={"entropy_collapse": "stop"}), n_prompts=4)
    with pytest.raises(InputError) as err:
        trainer.train()
    assert str(err.value).startswith("health_rule_actions={'entropy_collapse': 'stop'} with health_patience=5 and "
                                     "num_train_epochs=1 (2 optimizer steps): "), str(err.value)
    assert "in a run of 2 steps it can never stop. Set health_patience to at most 2" in str(err.value)
    assert trainer.state.global_step == 0


def test_a_trl_configs_patience_beyond_max_steps_is_refused_at_train_start(tiny_llama, tmp_path):
    """A ``trl.GRPOConfig`` carries no health fields until the trainer completes it, so its config cannot tell a
    patience the user set from grpotrl's default; the trainer can: refused before the first step."""
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=4, max_steps=2, report_to="none", use_cpu=True, save_strategy="no")
    args.health_patience = 3
    trainer = _trainer(tiny_llama, args)
    with pytest.raises(InputError, match=r"^health_patience=3 with max_steps=2: entropy_collapse and one_token fire "
                                         r"once their condition held on 3 consecutive optimizer steps"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_rules_on_by_default_that_an_epoch_run_is_too_short_for_are_off_said_once(tiny_llama, grpo_args, caplog):
    """The same 2-step epoch run at the default settings trains, with one info line naming the rules it is too
    short for (patience 5 and 20), nothing at warning level."""
    with caplog.at_level(logging.INFO, logger=HEALTH_LOG):
        trainer = _trainer(tiny_llama, grpo_args(max_steps=-1, num_train_epochs=1, guard_steps=0,
                                                 max_completion_length=4, health_report_steps=0), n_prompts=4)
        trainer.train()
    assert trainer.state.global_step == 2
    lines = [r for r in caplog.records if r.name == HEALTH_LOG]
    assert [(r.levelno, r.getMessage()) for r in lines] == [
        (logging.INFO, "grpotrl health: entropy_collapse, one_token, flat_rewards cannot fire in this run of 2 "
                       "optimizer steps (health_patience=5, health_flat_reward_steps=20 consecutive steps needed), "
                       "so they are off for it.")]
