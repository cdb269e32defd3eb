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
    patience the user set from grpotrl's default; the trainer can, against ``PATIENCE_DEFAULTS``: refused when it
    is built, before the model trains."""
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=4, max_steps=2, report_to="none", use_cpu=True, save_strategy="no")
    args.health_patience = 3
    with pytest.raises(InputError, match=r"^health_patience=3 with max_steps=2: entropy_collapse and one_token fire "
                                         r"once their condition held on 3 consecutive optimizer steps"):
        _trainer(tiny_llama, args)


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


# (settings, the steps that generate in a 6-step run, hand-derived): one generation batch of 8 rows every 2 optimizer
# steps (num_iterations 2, steps_per_generation = gradient_accumulation_steps = 1): steps 1, 3, 5; one every 3
# microbatches of 4 rows, 2 microbatches a step: microbatches 0, 3, 6, 9 of 12, in steps 1, 2, 4, 5
SCHEDULES = [({"num_iterations": 2}, [1, 3, 5], "1 x 2 = 2 microbatches, and an optimizer step is "
              "gradient_accumulation_steps=1 of them"),
             ({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_generation": 3},
              [1, 2, 4, 5], "3 x 1 = 3 microbatches, and an optimizer step is gradient_accumulation_steps=2 of them")]


@pytest.mark.parametrize("schedule, generating, every", SCHEDULES, ids=["iterations2", "spg3_gas2"])
def test_generation_batch_rules_count_the_steps_that_generate(tiny_llama, grpo_args, caplog, schedule, generating,
                                                              every):
    """Rewards always 0: every group is flat on every generation batch. The batch's signals are logged on the steps
    that generate only; flat_rewards at a patience of exactly that count (``generating_steps``) stops on the last of
    them, and one_token at its default patience 5 cannot fire on 3 or 4 generation batches: off, said in one line."""
    from test_stop_checkpoint import zero_reward

    args = grpo_args(max_steps=6, max_completion_length=4, guard_steps=0, health_report_steps=0,
                     health_flat_reward_steps=len(generating), health_rule_actions={"flat_rewards": "stop"}, **schedule)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=zero_reward, args=args,
                                  train_dataset=arithmetic_prompts())
    with caplog.at_level(logging.INFO, logger=HEALTH_LOG), pytest.raises(grpotrl.HealthStop) as err:
        trainer.train()
    assert err.value.rules == ("flat_rewards",) and err.value.step == generating[-1] == 5
    assert f"for {len(generating)} consecutive generation batches (values" in str(err.value), str(err.value)
    assert [h["step"] for h in trainer.state.log_history if "frac_reward_zero_std" in h] == generating
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == HEALTH_LOG]
    assert lines == [(logging.INFO, f"grpotrl health: one_token cannot fire in this run of 6 optimizer steps, "
                                    f"{len(generating)} of which generate (health_patience=5 consecutive steps "
                                    "needed; one_token counts only the steps that generate: TRL generates once "
                                    f"every steps_per_generation x num_iterations = {every}), so it is off for it.")]
    from grpotrl.configs.checks import generating_steps

    assert generating_steps(args, 6) == len(generating)  # the count the config and RunLength judge by


def test_an_epoch_run_with_fewer_generation_batches_than_an_asked_rules_patience_is_refused_at_train_start(
        tiny_llama, grpo_args):
    """max_steps -1, num_iterations 2: 8 prompts x 4 generations, 8 rows a generation batch, each trained on twice:
    4 batches, 8 optimizer steps. flat_rewards set to stop after 5 flat batches fits the 8 steps but not the 4
    batches: refused before the first step."""
    trainer = _trainer(tiny_llama, grpo_args(max_steps=-1, num_train_epochs=1, guard_steps=0, num_iterations=2,
                                             health_flat_reward_steps=5,
                                             health_rule_actions={"flat_rewards": "stop"}), n_prompts=8)
    with pytest.raises(InputError) as err:
        trainer.train()
    assert str(err.value).startswith("health_rule_actions={'flat_rewards': 'stop'} with health_flat_reward_steps=5 "
                                     "and num_train_epochs=1 (8 optimizer steps): the rule fires once its condition "
                                     "held on 5 consecutive generation batches"), str(err.value)
    assert "a run of 8 optimizer steps has 4 (" in str(err.value), str(err.value)
    assert trainer.state.global_step == 0
