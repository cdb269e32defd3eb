"""The model's own generation_config.json on the transformers generate path (``preflight``,
``configs.checks.UNRUNNABLE_GENERATION`` / ``SAMPLING_CHANGES``): TRL's generation config leaves most fields
unset, and transformers' generate fills each from the model's file. A field under which generate cannot return
one sampled completion per prompt is refused before the weights load; one that changes the sampled
distribution is taken, as TRL takes it, with one warning; ``generation_kwargs`` overrides the file."""

import json
import logging
import re
import shutil

import pytest
import transformers

import grpotrl
from conftest import arithmetic_prompts, length_reward
from grpotrl.errors import InputError

PREFLIGHT = "grpotrl.preflight"


def model_with(tiny_llama, tmp_path, **fields) -> str:
    """``tiny_llama`` whose generation_config.json sets ``fields`` (sampling on, as in a chat model's file)."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                                  "do_sample": True, **fields}))
    return str(model_dir)


def no_load(monkeypatch):
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model was loaded before the input was validated"))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == PREFLIGHT and r.levelno == logging.WARNING]


def completion_lengths(trainer) -> tuple[float, float]:
    """The shortest completion and the share at max_completion_length, over the run's log."""
    logs = [e for e in trainer.state.log_history if "completions/min_length" in e]
    return min(e["completions/min_length"] for e in logs), min(e["completions/max_length_share"] for e in logs)


@pytest.mark.parametrize("field, value, how", [
    ("num_return_sequences", 2, r"pass generation_kwargs=\{'num_return_sequences': 1\}"),
    ("return_dict_in_generate", True, r"pass generation_kwargs=\{'return_dict_in_generate': False\}"),
    ("stop_strings", ["\n\n"], r"remove it from generation_config\.json in a copy of .*model, or load the model, "
                               r"set model\.generation_config\.stop_strings = None"),
    ("prompt_lookup_num_tokens", 3, r"remove it from generation_config\.json"),
    ("use_mtp", True, r"pass generation_kwargs=\{'use_mtp': False\}"),
    ("dola_layers", "high", r"remove it from generation_config\.json"),
    ("max_time", 5.0, r"remove it from generation_config\.json"),
])
def test_a_model_generation_field_under_which_generate_cannot_run_is_refused_before_the_load(
        tiny_llama, tmp_path, grpo_args, monkeypatch, field, value, how):
    """Each of these, from the model's generation_config.json, failed at the first rollout after the model loaded
    (num_return_sequences: 'Sizes of tensors must match ... Expected size 4 but got size 8'; a dict return: 'tuple
    indices must be integers'; stop_strings: 'we could not locate a tokenizer'; prompt lookup: 'assisted generate is
    only supported for batch_size = 1'; DoLa: 'requires trust_remote_code=True'; max_time: INVARIANT I4 on completions
    cut without a stop token). Refused before the load, naming the field, its value, the file and the way out."""
    model = model_with(tiny_llama, tmp_path, **{field: value})
    no_load(monkeypatch)
    with pytest.raises(InputError, match=rf"^{re.escape(f'{field}={value!r}')} in the generation_config\.json of "
                                         rf"{re.escape(model)} .*To train, {how}"):
        grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=arithmetic_prompts(4),
                            args=grpo_args())


def test_the_models_num_return_sequences_is_refused_from_a_loaded_model_and_generation_kwargs_overrides_it(
        tiny_llama, tmp_path, grpo_args, monkeypatch):
    """generate returned 8 rows for 4 prompts and TRL's first rollout failed; a loaded model's generation_config is
    checked as its file is, and generation_kwargs' num_return_sequences=1 replaces the model's and trains."""
    model = model_with(tiny_llama, tmp_path, num_return_sequences=2)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(model)
    args = grpo_args(max_steps=1, per_device_train_batch_size=4, max_completion_length=6)
    with monkeypatch.context() as m:
        no_load(m)
        with pytest.raises(InputError, match=r"^num_return_sequences=2 in the generation_config of the model passed "
                                             r"makes generate return that many completions per prompt row"):
            grpotrl.GRPOTrainer(model=loaded, reward_funcs=length_reward, train_dataset=arithmetic_prompts(4),
                                args=args)
    args = grpo_args(max_steps=1, per_device_train_batch_size=4, max_completion_length=6,
                     generation_kwargs={**args.generation_kwargs, "num_return_sequences": 1})
    trainer = grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=arithmetic_prompts(4),
                                  args=args)
    trainer.train()
    assert trainer.state.global_step == 1


def test_generation_kwargs_under_which_generate_cannot_run_are_refused_by_the_config(grpo_args):
    """The same fields written in generation_kwargs failed at the same first rollout: refused by the config."""
    with pytest.raises(InputError, match=r"^generation_kwargs\['num_return_sequences'\]=4 makes generate return that "
                                         r"many completions per prompt row.*Drop it from generation_kwargs"):
        grpo_args(generation_kwargs={"num_return_sequences": 4})
    with pytest.raises(InputError, match=r"^generation_kwargs\['stop_strings'\]=\['</s>'\] needs the tokenizer"):
        grpo_args(generation_kwargs={"stop_strings": ["</s>"]})
    assert grpo_args(generation_kwargs={"num_return_sequences": 1, "max_time": 60.0}).generation_kwargs


def test_I5_a_model_field_that_changes_the_sampled_distribution_is_warned_once_and_generation_kwargs_turns_it_off(
        tiny_llama, tmp_path, grpo_args, caplog):
    """suppress_tokens=[0, 2] in the model's file (the stop ids) ran in every rollout, unannounced: no completion
    could stop (every one at max_completion_length) while grpo_args biases sampling towards those ids. Taken, as TRL
    takes it, with one warning naming the field, what it does and the generation_kwargs value that turns it off;
    with that value the completions stop again and nothing is said."""
    model = model_with(tiny_llama, tmp_path, suppress_tokens=[0, 2])
    args = grpo_args(max_steps=1)
    with caplog.at_level(logging.WARNING, logger=PREFLIGHT):
        trainer = grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                                      args=args)
    warned = warnings_of(caplog)
    assert len(warned) == 1 and re.search(
        r"^The generation_config\.json of .* changes the distribution completions are sampled from .*"
        r"suppress_tokens=\[0, 2\] never samples these token ids \(to sample without it, pass "
        r"generation_kwargs=\{'suppress_tokens': \[\]\}", warned[0]), warned
    trainer.train()
    assert completion_lengths(trainer)[1] == 1.0  # the model's file ran: no completion stopped
    caplog.clear()
    args = grpo_args(max_steps=1, output_dir=str(tmp_path / "off"),
                     generation_kwargs={**args.generation_kwargs, "suppress_tokens": []})
    with caplog.at_level(logging.WARNING, logger=PREFLIGHT):
        trainer = grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                                      args=args)
    assert warnings_of(caplog) == []
    trainer.train()
    assert completion_lengths(trainer)[1] < 1.0  # some completions stopped


def test_I6_generation_kwargs_min_new_tokens_0_overrides_the_models_min_new_tokens(tiny_llama, tmp_path, grpo_args,
                                                                                  caplog):
    """generation_kwargs' min_new_tokens becomes grpotrl's field, and the trainer left transformers' own unset,
    so generate filled it from the model's file: min_new_tokens=4 there blocked every stop id for 4 tokens even
    with generation_kwargs={'min_new_tokens': 0} (shortest completion 6 tokens, 1 without the file's). The field
    is now the one setting, and the model's, not applied, is named once."""
    model = model_with(tiny_llama, tmp_path, min_new_tokens=4)
    args = grpo_args(max_steps=1, generation_kwargs={**grpo_args().generation_kwargs, "min_new_tokens": 0})
    with caplog.at_level(logging.WARNING, logger=PREFLIGHT):
        trainer = grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                                      args=args)
    assert [w for w in warnings_of(caplog) if w.startswith("min_new_tokens=4 in the generation_config.json of ")
            and "is not applied" in w and "Set min_new_tokens=4 to keep the model's" in w], warnings_of(caplog)
    trainer.train()
    assert completion_lengths(trainer)[0] < 4


def test_no_min_length_processor_runs_where_the_model_sets_no_min_new_tokens(tiny_llama, grpo_args, monkeypatch):
    """Overriding the model's min_new_tokens must not cost the rollouts without one: transformers' min_new_tokens
    set to 0 made generate add a MinLengthLogitsProcessor(prompt width) that never fires, run on every decoding
    step, which also takes the sampled-logprob recorder off its raw-scores path."""
    seen = []
    build = transformers.GenerationMixin._get_logits_processor

    def recorded(self, *args, **kwargs):
        processors = build(self, *args, **kwargs)
        seen.append([type(p).__name__ for p in processors])
        return processors

    monkeypatch.setattr(transformers.GenerationMixin, "_get_logits_processor", recorded)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(4),
                                  args=grpo_args(max_steps=1))
    trainer.train()
    assert seen and not any({"MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor"} & set(s) for s in seen), seen


def test_the_models_generation_fields_are_not_checked_beside_a_rollout_func(tiny_llama, tmp_path, grpo_args,
                                                                           monkeypatch):
    """A rollout_func samples without generate, so the model's file does not reach its completions."""
    model = model_with(tiny_llama, tmp_path, num_return_sequences=2, no_repeat_ngram_size=2)

    def rollout(prompts, trainer):
        raise AssertionError("not called: the trainer is only built")

    trainer = grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=arithmetic_prompts(4),
                                  args=grpo_args(), rollout_func=rollout)
    assert trainer.rollout_func is rollout
