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
