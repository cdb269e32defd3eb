"""I10 (step-0 identity of reference and old policy) and the sampler/trainer mismatch gate,
on tiny models over the real SmolLM2 tokenizer. Each failure is reproduced the way it happens in a
user's run (a reference in another dtype, a PEFT ``ref`` adapter that is not the policy's start,
dropout on in the reference, a sampler at another temperature or top-k than the trainer) and must be
caught at step 1; the healthy runs log KL 0 / ratio 1 at step 0."""

import logging
import math

import pytest
import torch
from conftest import arithmetic_prompts, length_reward

import grpotrl
from grpotrl import InputError, InvariantError
from grpotrl.guards import identity
from grpotrl.guards.precision import tolerances

FP32, BF16 = tolerances(torch.float32), tolerances(torch.bfloat16)


def _trainer(model, args, **kwargs):
    return grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, args=args,
                               train_dataset=arithmetic_prompts(8), **kwargs)


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


# ------------------------------------------------------------------ pure functions, by hand

def test_I10_gap_stats_ignore_masked_positions_and_find_the_worst_token():
    a = torch.tensor([[-1.0, -2.0, float("-inf")], [-0.5, -0.25, 0.0]])
    b = torch.tensor([[-1.0, -2.5, 0.0], [-0.5, -0.25, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert identity.masked_gap_stats(a, b, mask) == (0.125, 0.5, (0, 1))


def test_I10_check_fails_on_a_gap_and_on_nan_names_the_token(smollm2_tokenizer):
    ids = torch.tensor([[28, 29], [30, 31]])  # [B, C]
    policy = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    mask = torch.ones(2, 2)
    assert identity.check_step0_identity(smollm2_tokenizer, policy, policy + 5e-5, mask, ids, "reference",
                                         FP32, [7, 8]) == pytest.approx((5e-5, 5e-5), rel=1e-2)
    with pytest.raises(InvariantError, match=r"\[I10\].*row 8, completion token 1 .*gap 2\.00e-03"):
        identity.check_step0_identity(smollm2_tokenizer, policy, policy + torch.tensor([[0, 0], [0, 2e-3]]),
                                      mask, ids, "reference", FP32, [7, 8])
    # bf16: a single rounding step on one token passes, a reference off by 0.2 nats on average does not
    assert identity.check_step0_identity(smollm2_tokenizer, policy, policy + torch.tensor([[0, 0], [0, 0.125]]),
                                         mask, ids, "reference", BF16, [0, 1])[1] == 0.125
    with pytest.raises(InvariantError, match=r"\[I10\]"):
        identity.check_step0_identity(smollm2_tokenizer, policy, policy + 0.2, mask, ids, "reference", BF16, [0, 1])
    with pytest.raises(InvariantError, match=r"\[I10\].*the reference logprob is nan"):
        identity.check_step0_identity(smollm2_tokenizer, policy, torch.tensor([[-1.0, math.nan], [-3.0, -4.0]]),
                                      mask, ids, "reference", BF16, [0, 1])



def test_I10_an_empty_loss_mask_is_not_logged_as_a_gap_of_0(smollm2_tokenizer, caplog):
    """A step-0 microbatch whose every row is masked compares nothing: a reference 7 nats off on every token
    must not come back as ``identity/step0_ref_logp_gap`` 0, which reads as "verified, identical"."""
    used = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])  # [B, C]
    inputs = {"ref_per_token_logps": used + 7.0, "completion_ids": torch.tensor([[28, 29], [30, 31]])}
    empty = torch.zeros(2, 2)
    for tol in (FP32, BF16):
        mean, worst = identity.check_step0_identity(smollm2_tokenizer, used, used + 7.0, empty,
                                                    inputs["completion_ids"], "reference", tol, [0, 1])
        assert math.isnan(mean) and math.isnan(worst)
    with caplog.at_level("WARNING", logger="grpotrl.guards.identity"):
        assert identity.check_step0_logprobs(smollm2_tokenizer, used, inputs, empty, [0, 1], FP32,
                                             torch.nn.Linear(1, 1), None) == {}
    assert "I10 was not checked" in caplog.text and "reference" in caplog.text
    with pytest.raises(InvariantError, match=r"\[I10\]"):  # one loss token is enough to compare
        identity.check_step0_logprobs(smollm2_tokenizer, used, inputs, torch.tensor([[0, 1], [0, 0]]), [0, 1],
                                      FP32, torch.nn.Linear(1, 1), None)


# ------------------------------------------------------------------ I10 in the trainer

def test_I10_healthy_run_logs_kl_0_and_ratio_1_at_step_0(tiny_llama, grpo_args):
    """beta > 0 (a separate reference) and num_iterations 2 (old logprobs computed): both checked."""
    trainer = _trainer(tiny_llama, grpo_args(num_iterations=2, max_steps=2))
    trainer.train()
    for key in ("identity/step0_ref_logp_gap/max", "identity/step0_old_logp_gap/max"):
        (gap,) = _logged(trainer, key)  # step 0 only
        assert gap <= FP32.identity_max


def test_I10_reference_in_bf16_stops_at_step_1(tiny_llama, grpo_args):
    trainer = _trainer(tiny_llama, grpo_args())
    trainer.ref_model.to(torch.bfloat16)  # e.g. a subclass that loads the reference in half precision
    with pytest.raises(InvariantError, match=r"(?s)\[I10\].*reference.*in torch\.bfloat16 and the policy in "
                                             r"torch\.float32"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_I10_model_object_changed_after_loading_is_not_its_reference(tiny_llama, grpo_args):
    """TRL loads the reference from the policy's config path: a model object edited in memory (here its
    final norm) trains against the checkpoint on disk. I10 names the weight that differs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
    with pytest.raises(InvariantError, match=r"(?s)\[I10\].*the weight 'model\.norm\.weight' differs"):
        _trainer(model, grpo_args(max_steps=1)).train()
    trainer = _trainer(model, grpo_args(max_steps=1, guard_steps=0))  # guards off: I10 too
    trainer.train()
    assert not _logged(trainer, "identity/step0_ref_logp_gap/max")


@pytest.mark.parametrize("attention", ["mask", "varlen"])
def test_I10_reference_with_dropout_on_stops(attention, tiny_gpt2, grpo_args):
    """A reference switched to training mode with dropout after init: I10 stops at step 0; under varlen (the CPU
    default in fp32) the reference's attention refuses the dropout first, naming it."""
    trainer = _trainer(tiny_gpt2, grpo_args(packed_attention=attention))
    assert trainer.packed_attention == attention
    for m in trainer.ref_model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.3
    trainer.ref_model.train()
    error, match = ((InvariantError, r"(?s)\[I10\].*training mode with dropout on") if attention == "mask" else
                    (InputError, r"GPT2Attention was called with attention dropout.*packed_attention='mask'"))
    with pytest.raises(error, match=match):
        trainer.train()


def test_I10_peft_ref_adapter_that_is_not_the_policy_start_stops(tiny_llama, grpo_args):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    healthy = _trainer(model, grpo_args(max_steps=1))
    assert "ref" in healthy.model.peft_config  # TRL copied the adapter as the reference: identical so far
    healthy.train()
    assert _logged(healthy, "identity/step0_ref_logp_gap/max")[0] <= FP32.identity_max

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    trainer = _trainer(model, grpo_args(max_steps=1))
    with torch.no_grad():  # a "ref" adapter loaded from another checkpoint
        for name, p in trainer.model.named_parameters():
            if ".ref." in name and "lora_B" in name:
                p.add_(0.5)
    with pytest.raises(InvariantError, match=r"(?s)\[I10\].*PEFT adapter 'ref'"):
        trainer.train()


def test_I10_off_and_not_checked_under_active_dropout(tiny_gpt2, grpo_args, caplog):
    trainer = _trainer(tiny_gpt2, grpo_args(check_step0_identity=False, max_steps=1))
    trainer.ref_model.to(torch.bfloat16)
    trainer.train()  # the user turned it off: no error, nothing logged
    assert not _logged(trainer, "identity/step0_ref_logp_gap/max")
    trainer = _trainer(tiny_gpt2, grpo_args(disable_dropout=False, max_steps=1))
    with caplog.at_level(logging.WARNING, logger="grpotrl"):
        trainer.train()
    assert "I10 (step-0 identity of reference and old policy) is not checked while dropout is active" in caplog.text


# ------------------------------------------------------------------ sampler/trainer mismatch

def _sampled(tiny_llama, grpo_args, **kw):
    """The transformers path with IS correction: the sampler's own logprobs are recorded."""
    return _trainer(tiny_llama, grpo_args(hf_importance_sampling_correction=True, max_steps=1, **kw))


def test_sampler_matching_the_trainer_logs_raw_ratios_of_1_and_no_warning(tiny_llama, grpo_args, caplog):
    trainer = _sampled(tiny_llama, grpo_args, generation_kwargs={})
    with caplog.at_level(logging.WARNING, logger="grpotrl"):
        trainer.train()
    assert "sampler/trainer mismatch" not in caplog.text
    assert _logged(trainer, "sampling/sampler_trainer_logp_gap/mean")[0] < 1e-4
    assert _logged(trainer, "sampling/raw_ratio/token/mean")[0] == pytest.approx(1.0, abs=1e-4)
    assert _logged(trainer, "sampling/raw_ratio/seq/outside_share")[0] == 0.0


@pytest.mark.parametrize("behind_the_trainer", [{"temperature": 2.0}, {"top_k": 3}])
def test_sampler_at_another_temperature_or_top_k_trips_the_gate(tiny_llama, grpo_args, caplog, behind_the_trainer):
    """A sampler the config no longer describes: generate's config changed after the trainer was built
    (``generation_kwargs={"temperature": ...}`` itself becomes the config's temperature, or is refused
    when it disagrees: tests/configs/test_configs.py). A truncation (top_k) trips it with the truncated-sampling
    correction off; with it on, the ratio compares like with like (the next test)."""
    correction = "top_k" not in behind_the_trainer

    def sampled(**kw):
        trainer = _sampled(tiny_llama, grpo_args, generation_kwargs={}, truncated_sampling_correction=correction,
                           **kw)
        for name, value in behind_the_trainer.items():
            setattr(trainer.generation_config, name, value)
        return trainer

    trainer = sampled()
    with caplog.at_level(logging.WARNING, logger="grpotrl"):
        trainer.train()  # default: warn once, train on
    assert caplog.text.count("sampler/trainer mismatch") == 1
    assert _logged(trainer, "sampling/sampler_trainer_logp_gap/mean")[0] > 0.1
    assert abs(_logged(trainer, "sampling/raw_ratio/token/mean")[0] - 1.0) > 0.01
    assert _logged(trainer, "sampling/raw_ratio/token/max")[0] > 1.1 or _logged(
        trainer, "sampling/raw_ratio/token/min")[0] < 0.9
    stop = sampled(sampler_gap_action="stop")
    cause = "temperature: the sampler ran at T=2" if correction else "truncation: TopKLogitsWarper"
    with pytest.raises(InvariantError, match=rf"\[I5\].*sampler/trainer mismatch.*Measured causes: {cause}"):
        stop.train()


def test_I5_top_k_behind_the_trainer_is_corrected_to_the_full_softmax(tiny_llama, grpo_args, caplog):
    """The same top_k=3 behind the trainer with ``truncated_sampling_correction`` on (the default): the
    sampler logprob is that of the full softmax, so the raw ratio is 1 and the gate stays quiet; the
    kept mass (< 1) is logged."""
    trainer = _sampled(tiny_llama, grpo_args, generation_kwargs={})
    trainer.generation_config.top_k = 3
    with caplog.at_level(logging.WARNING, logger="grpotrl"):
        trainer.train()
    assert "sampler/trainer mismatch" not in caplog.text
    assert _logged(trainer, "sampling/raw_ratio/token/mean")[0] == pytest.approx(1.0, abs=1e-4)
    assert _logged(trainer, "sampling/causes/kept_mass")[0] < 0.5  # a tiny random model: 3 of 50k tokens


def test_sampler_gap_settings_are_checked():
    with pytest.raises(grpotrl.InputError, match="sampler_gap_action='loud'"):
        grpotrl.GRPOConfig(output_dir="x", sampler_gap_action="loud")
    with pytest.raises(grpotrl.InputError, match=r"sampler_gap_threshold\W+nan"):
        grpotrl.GRPOConfig(output_dir="x", sampler_gap_threshold=float("nan"))
    with pytest.raises(grpotrl.InputError, match=r"sampler_gap_threshold=0\b.*> 0"):
        grpotrl.GRPOConfig(output_dir="x", sampler_gap_threshold=0)
