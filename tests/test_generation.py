"""The generation side of grpotrl.GRPOTrainer (issue 3): response-only penalties and
min-new-tokens on the transformers generate path (I6), the sampler's own logprobs and the
optional importance-sampling correction (I5)."""

import pytest
import torch
from conftest import arithmetic_prompts, length_reward

import grpotrl
from grpotrl import InputError


class Observed(grpotrl.GRPOTrainer):
    def _compute_loss(self, model, inputs):
        self.seen = getattr(self, "seen", []) + [{k: v.detach().clone() for k, v in inputs.items()
                                                  if isinstance(v, torch.Tensor)}]
        return super()._compute_loss(model, inputs)


def _train(model, args, cls=Observed):
    trainer = cls(model=model, reward_funcs=length_reward, args=args, train_dataset=arithmetic_prompts())
    trainer.train()
    return trainer


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_I6_all_penalties_on_run_completes_and_logs(tiny_llama, grpo_args):
    trainer = _train(tiny_llama, grpo_args(max_steps=3, presence_penalty=0.5, frequency_penalty=0.3,
                                           repetition_penalty=1.2, min_new_tokens=3,
                                           hf_importance_sampling_correction=True,
                                           vllm_importance_sampling_mode="token_truncate"))
    # transformers' own (prompt-counting) repetition penalty is off; ours replaced it
    assert trainer.generation_config.repetition_penalty == 1.0
    for key in ("completions/one_token_share", "generation/min_new_tokens_trigger_rate",
                "sampling/sampler_trainer_logp_gap/mean", "sampling/importance_sampling_ratio/mean"):
        values = _logged(trainer, key)
        assert len(values) == 3 and all(v == v for v in values), key  # logged every step, not NaN
    # the stop tokens are biased up at sampling time (grpo_args), so min-new-tokens really fires
    assert max(_logged(trainer, "generation/min_new_tokens_trigger_rate")) > 0
    lengths = [int(m.sum()) for b in trainer.seen for m in b["completion_mask"]]
    assert min(lengths) >= 3, "min_new_tokens=3: no completion may stop before its 3rd token"
    # the processors changed the sampling distribution, and the gap says so
    assert max(_logged(trainer, "sampling/sampler_trainer_logp_gap/mean")) > 1e-3


def test_I5_sampler_logprobs_equal_trainer_logprobs_without_processors(tiny_llama, grpo_args):
    """No processor, no bias: the sampler drew from softmax(logits / T), exactly what the trainer
    scores, so the captured sampler logprobs must agree with the loss's."""
    trainer = _train(tiny_llama, grpo_args(generation_kwargs=None, hf_importance_sampling_correction=True))
    assert all(b["sampling_per_token_logps"].shape == b["completion_ids"].shape for b in trainer.seen)
    assert max(_logged(trainer, "sampling/sampler_trainer_logp_gap/max")) < 1e-4
    ratios = _logged(trainer, "sampling/importance_sampling_ratio/mean")
    assert ratios and all(abs(r - 1) < 1e-3 for r in ratios)


def test_I5_generation_kwargs_temperature_is_the_logprobs_temperature(tiny_llama, grpo_args):
    """TRL lets generation_kwargs override the sampling temperature and still computes the logprobs at
    the field's (1.0 here): completions drawn at 0.7 were trained on logprobs at 1.0 (the seeds'
    "logprobs without temperature"). It becomes the field: the sampler's logprobs, recorded as generate
    went, agree with the loss's."""
    trainer = _train(tiny_llama, grpo_args(temperature=1.0, generation_kwargs={"temperature": 0.7},
                                           hf_importance_sampling_correction=True))
    assert trainer.args.temperature == trainer.temperature == trainer.generation_config.temperature == 0.7
    assert max(_logged(trainer, "sampling/sampler_trainer_logp_gap/max")) < 1e-4


def test_I6_min_new_tokens_keeps_every_completion_long_enough(tiny_llama, grpo_args):
    trainer = _train(tiny_llama, grpo_args(max_steps=2, min_new_tokens=4))
    lengths = [int(m.sum()) for b in trainer.seen for m in b["completion_mask"]]
    assert min(lengths) >= 4
    assert _logged(trainer, "completions/one_token_share") == [0.0, 0.0]


def test_without_penalties_nothing_is_added_to_generate(tiny_llama, grpo_args):
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(),
                                  train_dataset=arithmetic_prompts())
    assert trainer._generation_extras(torch.zeros(2, 5, dtype=torch.long)) == {}


@pytest.mark.parametrize("settings", [dict(presence_penalty=0.5, min_new_tokens=2),
                                      dict(hf_importance_sampling_correction=True)])
def test_I5_sampler_logprobs_are_recorded_not_output_scores(tiny_llama, grpo_args, settings):
    """Issue 17: generate keeps one logprob per sampled token, never output_scores' [B, V] per step."""
    from grpotrl.generation.sampled_logprobs import SampledLogprobRecorder

    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(**settings),
                                  train_dataset=arithmetic_prompts())
    extra = trainer._generation_extras(torch.zeros(2, 5, dtype=torch.long))
    assert list(extra) == ["logits_processor"]  # no output_scores, no return_dict_in_generate
    assert isinstance(extra["logits_processor"][-1], SampledLogprobRecorder)


@pytest.mark.parametrize("bad, match", [
    ({"presence_penalty": float("nan")}, "presence"),
    ({"repetition_penalty": 0.0}, "repetition"),
    ({"min_new_tokens": 12}, "min_new_tokens=12 must be < max_completion_length"),
    ({"hf_importance_sampling_correction": True, "loss_type": "vespo"}, "vespo"),
])
def test_bad_generation_args_stop_before_the_model_loads(tiny_llama, grpo_args, monkeypatch, bad, match):
    import transformers

    def no_load(*a, **k):
        raise AssertionError("model loaded before the generation arguments were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(InputError, match=match):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(**bad),
                            train_dataset=arithmetic_prompts())
