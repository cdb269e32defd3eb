"""Models loaded by name for rewards are checked before any weights load, by the policy's own checks
(``models.sources.check_model_source`` / ``check_tokenizer_source``), each error naming the reward it belongs to:

* a recipe's local judge (``judges: {name: {model_path: ...}}``), which grpotrl loads: refused when the recipe's
  judges are read (``rewards.recipe.parse_judges``), naming ``judges.<name>.model_path``;
* a reward model given by name (a ``str`` in ``reward_funcs``, or a recipe's ``reward_model_name_or_path``), which
  TRL loads after the policy: refused by the trainer's preflight (``rewards.resolve.check_reward_sources``), naming
  ``reward_funcs[i]``, before TRL's ``GRPOTrainer.__init__`` runs;
* among several local judges, every judge's tokenizer is loaded and checked before any judge's weights load.

Everything loads through the real code against the session's offline HF cache (tests/hub_cache.py); nothing is
patched. A missing file is what a checkpoint saved without its tokenizer, or a partial download, leaves.
"""

import json
import os
import shutil

import pytest
from conftest import HUB_CACHE, arithmetic_prompts, length_reward
from hub_cache import add_to_cache

import grpotrl
from grpotrl.errors import InputError
from grpotrl.rewards.recipe import load_local_judges, parse_judges

TOKENIZER_SAVED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def _copy_without_tokenizer(src: str, dst) -> str:
    """A model directory as ``save_pretrained`` leaves it when the tokenizer was not saved beside it."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*TOKENIZER_SAVED))
    assert sorted(os.listdir(dst)) == ["config.json", "generation_config.json", "model.safetensors"]
    return str(dst)


@pytest.fixture(scope="module")
def weights_only_dir(tiny_llama, tmp_path_factory) -> str:
    return _copy_without_tokenizer(tiny_llama, tmp_path_factory.mktemp("weights-only") / "model")


@pytest.fixture(scope="module")
def hub_weights_only(tiny_llama) -> tuple[str, str]:
    """``tiny_llama`` in the HF cache as ``grpotrl-test/weights-only`` without its tokenizer: (id, snapshot)."""
    repo = "grpotrl-test/weights-only"
    return repo, add_to_cache(HUB_CACHE, repo, tiny_llama, skip=TOKENIZER_SAVED)


def _not_in_trl(err) -> None:
    """The error was raised before TRL's ``GRPOTrainer.__init__`` ran (it loads the policy, then reward models)."""
    frames = [str(entry.path) for entry in err.traceback]
    assert not any(f.endswith(os.path.join("trl", "trainer", "grpo_trainer.py")) for f in frames), frames


# ---------------------------------------------------------------------------------------------- local judges


def test_a_recipe_judge_whose_model_dir_has_no_tokenizer_is_refused_when_the_recipe_is_read(weights_only_dir):
    """transformers would fail at the judge's ``AutoTokenizer.from_pretrained``, after every other check."""
    with pytest.raises(InputError) as err:
        parse_judges({"facts": {"model_path": weights_only_dir, "rubric": "hallucination",
                                "rubric_columns": {"reference": "answer"}}})
    text = str(err.value)
    assert text.startswith(f"judges.facts.model_path {weights_only_dir!r}: Model dir")
    assert "has no tokenizer files" in text and "found: config.json, generation_config.json, model.safetensors" in text
    assert "LocalJudge(model, tokenizer, rubric)" in text  # what a Python caller does instead of processing_class=
    assert "pass processing_class=" not in text  # the policy's remedy, not the judge's


def test_a_recipe_judge_whose_cached_hub_snapshot_has_no_tokenizer_is_refused_offline(hub_weights_only):
    repo, snapshot = hub_weights_only
    with pytest.raises(InputError) as err:
        parse_judges({"fair": {"model_path": repo, "rubric": "fairness"}})
    text = str(err.value)
    assert text.startswith(f"judges.fair.model_path {repo!r}: Model {repo!r} is in the local Hugging Face cache "
                           "without tokenizer files")
    assert snapshot in text and f"hf download {repo}" in text


def test_the_cli_refuses_a_local_judge_without_tokenizer_before_the_policy_loads(hub_weights_only, tiny_llama,
                                                                                 tmp_path):
    """The CLI reads the recipe's judges before it builds the trainer, so no weights have loaded."""
    from grpotrl import cli

    repo, _ = hub_weights_only
    with pytest.raises(InputError, match=rf"judges.fair.model_path '{repo}': .*without tokenizer files") as err:
        cli.run("grpo", ["--model_name_or_path", tiny_llama, "--output_dir", str(tmp_path / "out"), "--use_cpu",
                         "true", "--judges", json.dumps({"fair": {"model_path": repo, "rubric": "fairness"}}),
                         "--reward_funcs", "fair"])
    _not_in_trl(err)


def test_every_judge_tokenizer_is_checked_before_any_judge_weights_load(tiny_llama, tmp_path):
    """Judge ``a``'s weights cannot load (its config.json asks for an MLP of another width than the checkpoint's:
    no file check sees it, ``from_pretrained`` raises) and judge ``b``'s tokenizer has no chat template. ``b`` is
    refused first: its tokenizer was checked before ``a``'s weights were read. Control: with ``b`` fine, ``a``'s
    load is what fails, so its weights are really read next."""
    from transformers import AutoTokenizer

    a_dir = tmp_path / "a"
    shutil.copytree(tiny_llama, a_dir)
    config = json.loads((a_dir / "config.json").read_text())
    (a_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] // 2}))
    b_dir = tmp_path / "b"
    shutil.copytree(tiny_llama, b_dir, ignore=shutil.ignore_patterns("chat_template.jinja"))
    assert AutoTokenizer.from_pretrained(b_dir).chat_template is None
    judges = parse_judges({"a": {"model_path": str(a_dir), "rubric": "fairness"},
                           "b": {"model_path": str(b_dir), "rubric": "fairness"}})
    with pytest.raises(InputError, match=r"LocalJudge 'b': the judge tokenizer \(.*\) has no chat template"):
        load_local_judges([judges["a"], judges["b"]], "cpu")
    good = parse_judges({"b": {"model_path": tiny_llama, "rubric": "fairness"}})["b"]
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        load_local_judges([judges["a"], good], "cpu")


def test_local_judges_load_once_each_and_keep_their_places(tiny_llama):
    """Control for the two-pass load: a judge named by two tasks loads once, and every entry keeps its place
    (per-task lists, a plain list, one judge alone)."""
    spec = parse_judges({"j": {"model_path": tiny_llama, "rubric": "fairness"}})["j"]
    by_task = load_local_judges({"a": [length_reward, spec], "b": spec}, "cpu")
    assert by_task["a"][0] is length_reward and by_task["a"][1] is by_task["b"][0]
    assert type(by_task["b"][0]).__name__ == "LocalJudge" and by_task["b"][0].name == "j"
    listed = load_local_judges([spec, length_reward], "cpu")
    assert type(listed[0]).__name__ == "LocalJudge" and listed[1] is length_reward
    assert type(load_local_judges(spec, "cpu")).__name__ == "LocalJudge"
    assert load_local_judges(length_reward, "cpu") is length_reward


# ---------------------------------------------------------------------------------------------- reward models


def test_a_reward_model_dir_without_tokenizer_is_refused_before_trl_loads_the_policy(weights_only_dir, tiny_llama,
                                                                                     grpo_args):
    """TRL would load the policy and the reward model's weights, then fail in ``AutoTokenizer.from_pretrained``."""
    with pytest.raises(InputError) as err:
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=[length_reward, weights_only_dir], args=grpo_args(),
                            train_dataset=arithmetic_prompts(8))
    text = str(err.value)
    assert text.startswith(f"reward_funcs[1] (a reward model): Model dir {weights_only_dir!r} has no tokenizer files")
    assert "reward_processing_classes[1]" in text and "pass processing_class=" not in text
    _not_in_trl(err)


def test_a_reward_model_snapshot_without_tokenizer_at_the_runs_revision_is_refused(tiny_llama, grpo_args):
    """TRL loads every reward model at ``model_init_kwargs['revision']``: main holds a tokenizer, the revision none.
    The policy is a local directory (no revision applies to it)."""
    repo = "grpotrl-test/reward-tokenizer-on-main"
    add_to_cache(HUB_CACHE, repo, tiny_llama)
    snapshot = add_to_cache(HUB_CACHE, repo, tiny_llama, revision="weights-only", skip=TOKENIZER_SAVED)
    with pytest.raises(InputError) as err:
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=[repo, length_reward], train_dataset=arithmetic_prompts(8),
                            args=grpo_args(model_init_kwargs={"revision": "weights-only"}))
    text = str(err.value)
    assert text.startswith(f"reward_funcs[0] (a reward model; from a recipe, reward_model_name_or_path): Model "
                           f"{repo!r} (revision 'weights-only') is in the local Hugging Face cache without tokenizer")
    assert snapshot in text and "--revision weights-only" in text
    _not_in_trl(err)


def test_a_reward_model_not_in_the_cache_is_named_by_its_index(grpo_args, tiny_llama):
    with pytest.raises(InputError, match=r"^reward_funcs\[1\] \(a reward model\): Reward model 'org/missing-rm' is "
                                         r"not in the local Hugging Face cache"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=[length_reward, "org/missing-rm"], args=grpo_args(),
                            train_dataset=arithmetic_prompts(8))


def test_reward_processing_classes_of_another_length_is_refused_before_trl_loads_the_policy(tiny_llama, grpo_args,
                                                                                            smollm2_tokenizer):
    with pytest.raises(InputError, match=r"The number of reward processing classes \(1\) must match the number of "
                                         r"reward functions \(2\)") as err:
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=[length_reward, tiny_llama], args=grpo_args(),
                            train_dataset=arithmetic_prompts(8), reward_processing_classes=[smollm2_tokenizer])
    _not_in_trl(err)


def test_a_reward_model_without_tokenizer_files_and_its_tokenizer_given_is_not_refused(weights_only_dir, tiny_llama,
                                                                                       grpo_args, smollm2_tokenizer):
    """Control: ``reward_processing_classes[1]`` is the reward model's tokenizer, so TRL loads none from its dir;
    the trainer is built and scores with it."""
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=[length_reward, weights_only_dir], args=grpo_args(),
                                  train_dataset=arithmetic_prompts(8),
                                  reward_processing_classes=[None, smollm2_tokenizer])
    assert trainer.reward_processing_classes[1] is smollm2_tokenizer
    assert type(trainer.reward_funcs[1]).__name__ == "LlamaForSequenceClassification"


def test_the_cli_names_reward_model_name_or_path_without_tokenizer(weights_only_dir, tiny_llama, tmp_path):
    from grpotrl import cli

    with pytest.raises(InputError, match=r"^reward_funcs\[0\] \(a reward model; from a recipe, "
                                         r"reward_model_name_or_path\): Model dir .* has no tokenizer files") as err:
        cli.run("grpo", ["--model_name_or_path", tiny_llama, "--output_dir", str(tmp_path / "out"), "--use_cpu",
                         "true", "--reward_model_name_or_path", weights_only_dir, "--reward_funcs", "exact_answer"])
    _not_in_trl(err)
