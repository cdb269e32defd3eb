"""The sampler-gap gate (``guards.identity.gate_sampler_gap``, fed by ``GRPOTrainer._log_sampler_gap``) on
what it cannot measure: loss tokens whose gap is not finite on any (a missing value: the gate trips, as on a
gap above the threshold), and a microbatch with no loss token on any process (nothing is updated, so nothing
to gate: it says once that it did not check, and TRL's training goes on, as on its loss of 0)."""

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import arithmetic_prompts, length_reward

import grpotrl
from grpotrl.errors import InvariantError
from grpotrl.guards.identity import gate_sampler_gap
from grpotrl.ops import importance


def _args(action: str) -> SimpleNamespace:
    return SimpleNamespace(sampler_gap_action=action, sampler_gap_threshold=0.1, presence_penalty=0.0,
                           frequency_penalty=0.0, min_new_tokens=0, repetition_penalty=1.0)


def test_I5_a_gap_not_finite_on_any_loss_token_trips_the_gate(caplog):
    """4 loss tokens, none with a finite gap (the sampler gave each -inf): the mean is NaN, which cannot be
    checked against the threshold; 'stop' stops, 'warn' warns once, 'off' stays quiet."""
    with pytest.raises(InvariantError, match=r"\[I5\] sampler/trainer mismatch.*not finite on any of the 4 loss "
                                             r"tokens \(step 3\).*sampler_gap_threshold=0\.1"):
        gate_sampler_gap(_args("stop"), math.nan, 4, 3, 1.0, set())
    said = set()
    with caplog.at_level(logging.WARNING, logger="grpotrl"):
        for _ in range(2):
            gate_sampler_gap(_args("warn"), math.nan, 4, 3, 1.0, said)
        gate_sampler_gap(_args("off"), math.nan, 4, 3, 1.0, set())
    assert caplog.text.count("not finite on any of the 4 loss tokens") == 1


def test_I5_no_loss_token_on_any_process_is_said_not_checked_once_per_mode(caplog):
    """No loss token anywhere: even under 'stop' the gate passes (the microbatch updates nothing; TRL trains on
    it with loss 0), and says once per mode that it was not checked; a gap within the threshold says nothing."""
    said = set()
    with caplog.at_level(logging.WARNING, logger="grpotrl"):
        for mode in ("train", "train", "eval", "eval"):
            gate_sampler_gap(_args("stop"), math.nan, 0, 5, 1.0, said, mode=mode)
        gate_sampler_gap(_args("stop"), 0.05, 7, 5, 1.0, said)
    assert caplog.text.count("sampler-gap gate (sampler_gap_threshold=0.1) was not checked on a microbatch "
                             "(step 5): no process had a loss token") == 1
    assert caplog.text.count("was not checked on a microbatch (evaluation after step 5)") == 1
    assert "mismatch" not in caplog.text


@pytest.fixture
def trainer(tiny_llama, grpo_args):
    """A trainer in train mode before any generation (nothing measured by the recorder), gate 'stop'."""
    args = grpo_args(hf_importance_sampling_correction=True, sampler_gap_action="stop", beta=0.0)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts())
    trainer.model.train()
    return trainer


def test_I5_the_trainer_logs_no_gap_for_a_microbatch_without_loss_tokens(trainer, caplog):
    """Every completion masked (all truncated under mask_truncated_completions): no gap is logged (a 0.0
    would pull the step's mean down as if sampler and trainer agreed) and the gate says it did not check."""
    used = torch.zeros(2, 4)
    inputs = {"completion_mask": torch.zeros(2, 4, dtype=torch.long), "sampling_per_token_logps": used - 1.0}
    with caplog.at_level(logging.WARNING, logger="grpotrl"):
        trainer._log_sampler_gap(used, inputs)
    logged = {k: v for k, v in trainer.metric_values("train").items() if k.startswith("sampling/") and v}
    assert logged == {}
    assert "was not checked on a microbatch (step 0)" in caplog.text


def test_I5_the_trainer_stops_on_loss_tokens_the_sampler_gave_minus_inf(trainer):
    """Loss tokens whose sampler logprob is -inf on every one: the gap cannot be measured, so the gate trips
    (it passed on a gap of 0 before)."""
    used = torch.zeros(2, 4)
    inputs = {"completion_mask": torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]]),
              "sampling_per_token_logps": torch.full((2, 4), -math.inf)}
    with pytest.raises(InvariantError, match="not finite on any of the 3 loss tokens"):
        trainer._log_sampler_gap(used, inputs)


@pytest.mark.parametrize("action", ["stop", "warn"])
def test_I5_a_gap_that_is_not_finite_on_some_loss_tokens_trips_the_gate(action, caplog):
    """One loss token of 12 with a -inf logprob on one side: the finite tokens' mean (0.01) is under the threshold,
    but the gap on that token is not measured, so the gate cannot pass it (before, it was left out of the mean and
    the gate passed); the count is logged by ``importance.sampler_gap_metrics``."""
    z, sampler, mask = torch.zeros(1, 12), torch.full((1, 12), -0.01), torch.ones(1, 12)
    sampler[0, 5] = -math.inf
    m, tokens = importance.sampler_gap_metrics(importance.sampler_gap_local(z, z, sampler, mask)[None])
    assert tokens == 12 and m["sampling/sampler_trainer_logp_gap/unmeasured_tokens"] == 1.0
    assert abs(m["sampling/sampler_trainer_logp_gap/mean"] - 0.01) < 1e-6
    args = SimpleNamespace(sampler_gap_action=action, sampler_gap_threshold=0.1, presence_penalty=0.0, frequency_penalty=0.0,
              min_new_tokens=0, repetition_penalty=1.0)
    call = lambda: gate_sampler_gap(args, m["sampling/sampler_trainer_logp_gap/mean"], tokens, 3, 1.0, set(),
                                    unmeasured=1)  # noqa: E731
    if action == "stop":
        with pytest.raises(InvariantError, match=r"not finite on 1 of the 12 loss tokens"):
            call()
    else:
        with caplog.at_level(logging.WARNING):
            call()
        assert "not finite on 1 of the 12 loss tokens" in caplog.text
