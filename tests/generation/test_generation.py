"""The generation side of grpotrl.GRPOTrainer: response-only penalties and
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


def test_I6_min_new_tokens_written_in_generation_kwargs_blocks_every_stop_id_and_logs(tiny_llama, grpo_args):
    """Where a TRL user writes it (TRL's config has no field for it): grpotrl's processor runs and is logged."""
    trainer = _train(tiny_llama, grpo_args(generation_kwargs={"sequence_bias": [[[0], 5.0], [[2], 5.0]],
                                                              "min_new_tokens": 3}))
    assert trainer.args.min_new_tokens == 3
    rates = _logged(trainer, "generation/min_new_tokens_trigger_rate")
    assert len(rates) == 2 and max(rates) > 0, rates
    assert min(int(m.sum()) for b in trainer.seen for m in b["completion_mask"]) >= 3


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
    the field's (1.0 here): completions drawn at 0.7 were trained on logprobs at 1.0 (logprobs without
    the sampling temperature). It becomes the field: the sampler's logprobs, recorded as generate
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
    """generate keeps one logprob per sampled token, never output_scores' [B, V] per step."""
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

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", no_load)  # TRL loads via the architecture class
    with pytest.raises(InputError, match=match):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(**bad),
                            train_dataset=arithmetic_prompts())


@pytest.mark.parametrize("extra, plain", [(dict(top_k=0), True), (dict(top_k=0, repetition_penalty=1.3), False),
                                          (dict(top_k=5), False)])
def test_I5_recorder_raw_logprob_is_the_logits_over_t(tiny_llama, extra, plain):
    """The recorder's ``raw`` measure is log_softmax(R / T)[token] from generate's own raw logits; with
    nothing but one temperature warper it reuses the sampled scores' normaliser (they are R / T)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpotrl.generation.sampled_logprobs import SampledLogprobRecorder
    from grpotrl.trainers import _intercept

    tok = AutoTokenizer.from_pretrained(tiny_llama, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    batch = tok(["1 + 1 =", "Hi there"], return_tensors="pt", padding=True)
    recorder = SampledLogprobRecorder()
    torch.manual_seed(0)
    with torch.no_grad(), _intercept.inject_recorders_after_warpers(model):
        out = model.generate(**batch, max_new_tokens=5, do_sample=True, temperature=0.7,
                             logits_processor=[recorder], return_dict_in_generate=True, output_logits=True,
                             pad_token_id=tok.pad_token_id, **extra)
    assert recorder.scores_are_raw_over_t is plain
    P = batch["input_ids"].size(1)
    want = torch.stack([torch.log_softmax(r / 0.7, -1).gather(1, out.sequences[:, P + t, None]).squeeze(1)
                        for t, r in enumerate(out.logits)], dim=1)  # [B, C] by hand
    torch.testing.assert_close(recorder.measures(out.sequences)["raw"], want, rtol=0, atol=1e-5)


def test_the_cpu_rollout_draws_torchs_tokens_in_grpotrls_faster_draw(tiny_llama, grpo_args, monkeypatch):
    """On CPU the transformers rollout samples through ``_intercept.inject_draw_one`` (torch's exponential draws
    computed vectorised, ``ops.sampling.exponential_draws``), once per generate call, and samples the very
    completions it samples with torch's own ``torch.multinomial`` (the device taken off ``FAST_DRAW_ON``)."""
    from grpotrl.ops import sampling
    from grpotrl.trainers import _intercept

    entered = []
    inject = _intercept.inject_draw_one
    monkeypatch.setattr(_intercept, "inject_draw_one", lambda defer_check: entered.append(defer_check) or
                        inject(defer_check))
    fast = _train(tiny_llama, grpo_args(max_steps=2))
    assert entered == [False, False]
    monkeypatch.setattr(sampling, "FAST_DRAW_ON", ())
    plain = _train(tiny_llama, grpo_args(max_steps=2))
    assert entered == [False, False]  # the block is not entered where the device is off the list
    assert all(torch.equal(a["completion_ids"], b["completion_ids"]) for a, b in zip(fast.seen, plain.seen))


@pytest.mark.parametrize("setting", [dict(min_new_tokens=3), dict(presence_penalty=0.5), dict(repetition_penalty=1.2)])
def test_I6_processor_settings_beside_a_rollout_func_are_refused_before_the_model_loads(tiny_llama, grpo_args,
                                                                                       setting):
    """A rollout_func samples its own way, without grpotrl's processors: the setting would be dropped."""
    def rollout(prompts, trainer):
        raise AssertionError("refused before any rollout")

    with pytest.raises(InputError, match=f"{next(iter(setting))}=.* with a rollout_func"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                            args=grpo_args(generation_kwargs=None, **setting), rollout_func=rollout)
