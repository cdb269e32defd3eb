"""grpotrl's configs as a drop-in for TRL's: ``import grpotrl`` and a default config print nothing;
grpotrl's trainers accept ``trl.GRPOConfig`` and a user's subclass of it (open-r1's, a TrlParser
script's), keeping the user's object and its fields; TRL's values stay as TRL computes them."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import trl
from conftest import arithmetic_prompts, length_reward

import grpotrl
from grpotrl.errors import InputError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(grpotrl.__file__)))


def _python(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_import_and_default_configs_print_nothing(tmp_path):
    """No bitsandbytes kernel message, no gradient_checkpointing FutureWarning."""
    out = _python("import grpotrl; grpotrl.GRPOConfig(output_dir='x'); grpotrl.SFTConfig(output_dir='y')", tmp_path)
    assert out.returncode == 0, out.stderr
    assert (out.stdout, out.stderr) == ("", "")


def test_only_the_known_bitsandbytes_message_is_silenced(tmp_path):
    """On an AVX512-BF16 CPU without the `kernels` package bitsandbytes logs this at import (the machine
    running the tests may not have one, so it is emitted here the way bitsandbytes does)."""
    out = _python("import grpotrl, logging\n"
                  "log = logging.getLogger('bitsandbytes.backends.cpu.ops')\n"
                  "log.warning('Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure "
                  "you already `pip install kernels` and the kernels >= 0.11.1', 'No module named kernels')\n"
                  "log.warning('something else')\n", tmp_path)
    assert out.stderr == "something else\n"


def test_checkpointing_keeps_trls_values_under_the_new_name(tmp_path):
    for config in (grpotrl.GRPOConfig, grpotrl.SFTConfig):
        on = config(output_dir=str(tmp_path))
        assert on.gradient_checkpointing is True and on.activation_checkpointing is True  # TRL's default
        with pytest.warns(FutureWarning, match="gradient_checkpointing"):  # the user's own use of the old name
            off = config(output_dir=str(tmp_path), gradient_checkpointing=False)
        assert off.gradient_checkpointing is False and off.activation_checkpointing is False
        off = config(output_dir=str(tmp_path), activation_checkpointing=False)
        assert off.gradient_checkpointing is False


@dataclasses.dataclass
class ScriptConfig(trl.GRPOConfig):
    """What open-r1 and TrlParser scripts do: TRL's config plus the script's own fields."""

    reward_scale: float = dataclasses.field(default=0.5)


@pytest.mark.parametrize("config", [trl.GRPOConfig, ScriptConfig])
def test_trl_config_and_a_subclass_train_and_keep_their_fields(tiny_llama, tmp_path, config):
    args = config(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=6, max_steps=1, report_to="none", save_strategy="no", logging_steps=1)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts(8))
    assert trainer.args is args and type(args) is config
    assert args.guard_steps == 2 and args.health_action == "auto" and args.presence_penalty == 0.0  # grpotrl's
    assert args.bf16 is True and args.disable_dropout is False  # TRL's defaults, as TRL set them
    assert getattr(args, "reward_scale", 0.5) == 0.5
    trainer.train()
    assert trainer.state.global_step == 1
    assert [h for h in trainer.state.log_history if "guards/logprob_max_gap" in h]  # the guards ran


def test_trl_config_is_checked_like_grpotrls(tmp_path):
    from grpotrl.configs import complete_grpo_config

    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, entropy_coef=-0.1)
    with pytest.raises(grpotrl.InputError, match="entropy_coef=-0.1"):
        complete_grpo_config(args)
    ours = grpotrl.GRPOConfig(output_dir=str(tmp_path), guard_steps=5)
    before = dict(vars(ours))
    assert complete_grpo_config(ours) is ours and vars(ours).keys() == before.keys() and ours.guard_steps == 5


@pytest.mark.parametrize("value, expected", [(True, "group"), (False, "none"), ("batch", "batch")])
def test_type_check_takes_what_trls_config_documents_beyond_its_annotation(tmp_path, value, expected):
    """TRL documents ``scale_rewards`` as ``str`` or ``bool`` and maps the bools in ``__post_init__``
    (TRL's own test_train_scale_rewards passes True/False); grpotrl's type check takes the same, in Python
    and in a recipe, and still refuses what TRL would not take."""
    from grpotrl.configs.recipe_types import check_recipe_types

    for cls in (trl.GRPOConfig, grpotrl.GRPOConfig):
        assert cls(output_dir=str(tmp_path), use_cpu=True, scale_rewards=value).scale_rewards == expected
    check_recipe_types({"scale_rewards": value}, [grpotrl.GRPOConfig], "recipe.yaml")
    with pytest.raises(grpotrl.InputError, match="scale_rewards=2: TRL 1.16 takes 'group', 'batch', 'none', True"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, scale_rewards=2)


def test_multitask_trainer_takes_a_trl_config(tiny_llama, tmp_path):
    from datasets import Dataset

    rows = [{"prompt": [{"role": "user", "content": f"Question {i}?"}], "task": "ab"[i % 2]} for i in range(8)]
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                          report_to="none")
    trainer = grpotrl.MultiTaskGRPOTrainer(model=tiny_llama, reward_funcs={"a": length_reward, "b": length_reward},
                                           args=args, train_dataset=Dataset.from_list(rows))
    assert trainer.args is args and args.cagrad == "off" and trainer.task_names == ["a", "b"]


# ---------------------------------------------------------------- settings honoured or refused, never dropped


@pytest.mark.parametrize("setting", [{"presence_penalty": 0.5}, {"frequency_penalty": 0.5},
                                     {"repetition_penalty": 1.2}, {"min_new_tokens": 2},
                                     {"generation_kwargs": {"repetition_penalty": 1.2}},
                                     {"hf_importance_sampling_correction": True}])
def test_I6_continuous_batching_refuses_the_processors_it_cannot_apply(tmp_path, setting):
    """Continuous batching takes no logits processors: the response-only penalties and min_new_tokens were
    silently dropped there (and repetition_penalty forced to 1.0), and so was hf_importance_sampling_correction,
    whose sampler logprobs a processor records: the run logged no importance-sampling metric."""
    with pytest.raises(grpotrl.InputError, match=r"with use_transformers_continuous_batching"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_transformers_continuous_batching=True, **setting)
    from grpotrl.configs import complete_grpo_config

    if set(setting) <= set(trl.GRPOConfig.__dataclass_fields__):  # TRL's config too (its repetition_penalty)
        with pytest.raises(grpotrl.InputError, match=r"with use_transformers_continuous_batching"):
            complete_grpo_config(trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True,
                                                use_transformers_continuous_batching=True, **setting))
    # TRL's defaults (repetition_penalty=1.0, ...) pass
    complete_grpo_config(trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True,
                                        use_transformers_continuous_batching=True))


def test_hf_importance_sampling_correction_is_refused_under_vllm(tmp_path):
    """Under vLLM TRL multiplies the loss by its own vllm_importance_sampling_correction ratio, and grpotrl's
    correction, which reads the sampler logprobs TRL's output holds on every path, would fold a second one into
    the advantages."""
    from grpotrl.configs import complete_grpo_config

    with pytest.raises(grpotrl.InputError, match=r"^hf_importance_sampling_correction=True with use_vllm: .*a second "
                                                 r"time.*Turn hf_importance_sampling_correction off"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True,
                           hf_importance_sampling_correction=True)
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, use_vllm=True)
    args.hf_importance_sampling_correction = True
    with pytest.raises(grpotrl.InputError, match=r"with use_vllm"):
        complete_grpo_config(args)
    grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True)  # TRL's own correction alone
    grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, hf_importance_sampling_correction=True)


@pytest.mark.parametrize("setting, message", [
    ({"generation_kwargs": {"do_sample": False}}, r"generation_kwargs\['do_sample'\]=False: greedy decoding, like "
                                                  r"temperature 0, would give every completion of a group the same"),
    ({"generation_kwargs": {"top_k": 1}}, r"generation_kwargs\['top_k'\]=1 keeps only the most likely token: greedy"),
    ({"top_k": 1}, r"top_k=1 \(int\): it must be an integer >= 0 other than 1 .*greedy decoding"),
    ({"generation_kwargs": {"num_beams": 4, "do_sample": False}}, r"generation_kwargs\['do_sample'\]=False: greedy"),
])
@pytest.mark.parametrize("config", [grpotrl.GRPOConfig, trl.GRPOConfig])
def test_I5_greedy_decoding_is_refused_like_temperature_zero(tmp_path, config, setting, message):
    """generation_kwargs={'do_sample': False} decoded greedily: one distinct completion per group of 4, zero
    advantages, while temperature 0 was refused for exactly that."""
    from grpotrl.configs import complete_grpo_config

    with pytest.raises(grpotrl.InputError, match=message):
        complete_grpo_config(config(output_dir=str(tmp_path), use_cpu=True, bf16=False, **setting))


def test_sampling_settings_that_sample_pass(tmp_path):
    for setting in ({"generation_kwargs": {"do_sample": True, "top_k": 5, "num_beams": 1}}, {"top_k": 0}, {"top_k": 2},
                    {"generation_kwargs": {"do_sample": True, "num_beams": 2}}):  # beam sampling, as TRL's own test
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **setting)


def test_counts_and_thresholds_take_their_documented_ends(tmp_path):
    """The ends each field's help names (0 turns a rule off, 1 keeps all tokens, ...) pass; the ranges
    refuse only what a field cannot mean."""
    grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, health_min_entropy=0.0, health_max_one_token_share=1.0,
                       health_patience=1, health_flat_reward_steps=0, health_report_steps=0, health_logit_steps=0,
                       dynamic_sampling_max_rounds=0, top_entropy_quantile=0.0, ref_model_mixup_alpha=1.0,
                       delta=1.5, off_policy_mask_threshold=0.5, sapo_temperature_pos=0.1, entropy_coef_delta=0.0,
                       entropy_target=0.0, num_generations_eval=1, vllm_importance_sampling_clip_min=0.0)
    grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, top_entropy_quantile=1)  # an int for a float field
    grpotrl.GADConfig(output_dir=str(tmp_path), use_cpu=True, discriminator_lora_r=0, discriminator_warmup_steps=0)
    with pytest.raises(grpotrl.InputError, match=r"^discriminator_warmup_steps=-1 \(int\): it must be an integer >= 0"):
        grpotrl.GADConfig(output_dir=str(tmp_path), use_cpu=True, discriminator_warmup_steps=-1)


def test_drop_in_fsdp_list_is_taken_and_integral_floats_name_the_integer(tmp_path):
    """transformers takes fsdp as a list of options (and turns it into fsdp=True); grpotrl's type check refused
    it. seed=1.0 and SFT's max_length=512.0 TRL takes at construction and fails with later (numpy's seed, a
    slice): refused with the integer to write (docs/refused.md)."""
    for config in (grpotrl.GRPOConfig, grpotrl.SFTConfig):
        assert config(output_dir=str(tmp_path), use_cpu=True, fsdp=["full_shard", "auto_wrap"]).fsdp is True
        with pytest.raises(grpotrl.InputError, match=r"seed: 1.0 is a float, but seed takes an integer \(write 1\)"):
            config(output_dir=str(tmp_path), use_cpu=True, seed=1.0)
    with pytest.raises(grpotrl.InputError, match=r"^max_length=512.0 \(float\): it must be an integer >= 1 \(write "
                                                 r"512\)"):
        grpotrl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, max_length=512.0)


def test_num_generations_none_is_refused_saying_what_to_pass(tmp_path):
    """TRL annotates num_generations ``int | None`` and then computes ``generation_batch_size % num_generations``:
    None was a TypeError traceback from TRL's __post_init__."""
    for config in (grpotrl.GRPOConfig, grpotrl.GADConfig):
        with pytest.raises(grpotrl.InputError, match=r"num_generations: None is no value for num_generations, which "
                                                     r"takes an integer: pass one \(e\.g\. 8, its default\), or leave "
                                                     r"num_generations out to keep the default"):
            config(output_dir=str(tmp_path), use_cpu=True, num_generations=None)


@pytest.mark.parametrize("config", [grpotrl.GRPOConfig, trl.GRPOConfig])
def test_numpy_scalars_are_taken_as_the_python_numbers_they_print_as(tiny_llama, tmp_path, config):
    """np.float32(1e-6) as learning_rate was refused as out of range ("it must be a finite number >= 0"); TRL takes
    numpy scalars at construction, then fails at the first rollout (transformers: temperature np.float32(0.7) "has
    to be a strictly positive float") or in to_json_string. Every numpy scalar, in a field or inside its list or
    mapping, becomes the Python number numpy prints (the same float32), and the run trains and saves."""
    import json

    import numpy as np

    weights, extra = [np.float32(1.0)], {"top_p": np.float32(0.9), "sequence_bias": [[[0], np.float64(5.0)]]}
    args = config(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                  num_generations=np.int64(4), max_completion_length=6, max_steps=np.int32(1), report_to="none",
                  save_strategy="steps", save_steps=1, learning_rate=np.float32(1e-6), beta=np.float64(0.04),
                  temperature=np.float32(0.7), reward_weights=weights, generation_kwargs=extra,
                  log_completions=np.bool_(False))
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts(4))
    assert (args.learning_rate, args.beta, args.temperature, args.num_generations, args.max_steps) == (1e-6, 0.04, 0.7,
                                                                                                         4, 1)
    assert [type(v) for v in (args.learning_rate, args.beta, args.num_generations, args.log_completions)] == \
        [float, float, int, bool]
    assert np.float32(args.learning_rate) == np.float32(1e-6)  # the number given, as float32
    assert args.reward_weights == [1.0] and type(args.reward_weights[0]) is float and type(weights[0]) is np.float32
    assert type(args.generation_kwargs["top_p"]) is float and type(extra["top_p"]) is np.float32  # the caller's
    trainer.train()
    assert trainer.state.global_step == 1 and (tmp_path / "checkpoint-1" / "trainer_state.json").is_file()
    assert json.loads(args.to_json_string())["learning_rate"] == 1e-6


def test_numpy_scalars_in_an_sft_config_are_python_numbers(tmp_path):
    import json

    import numpy as np

    from grpotrl.trainers.sft import sft_config

    for args in (grpotrl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, learning_rate=np.float32(2e-5),
                                   max_length=np.int64(64)),
                 sft_config(trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                          learning_rate=np.float32(2e-5), max_length=np.int64(64)), None)):
        assert (type(args.learning_rate), type(args.max_length)) == (float, int)
        assert json.loads(args.to_json_string())["learning_rate"] == 2e-5


def test_I6_generation_kwargs_repetition_penalty_is_honoured_response_only(tiny_llama, tmp_path):
    """TRL lets generation_kwargs override repetition_penalty; grpotrl overwrote it with 1.0 on every path
    (its own response-only penalty reads the field). Now it becomes the field, and reaches the processor."""
    from grpotrl.generation.processors import RepetitionPenaltyProcessor

    args = grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4,
                              num_generations=4, report_to="none", generation_kwargs={"repetition_penalty": 1.3})
    assert args.repetition_penalty == 1.3
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts(8))
    processors = trainer._generation_extras(torch.zeros(2, 5, dtype=torch.long))["logits_processor"]
    assert [p.penalty for p in processors if isinstance(p, RepetitionPenaltyProcessor)] == [1.3]
    assert trainer.generation_config.repetition_penalty == 1.0  # transformers' own (it counts the prompt) is off
    with pytest.raises(grpotrl.InputError, match=r"repetition_penalty=1.2 and generation_kwargs\['repetition_pen"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), repetition_penalty=1.2,
                           generation_kwargs={"repetition_penalty": 1.3})


@pytest.mark.parametrize("config", [grpotrl.GRPOConfig, trl.GRPOConfig])
def test_I6_generation_kwargs_min_new_tokens_becomes_the_field_or_is_refused(tmp_path, config):
    """TRL's config has no min_new_tokens field, so a TRL user writes it in generation_kwargs: it becomes grpotrl's
    field, whose processor blocks every stop id and logs its trigger rate (I6); refused where the field disagrees,
    checked like the field."""
    from grpotrl.configs import complete_grpo_config

    def make(**kw):
        return complete_grpo_config(config(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw))

    assert make(generation_kwargs={"min_new_tokens": 3}).min_new_tokens == 3
    assert make(generation_kwargs={"top_k": 5}).min_new_tokens == 0
    if config is grpotrl.GRPOConfig:
        assert make(min_new_tokens=3, generation_kwargs={"min_new_tokens": 3}).min_new_tokens == 3
        with pytest.raises(grpotrl.InputError, match=r"min_new_tokens=2 and generation_kwargs\['min_new_tokens'\]=3 "
                                                     r"disagree \(I6"):
            make(min_new_tokens=2, generation_kwargs={"min_new_tokens": 3})
    with pytest.raises(grpotrl.InputError, match=r"generation_kwargs\['min_new_tokens'\]=-1: it must be an integer"):
        make(generation_kwargs={"min_new_tokens": -1})


@pytest.mark.parametrize("key", ["min_new_tokens", "min_tokens"])
@pytest.mark.parametrize("config", [grpotrl.GRPOConfig, trl.GRPOConfig])
def test_I6_generation_kwargs_min_length_reaches_vllm_as_min_tokens(tmp_path, config, key):
    """TRL hands generation_kwargs to vLLM's SamplingParams as they are, and SamplingParams has no min_new_tokens
    (vLLM's name is min_tokens): generation_kwargs={'min_new_tokens': 3} under use_vllm was a TypeError at the first
    rollout, after the model had loaded. transformers' GenerationConfig ignores min_tokens without a word. Either
    name becomes the field and leaves generation_kwargs; the trainer hands the field to vLLM as min_tokens
    (vllm_sampling) and to grpotrl's processor on the transformers path."""
    from grpotrl.configs import complete_grpo_config
    from grpotrl.generation.processors import vllm_sampling

    def make(**kw):
        return complete_grpo_config(config(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw))

    given = {key: 3, "top_k": 5}
    args = make(use_vllm=True, generation_kwargs=given)
    assert args.min_new_tokens == 3 and args.generation_kwargs == {"top_k": 5}
    assert given == {key: 3, "top_k": 5}  # the caller's dict is left as it was
    # what TRL's vLLM path updates SamplingParams' keyword arguments with (GRPOTrainer.__init__ sets vllm_sampling's)
    assert vllm_sampling(args, [2], args.generation_kwargs) == {"top_k": 5, "min_tokens": 3, "stop_token_ids": [2]}
    assert make(generation_kwargs={key: 2}).min_new_tokens == 2  # the transformers path: grpotrl's processor
    assert make(generation_kwargs={"min_new_tokens": 2, "min_tokens": 2}).generation_kwargs == {}
    with pytest.raises(grpotrl.InputError, match=r"^generation_kwargs\['min_new_tokens'\]=2 and generation_kwargs"
                                                 r"\['min_tokens'\]=4 disagree \(transformers' and vLLM's names"):
        make(generation_kwargs={"min_new_tokens": 2, "min_tokens": 4})
    with pytest.raises(grpotrl.InputError, match=rf"generation_kwargs\['{key}'\]=-1: it must be an integer"):
        make(generation_kwargs={key: -1})
    if config is grpotrl.GRPOConfig:
        with pytest.raises(grpotrl.InputError, match=rf"min_new_tokens=2 and generation_kwargs\['{key}'\]=3 disagree"):
            make(min_new_tokens=2, generation_kwargs={key: 3})


@pytest.mark.parametrize("setting", [{"presence_penalty": 0.5}, {"frequency_penalty": 0.5},
                                     {"repetition_penalty": 1.2}, {"min_new_tokens": 2},
                                     {"hf_importance_sampling_correction": True}])
def test_I5_beam_sampling_is_refused_where_the_sampler_logprobs_are_recorded(tmp_path, setting):
    """Beam sampling reorders generate's rows at every step and draws each token from all beams' accumulated
    scores: the recorder of the sampler's logprobs, which these settings put into every generate call, failed
    after the first rollout (or gave a row another row's numbers, tests/generation/test_processors.py). Without
    them beam sampling is taken, as TRL takes it (test_sampling_settings_that_sample_pass)."""
    from grpotrl.configs import complete_grpo_config

    beams = {"do_sample": True, "num_beams": 2}
    with pytest.raises(grpotrl.InputError, match=rf"^generation_kwargs\['num_beams'\]=2 with {next(iter(setting))}=.*"
                                                 r"no row has a sampler logprob of its own\. Drop num_beams"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, generation_kwargs=beams, **setting)
    if set(setting) <= set(trl.GRPOConfig.__dataclass_fields__):  # TRL's repetition_penalty
        with pytest.raises(grpotrl.InputError, match=r"generation_kwargs\['num_beams'\]=2 with"):
            complete_grpo_config(trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                                generation_kwargs=beams, **setting))
    grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, generation_kwargs={**beams, "num_beams": 1}, **setting)


@pytest.mark.parametrize("config", [grpotrl.GRPOConfig, trl.GRPOConfig])
def test_I5_generation_kwargs_temperature_becomes_the_field_or_is_refused(tmp_path, config):
    """generation_kwargs' temperature is the temperature the logprobs are computed at (I5): taken as the
    field when the field is at its default, refused when the two disagree, checked like the field."""
    from grpotrl.configs import complete_grpo_config

    def make(**kw):
        return complete_grpo_config(config(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw))

    assert make(generation_kwargs={"temperature": 0.7}).temperature == 0.7
    assert make(temperature=0.7, generation_kwargs={"temperature": 0.7}).temperature == 0.7
    assert make(temperature=0.7, generation_kwargs={"top_k": 5}).temperature == 0.7
    with pytest.raises(grpotrl.InputError, match=r"temperature=0.9 and generation_kwargs\['temperature'\]=0.7 "
                                                 r"disagree \(I5"):
        make(temperature=0.9, generation_kwargs={"temperature": 0.7})
    # generation_kwargs' 1.0 is a value too: TRL samples at it, while the logprobs would be at 0.7
    with pytest.raises(grpotrl.InputError, match=r"temperature=0.7 and generation_kwargs\['temperature'\]=1.0 "
                                                 r"disagree \(I5"):
        make(temperature=0.7, generation_kwargs={"temperature": 1.0})
    with pytest.raises(grpotrl.InputError, match=r"repetition_penalty=1.2 and generation_kwargs\['repetition_penalty'\]"
                                                 r"=1.0 disagree \(I6"):
        make(repetition_penalty=1.2, generation_kwargs={"repetition_penalty": 1.0})
    assert make(generation_kwargs={"temperature": 1.0}).temperature == 1.0
    # the field's 1.0 cannot be told from its default (docs/refused.md): generation_kwargs' value is taken
    assert make(temperature=1.0, generation_kwargs={"temperature": 0.7}).temperature == 0.7
    for bad in (float("nan"), 0.0, -1.0, "0.7"):
        with pytest.raises(grpotrl.InputError, match=r"generation_kwargs\['temperature'\]=.*must be a finite"):
            make(generation_kwargs={"temperature": bad})
    with pytest.raises(grpotrl.InputError, match=r"generation_kwargs\['repetition_penalty'\]=nan"):
        make(generation_kwargs={"repetition_penalty": float("nan")})


def test_I4_generation_kwargs_eos_token_id_is_a_stop_id_too(tiny_llama, tmp_path):
    """generation_kwargs' eos_token_id was overwritten by grpotrl's stop set; it is now added to it."""
    args = grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4,
                              num_generations=4, report_to="none", generation_kwargs={"eos_token_id": 13})
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                  train_dataset=arithmetic_prompts(8))
    assert 13 in trainer.eos_token_ids and 2 in trainer.eos_token_ids
    assert trainer.generation_config.eos_token_id == trainer.eos_token_ids


def test_cagrad_settings_on_a_trainer_that_ignores_them_are_refused(tiny_llama, tmp_path):
    """Only MultiTaskGRPOTrainer reads cagrad / cagrad_c; a plain GRPOTrainer ignored them silently."""
    for setting in ({"cagrad": "exact"}, {"cagrad_c": 0.2}):
        args = grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **setting)
        with pytest.raises(grpotrl.InputError, match=r"on GRPOTrainer, which trains one summed loss"):
            grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                train_dataset=arithmetic_prompts(8))


@pytest.mark.parametrize("setting, message", [({"dynamic_sampling": True}, "step the discriminator again"),
                                              ({"cagrad": "exact"}, "GAD has one task"),
                                              ({"cagrad_c": 0.2}, "GAD has one task")])
def test_gad_refuses_settings_it_would_ignore_or_misapply(tmp_path, setting, message):
    with pytest.raises(grpotrl.InputError, match=message):
        grpotrl.GADConfig(output_dir=str(tmp_path), use_cpu=True, **setting)


def test_I4_vllm_stops_on_every_stop_id_of_the_template(tiny_multistop, tmp_path):
    """vLLM stops on the tokenizer's and the model's eos ids only, and blocks only those under min_tokens: with a
    template whose end-of-turn (<|im_end|>, 2) is not the eos (<|endoftext|>, 0) TRL handed vLLM no stop ids, so
    a rollout ran past the end of the turn, and min_tokens did not hold the end-of-turn back. The trainer hands
    vLLM every stop id the transformers path stops on, after any the user gave."""
    from transformers import AutoTokenizer

    from grpotrl.chat.templates import stop_token_ids
    from grpotrl.configs import complete_grpo_config
    from grpotrl.generation.processors import vllm_sampling

    stops = stop_token_ids(AutoTokenizer.from_pretrained(tiny_multistop))
    assert set(stops) >= {0, 2}
    args = complete_grpo_config(grpotrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                                   use_vllm=True, generation_kwargs={"stop_token_ids": [5]},
                                                   min_new_tokens=2))
    given = dict(args.generation_kwargs)
    sampling = vllm_sampling(args, stops, given)
    assert sampling["stop_token_ids"][0] == 5 and set(sampling["stop_token_ids"]) == {5, *stops}
    assert sampling["min_tokens"] == 2 and given == {"stop_token_ids": [5]}


@pytest.mark.parametrize("config", ["GRPOConfig", "SFTConfig", "GADConfig"])
def test_an_empty_output_dir_is_refused_when_the_config_is_made(config, tmp_path):
    """``GRPOConfig(output_dir="")`` in Python was taken, and the Trainer's ``makedirs('')`` failed only after
    the model loaded; the command line refused it already. transformers' default (None) is still taken."""
    with pytest.raises(InputError, match=r"output_dir is empty"):
        getattr(grpotrl, config)(output_dir="", use_cpu=True, report_to="none")
    assert getattr(grpotrl, config)(use_cpu=True, report_to="none").output_dir == "trainer_output"
