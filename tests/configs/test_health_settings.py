"""A health rule that ``health_rule_actions`` sets to stop or warn, while its own setting turns it off, is refused
when the config is made, naming both settings and what to set: ``health_min_entropy`` 0 (``entropy_collapse``),
``health_max_one_token_share`` 1 (``one_token``), ``health_flat_reward_steps`` 0 (``flat_rewards``; the rule is
then never added). The defaults, ``health_action`` alone and a rule set to 'off' are taken."""

import pytest
import trl

import grpotrl
from grpotrl.errors import InputError

OFF = [("entropy_collapse", "health_min_entropy", 0.0, "0.02"),
       ("one_token", "health_max_one_token_share", 1.0, "0.5"),
       ("flat_rewards", "health_flat_reward_steps", 0, "20")]


@pytest.mark.parametrize("action", ["stop", "warn"])
@pytest.mark.parametrize("rule, setting, value, default", OFF)
def test_a_rule_asked_to_act_that_its_setting_turns_off_is_refused(rule, setting, value, default, action, tmp_path):
    with pytest.raises(InputError) as err:
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, health_rule_actions={rule: action},
                           **{setting: value})
    text = str(err.value)
    assert text.startswith(f"health_rule_actions={{'{rule}': '{action}'}} with {setting}={value!r}: "), text
    assert f"so it can never {action}" in text and f"Set {setting} to" in text and default in text, text
    assert f"health_rule_actions' {rule} to 'off'" in text, text


def test_the_same_is_refused_on_a_trl_config_and_on_gad(tmp_path):
    """A ``trl.GRPOConfig`` is checked once, by the trainer (``complete_grpo_config``); GADConfig like GRPOConfig."""
    from grpotrl.configs import complete_grpo_config

    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    args.health_rule_actions, args.health_flat_reward_steps = {"flat_rewards": "stop"}, 0
    with pytest.raises(InputError, match="health_flat_reward_steps=0"):
        complete_grpo_config(args)
    with pytest.raises(InputError, match="health_min_entropy=0.0"):
        grpotrl.GADConfig(output_dir=str(tmp_path), use_cpu=True, health_min_entropy=0.0,
                          health_rule_actions={"entropy_collapse": "stop"})


@pytest.mark.parametrize("overrides", [
    {},  # the defaults
    {"health_rule_actions": {"entropy_collapse": "stop", "one_token": "warn", "flat_rewards": "stop"}},
    {"health_action": "stop", "health_min_entropy": 0.0, "health_max_one_token_share": 1.0,
     "health_flat_reward_steps": 0},  # 0 / 1 are each rule's documented 'off' under health_action
    {"health_rule_actions": {"flat_rewards": "off", "entropy_collapse": "off"}, "health_flat_reward_steps": 0,
     "health_min_entropy": 0.0},
    {"health_rule_actions": {"non_finite": "stop", "chat_header": "warn"}, "health_flat_reward_steps": 0},
])
def test_defaults_health_action_and_rules_turned_off_are_taken(overrides, tmp_path):
    grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **overrides)


ASKED_PATIENCE = [("entropy_collapse", "health_patience"), ("one_token", "health_patience"),
                  ("flat_rewards", "health_flat_reward_steps")]


@pytest.mark.parametrize("action", ["stop", "warn"])
@pytest.mark.parametrize("rule, setting", ASKED_PATIENCE)
def test_a_rule_asked_to_act_whose_patience_exceeds_max_steps_is_refused(rule, setting, action, tmp_path):
    """Its condition would have to hold on 4 consecutive steps of a 3-step run: it can never fire."""
    with pytest.raises(InputError) as err:
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=3, health_rule_actions={rule: action},
                           **{setting: 4})
    text = str(err.value)
    assert text.startswith(f"health_rule_actions={{'{rule}': '{action}'}} with {setting}=4 and max_steps=3: "), text
    assert f"so in a run of 3 steps it can never {action}" in text and f"Set {setting} to at most 3" in text, text
    assert f"health_rule_actions' {rule} to 'off'" in text, text


def test_a_rule_asked_to_act_at_its_default_patience_in_a_shorter_run_is_refused(tmp_path):
    with pytest.raises(InputError, match=r"with health_patience=5 and max_steps=2: .* it can never stop"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=2,
                           health_rule_actions={"entropy_collapse": "stop"})
    with pytest.raises(InputError, match=r"with health_flat_reward_steps=20 and max_steps=10: .* it can never warn"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=10,
                           health_rule_actions={"flat_rewards": "warn"})


def test_a_patience_set_beyond_max_steps_is_refused_naming_the_rules_it_serves(tmp_path):
    with pytest.raises(InputError) as err:
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=3, health_patience=4)
    assert str(err.value).startswith("health_patience=4 with max_steps=3: entropy_collapse and one_token fire once "
                                     "their condition held on 4 consecutive optimizer steps, so in a run of 3 steps "
                                     "neither can ever fire. Set health_patience to at most 3 (its default is 5)"), \
        str(err.value)
    with pytest.raises(InputError, match=r"^health_patience=4 with max_steps=3: entropy_collapse fires .* it can "
                                         r"never"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=3, health_patience=4,
                           health_rule_actions={"one_token": "off"})
    with pytest.raises(InputError, match=r"^health_flat_reward_steps=30 with max_steps=10: flat_rewards fires "):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=10, health_flat_reward_steps=30)


@pytest.mark.parametrize("action", ["stop", "warn"])
@pytest.mark.parametrize("cap, written", [({"max_completion_length": 1}, "max_completion_length=1"),
                                          ({"max_completion_length": 8, "generation_kwargs": {"max_new_tokens": 1}},
                                           "generation_kwargs['max_new_tokens']=1")])
def test_one_token_asked_to_act_where_every_completion_is_one_token_is_refused(cap, written, action, tmp_path):
    """The share of 1-token completions is 1 on every step, healthy or not: the rule would fire on every step."""
    with pytest.raises(InputError) as err:
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, health_rule_actions={"one_token": action}, **cap)
    text = str(err.value)
    assert text.startswith(f"health_rule_actions={{'one_token': '{action}'}} with {written}: every completion is one "
                           "token long by construction"), text
    assert f"the rule would {action} on a healthy run" in text and "one_token to 'off'" in text, text


def test_the_completion_cap_is_the_one_generation_uses():
    """generation_kwargs' max_new_tokens (transformers) or max_tokens (vLLM) override max_completion_length."""
    from types import SimpleNamespace

    from grpotrl.configs.checks import completion_cap, one_token_by_construction

    def args(use_vllm=False, **kwargs):
        return SimpleNamespace(max_completion_length=1, use_vllm=use_vllm, generation_kwargs=kwargs)

    assert completion_cap(args()) == 1 and one_token_by_construction(args())
    assert completion_cap(args(max_new_tokens=16)) == 16 and not one_token_by_construction(args(max_new_tokens=16))
    assert completion_cap(args(use_vllm=True, max_tokens=16)) == 16
    assert completion_cap(args(use_vllm=True, max_new_tokens=16)) == 1  # vLLM reads max_tokens


@pytest.mark.parametrize("overrides", [
    {"max_steps": 2},  # a short run at the defaults: the patient rules are off for it (said at train start)
    {"max_steps": 2, "health_action": "stop"},
    {"max_steps": 3, "health_patience": 3, "health_flat_reward_steps": 3,
     "health_rule_actions": {"entropy_collapse": "stop", "flat_rewards": "stop"}},  # fits exactly
    {"max_steps": 2, "health_patience": 3, "health_rule_actions": {"entropy_collapse": "off", "one_token": "off"}},
    {"max_steps": 2, "health_min_entropy": 0.0, "health_max_one_token_share": 1.0, "health_patience": 3},
    {"max_steps": -1, "health_patience": 100, "health_rule_actions": {"entropy_collapse": "stop"}},  # at train start
    {"max_completion_length": 1},  # one_token on by default: off for the run (said at trainer init)
    {"max_completion_length": 1, "health_action": "stop"},
    {"max_completion_length": 1, "health_rule_actions": {"one_token": "off"}},
    {"max_completion_length": 2, "health_rule_actions": {"one_token": "stop"}},  # 1 token: an empty answer
])
def test_short_runs_and_one_token_completions_at_the_defaults_are_taken(overrides, tmp_path):
    grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **overrides)


# one generation batch of 8 rows every 2 optimizer steps (num_iterations 2, steps_per_generation =
# gradient_accumulation_steps = 1): 6 steps generate on steps 1, 3, 5, 3 batches; and one every 3 microbatches, 2 a
# step (steps_per_generation 3 of 4 rows, gradient_accumulation_steps 2): 12 microbatches generate at microbatches
# 0, 3, 6, 9, in steps 1, 2, 4, 5: 4 batches
SPARSE = [({"num_iterations": 2}, 3),
          ({"per_device_train_batch_size": 4, "num_generations": 4, "gradient_accumulation_steps": 2,
            "steps_per_generation": 3}, 4)]


@pytest.mark.parametrize("schedule, batches", SPARSE, ids=["iterations2", "spg3_gas2"])
def test_the_steps_that_generate_are_counted_as_trl_schedules_them(schedule, batches, tmp_path):
    from grpotrl.configs.checks import generating_steps

    args = grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=6, **schedule)
    assert generating_steps(args, 6) == batches
    assert generating_steps(args, 1) == 1  # the first microbatch always generates


@pytest.mark.parametrize("action", ["stop", "warn"])
@pytest.mark.parametrize("rule, setting", ASKED_PATIENCE[1:])
@pytest.mark.parametrize("schedule, batches", SPARSE, ids=["iterations2", "spg3_gas2"])
def test_a_generation_batch_rule_asked_for_with_more_patience_than_the_run_has_batches_is_refused(
        rule, setting, action, schedule, batches, tmp_path):
    """one_token and flat_rewards read a signal logged once per generation batch: the 6-step run observes it on
    ``batches`` steps only, so a patience of batches + 1 can never fire; batches is taken."""
    def make(patience):
        return grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=6,
                                  health_rule_actions={rule: action}, **{setting: patience}, **schedule)

    with pytest.raises(InputError) as err:
        make(batches + 1)
    text = str(err.value)
    assert text.startswith(f"health_rule_actions={{'{rule}': '{action}'}} with {setting}={batches + 1} and "
                           f"max_steps=6: the rule fires once its condition held on {batches + 1} consecutive "
                           f"generation batches (its signal is logged once per generation batch), and a run of 6 "
                           f"optimizer steps has {batches} (TRL generates once every"), text
    assert f"it can never {action}. Set {setting} to at most {batches}, train for more steps" in text, text
    make(batches)


def test_a_patience_set_beyond_the_runs_generation_batches_is_refused_naming_what_each_rule_counts(tmp_path):
    """max_steps 6, num_iterations 2: 3 generation batches. health_patience 4 fits entropy_collapse (read on every
    step) but not one_token (read once per generation batch); 8 fits neither. 3 is taken."""
    def make(**kw):
        return grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=6, num_iterations=2, **kw)

    with pytest.raises(InputError) as err:
        make(health_patience=4)
    assert str(err.value) == (
        "health_patience=4 with max_steps=6: one_token fires once its condition held on 4 consecutive generation "
        "batches (its signal is logged once per generation batch), and a run of 6 optimizer steps has 3 (TRL "
        "generates once every steps_per_generation x num_iterations = 1 x 2 = 2 microbatches, and an optimizer step "
        "is gradient_accumulation_steps=1 of them), so it can never fire. Set health_patience to at most 3 (its "
        "default is 5), or train for more steps."), str(err.value)
    with pytest.raises(InputError) as err:
        make(health_patience=8)
    assert str(err.value).startswith("health_patience=8 with max_steps=6: entropy_collapse fires once its condition "
                                     "held on 8 consecutive optimizer steps, so in a run of 6 steps it can never "
                                     "fire; one_token fires once its condition held on 8 consecutive generation "
                                     "batches"), str(err.value)
    assert str(err.value).endswith("Set health_patience to at most 3 (its default is 5), or train for more steps.")
    make(health_patience=3)
    make(health_patience=4, health_rule_actions={"one_token": "off"})
    make()  # the defaults: one_token and flat_rewards are off for this run, said at train start
