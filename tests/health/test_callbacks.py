"""Health rules (grpotrl.callbacks) on crafted tiny-model runs: each rule fires on the run it is
built for; set to stop, it stops after saving a resumable checkpoint. By default only the rules
that fire on a certainly broken run stop it (NaN/inf, a completion that starts with the chat
header); the ones that may be the task itself (entropy collapse, 1-token answers, flat rewards)
warn and train on, as TRL would. A healthy run passes every rule at its most sensitive setting.
Also: the signals reach the logs, per task when rows have a task."""

import logging
import os

import pytest
import torch
from conftest import arithmetic_prompts, length_reward
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpotrl
from grpotrl import HealthStop

SENSITIVE = dict(health_patience=1, health_flat_reward_steps=1, health_max_one_token_share=0.5,
                 health_min_entropy=0.02)


def zero_reward(completions, **kwargs):
    """A judge that always failed to 0."""
    return [0.0] * len(completions)


def _train(model, args, reward=length_reward, dataset=None, **kwargs):
    trainer = grpotrl.GRPOTrainer(model=model, reward_funcs=reward, args=args,
                                  train_dataset=dataset or arithmetic_prompts(), **kwargs)
    trainer.train()
    return trainer


def _stop(model, args, **kwargs) -> HealthStop:
    with pytest.raises(HealthStop) as err:
        _train(model, args, **kwargs)
    return err.value


def _logged(trainer, key):
    return [h["step"] for h in trainer.state.log_history if key in h]


def test_healthy_run_passes_every_rule_and_logs_the_signals(tiny_llama, grpo_args, capsys):
    rows = [{**r, "task": "sum" if i % 2 else "echo"} for i, r in enumerate(arithmetic_prompts())]
    from datasets import Dataset

    trainer = _train(tiny_llama, grpo_args(max_steps=2, guard_steps=0, health_logit_steps=2, **SENSITIVE),
                     dataset=Dataset.from_list(rows))
    assert trainer.state.global_step == 2
    last = trainer.state.log_history[-2]
    for key in ("entropy/sample_min", "entropy/sample_p10", "completions/one_token_share",
                "completions/max_length_share", "stops/prompt_mean", "stops/completion_max",
                "completions/header_share", "rewards/zero_share", "tasks/sum/completions/mean_length",
                "tasks/echo/reward"):
        assert key in last, key
    assert last["stops/prompt_mean"] == 2.0  # SmolLM2's default system turn + the user turn
    assert last["stops/completion_max"] <= 1  # generation stops on every stop id
    # no guard forward (guard_steps=0): logit signals only on the opt-in steps (global_step 0, 2, ...)
    assert _logged(trainer, "logits/top5_mass") == [1]
    out = capsys.readouterr().out
    assert out.count("grpotrl boundary report") == 1 and "stop tokens: 2 in the prompt" in out
    assert "prompt tail:" in trainer.boundary_report(n=1)


def test_default_actions_stop_only_certainly_broken_runs(tmp_path):
    from grpotrl.health.callbacks import EntropyRule, FlatRewardRule, HeaderRule, NonFiniteRule, OneTokenRule, rule_action

    rules = [NonFiniteRule, HeaderRule, EntropyRule, OneTokenRule, FlatRewardRule]
    default = grpotrl.GRPOConfig(output_dir=str(tmp_path))
    assert default.health_action == "auto"
    assert [rule_action(default, r) for r in rules] == ["stop", "stop", "warn", "warn", "warn"]
    every = grpotrl.GRPOConfig(output_dir=str(tmp_path), health_action="stop",
                               health_rule_actions={"non_finite": "warn", "one_token": "off"})
    assert [rule_action(every, r) for r in rules] == ["warn", "stop", "stop", "off", "stop"]
    with pytest.raises(grpotrl.InputError, match="health_rule_actions"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), health_rule_actions={"entropy": "stop"})


def test_flat_rewards_stop_with_a_resumable_checkpoint(tiny_llama, grpo_args, tmp_path):
    args = grpo_args(max_steps=3, health_flat_reward_steps=2, max_completion_length=4,
                     health_rule_actions={"flat_rewards": "stop"})
    err = _stop(tiny_llama, args, reward=zero_reward)
    assert err.rule == "flat_rewards" and err.step == 2
    assert "every group's rewards are all equal (100% of rewards exactly 0) for 2 consecutive steps" in str(err)
    assert err.checkpoint == os.path.join(args.output_dir, "checkpoint-2")
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        assert os.path.isfile(os.path.join(err.checkpoint, name)), name
    resumed = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=zero_reward, train_dataset=arithmetic_prompts(),
                                  args=grpo_args(max_steps=3, health_action="off", max_completion_length=4))
    resumed.train(resume_from_checkpoint=err.checkpoint)
    assert resumed.state.global_step == 3


def test_one_token_policy_stops(tiny_llama, grpo_args):
    """A one-token policy: EOS made certain at every position."""
    err = _stop(tiny_llama, grpo_args(max_steps=2, health_patience=1, health_action="stop",
                                      generation_kwargs={"sequence_bias": [[[2], 50.0]]}))
    assert err.rule == "one_token" and err.step == 1
    assert "1-token completions 100% > health_max_one_token_share=0.5" in str(err)
    assert os.path.isdir(err.checkpoint)


def test_rules_that_may_be_the_task_warn_and_train_on_by_default(tiny_llama, grpo_args, caplog):
    """1-token answers every step (a yes/no task looks the same): logged, and the run completes."""
    with caplog.at_level(logging.WARNING, logger="grpotrl"):
        trainer = _train(tiny_llama, grpo_args(max_steps=2, health_patience=1,
                                               generation_kwargs={"sequence_bias": [[[2], 50.0]]}))
    assert trainer.state.global_step == 2
    assert sum("grpotrl health [one_token] step" in r.getMessage() for r in caplog.records) == 2


def test_response_that_starts_with_the_chat_header_stops(tiny_llama, grpo_args):
    """A template without a generation prompt: the prompt ends with "<|im_end|>\\n" and a model
    SFT-trained on whole conversations writes "<|im_start|>assistant\\n" itself. The tiny random
    model is made to, with sequence biases on exactly that continuation. The I1/I3 guards (on)
    cannot see it: the prompt is the template's, and the template has no header to compare."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = tok.chat_template.replace("{% if add_generation_prompt %}", "{% if false %}")
    # after "\n": <|im_start|> (1), "ass" (520), "istant" (9531), "\n" (198)
    header = [[[198, 1], 50.0], [[1, 520], 50.0], [[520, 9531], 50.0], [[9531, 198], 50.0]]
    err = _stop(tiny_llama, grpo_args(max_steps=2, generation_kwargs={"sequence_bias": header}),
                processing_class=tok)
    assert err.rule == "chat_header" and err.step == 1
    assert "100% of completions start with the chat header" in str(err)
    assert "completion head: '<|im_start|>assistant\\n" in str(err)  # the boundary report is in the message


def test_entropy_collapse_stops(tiny_llama, grpo_args):
    """A collapsed policy: the final norm scaled 1000x makes every distribution one-hot."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        model.model.norm.weight.mul_(1000.0)
    err = _stop(model, grpo_args(max_steps=3, guard_steps=0, health_patience=2, health_max_one_token_share=1.0,
                                 max_completion_length=4, health_rule_actions={"entropy_collapse": "stop"}))
    assert err.rule == "entropy_collapse" and err.step == 2
    assert "mean token entropy" in str(err) and "< health_min_entropy=0.02 for 2 consecutive steps" in str(err)


@pytest.mark.parametrize("where", ["grad", "loss"])
def test_nan_stops_before_the_update_is_applied(tiny_llama, grpo_args, where):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if where == "grad":  # an overflow in backward only
        model.model.norm.weight.register_hook(lambda g: g * float("nan"))
    else:  # an overflow in the training forward only (generation runs without grad)
        model.model.layers[0].register_forward_hook(
            lambda m, i, out: (out[0] * float("nan"), *out[1:]) if torch.is_grad_enabled() and isinstance(
                out, tuple) else (out * float("nan") if torch.is_grad_enabled() else out))
    err = _stop(model, grpo_args(max_steps=2, guard_steps=0, max_completion_length=4))
    assert err.rule == "non_finite" and err.step == 1
    assert ("loss nan" in str(err)) == (where == "loss") and "gradient norm nan" in str(err)
    saved = load_file(os.path.join(err.checkpoint, "model.safetensors"))
    assert all(torch.equal(saved[k], before[k]) for k in saved), "the NaN update must not reach the weights"


class SamplerIgnoresEndOfTurn(grpotrl.GRPOTrainer):
    """A sampler that stops on <|endoftext|> (0) only, so it writes on past <|im_end|> (2), the
    end of turn the loss cuts the completion at."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generation_config.eos_token_id = [0]
        self.generation_kwargs["eos_token_id"] = [0]


def test_stop_tokens_generated_past_the_first_are_counted(tiny_llama, grpo_args, capsys):
    """stops/completion_max and the boundary report count what the model generated, not the loss's
    completion (cut after its first stop, so it always held at most 1): a response with 10+ end
    tokens shows. The guards pass: the loss's completion ends at its first stop token, as I4 wants."""
    args = grpo_args(max_steps=1, max_completion_length=16, generation_kwargs={"sequence_bias": [[[2], 4.0]]})
    trainer = SamplerIgnoresEndOfTurn(model=tiny_llama, reward_funcs=length_reward, args=args,
                                      train_dataset=arithmetic_prompts())
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["stops/completion_max"] > 1, logged["stops/completion_max"]  # was <= 1 by construction
    assert "stop tokens generated in one completion" in capsys.readouterr().out


def test_healthy_sampler_generates_one_stop_per_completion(tiny_llama, grpo_args):
    """The control: a sampler that stops on every stop id generates at most one per completion."""
    trainer = _train(tiny_llama, grpo_args(max_steps=1, generation_kwargs={"sequence_bias": [[[2], 4.0]]}))
    assert trainer.state.log_history[0]["stops/completion_max"] == 1
