"""grpotrl's preflight checks (preflight_data, preflight_model, checkpoints, rewards.resolve) and the
CLI's pre-flight: every bad input is an ``InputError`` that names the bad value, raised before any
model is loaded (fast: no weights are read here)."""

import copy
import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from datasets import Dataset
from safetensors.torch import save_file

import grpotrl
from conftest import CounterEnvironment, arithmetic_prompts, length_reward
from grpotrl import checkpoints, cli
from grpotrl.data import checks as preflight_data
from grpotrl.configs import checks
from grpotrl.models import sources
from grpotrl.chat import templates
from grpotrl.rewards import resolve
from grpotrl.errors import InputError
from grpotrl.rewards import rules

GRPO_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2" / "grpo_quickstart.yaml"
USER = [{"role": "user", "content": "What is 7 + 5?"}]
ASSISTANT = [{"role": "assistant", "content": "12"}]


@pytest.fixture
def no_model_load(monkeypatch):
    """Any attempt to load weights fails the test: the checks must stop the run before."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was validated")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", refuse)


def write_weights(directory, name="model.safetensors"):
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.zeros(4)}, str(directory / name))
    return directory / name


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------

def test_grpo_dataset_without_prompt_column_names_the_columns_found():
    ds = Dataset.from_list([{"question": "What is 7 + 5?", "answer": "12"}])
    with pytest.raises(InputError, match=r"'prompt' column.*\['question', 'answer'\]"):
        preflight_data.check_dataset(ds, "train", kind="grpo")


def test_grpo_dataset_bad_row_is_named_by_index_and_value():
    ds = Dataset.from_list([{"prompt": USER}, {"prompt": [{"role": "usr", "content": "hi"}]}])
    with pytest.raises(InputError, match=r"Row 1 of the 'train' split.*role 'usr'"):
        preflight_data.check_dataset(ds, "train", kind="grpo")


def test_grpo_dataset_missing_content_is_named():
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": [{"role": "user"}]}])
    with pytest.raises(InputError, match=r"Row 1 .*content None"):
        preflight_data.check_dataset(ds, "train", kind="grpo")


def test_grpo_streaming_dataset_is_checked_on_its_first_rows_only():
    """An IterableDataset (streaming) may be endless: the check reads ITERABLE_ROWS_CHECKED rows, no more."""
    from datasets import IterableDataset

    read = []

    def endless(bad_at=None):
        i = 0
        while True:
            read.append(i)
            yield {"prompt": USER if i != bad_at else [{"role": "user", "content": 7}]}
            i += 1

    preflight_data.check_dataset(IterableDataset.from_generator(endless), "train", kind="grpo")
    assert len(read) <= preflight_data.ITERABLE_ROWS_CHECKED + 1
    with pytest.raises(InputError, match="Row 3 of the 'train' split"):
        preflight_data.check_dataset(IterableDataset.from_generator(endless, gen_kwargs={"bad_at": 3}), "train")
    with pytest.raises(InputError, match="'prompt' column"):
        preflight_data.check_dataset(Dataset.from_list([{"question": "x"}]).to_iterable_dataset(), "train")


def test_grpo_rows_for_an_environment_may_leave_the_prompt_out():
    """With environment_factory the environment's reset() supplies the prompt (TRL's routing rows)."""
    rows = Dataset.from_list([{"environment": "counter"}, {"environment": "echo"}])
    preflight_data.check_dataset(rows, "train", kind="grpo", prompt_optional=True)
    with pytest.raises(InputError, match="'prompt' column"):
        preflight_data.check_dataset(rows, "train", kind="grpo")


def test_grpo_prompt_may_hold_tool_calls_and_plain_text():
    tool_turns = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]},
        {"role": "tool", "name": "multiply", "content": "12"}]
    preflight_data.check_dataset(Dataset.from_list([{"prompt": tool_turns}]), "train", kind="grpo")
    preflight_data.check_dataset(Dataset.from_list([{"prompt": "What is 7 + 5?"}]), "train", kind="grpo")


def test_empty_split_is_an_error():
    ds = Dataset.from_list([{"prompt": USER}]).select([])
    with pytest.raises(InputError, match=r"'test' split is empty"):
        preflight_data.check_dataset(ds, "test", kind="grpo")


def test_sft_dataset_without_a_layout_trl_takes_names_the_columns_and_the_layouts():
    ds = Dataset.from_list([{"question": "What is 7 + 5?", "answer": "12"}])
    layouts = r"'text' column .*'messages', 'prompt' \+ 'completion'.*\['question', 'answer'\]"
    with pytest.raises(InputError, match=layouts):
        preflight_data.check_dataset(ds, "train", kind="sft")
    preflight_data.check_dataset(ds, "train", kind="sft", formatting_func=lambda row: row["question"])
    preflight_data.check_dataset(ds.rename_column("question", "body"), "train", kind="sft", text_field="body")


def test_sft_takes_what_trl_takes():
    """Plain text, plain and conversational prompt-completion, messages (tool calls with content
    None, a lone assistant turn, a completion ending on a user turn), ShareGPT conversations,
    pre-tokenized rows and streams: none of them is refused."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    for rows in ([{"text": "7 + 5 = 12"}], [{"prompt": "7 + 5 =", "completion": " 12"}],
                 [{"prompt": USER, "completion": ASSISTANT + USER}], [{"messages": ASSISTANT}],
                 [{"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [call]}]}],
                 [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}],
                 [{"input_ids": [1, 2, 3]}]):
        preflight_data.check_dataset(Dataset.from_list(rows), "train", kind="sft")
        preflight_data.check_dataset(Dataset.from_list(rows).to_iterable_dataset(), "train", kind="sft")


def test_sft_bad_row_is_named_by_index():
    ds = Dataset.from_list([{"prompt": USER, "completion": ASSISTANT}, {"prompt": [{"content": "hi"}],
                                                                        "completion": ASSISTANT}])
    with pytest.raises(InputError, match=r"Row 1 .*prompt\[0\] .*not a dict with a 'role'"):
        preflight_data.check_dataset(ds, "train", kind="sft")
    mixed = Dataset.from_list([{"prompt": USER, "completion": "12"}])
    with pytest.raises(InputError, match=r"Row 0 .*must both be message lists or both strings"):
        preflight_data.check_dataset(mixed, "train", kind="sft")
    with pytest.raises(InputError, match=r"'eval' split is empty"):
        preflight_data.check_dataset(ds.select([]), "eval", kind="sft")


def test_quickstart_data_passes_both_checks():
    from grpotrl.data import load_quickstart

    for split in ("train", "test"):
        ds = load_quickstart(split)
        preflight_data.check_dataset(ds, split, kind="grpo")
        preflight_data.check_dataset(ds, split, kind="sft")
        assert rules.exact_answer_reward(ds["completion"], answer=ds["answer"]) == [1.0] * len(ds)
        assert rules.format_reward(ds["completion"]) == [1.0] * len(ds)
    train = {r[0]["content"] for r in load_quickstart("train")["prompt"]}
    test = {r[0]["content"] for r in load_quickstart("test")["prompt"]}
    assert len(train) == 200 and len(test) == 40 and not train & test


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def test_tokenizer_without_chat_template_is_an_error(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(InputError, match="has no chat template"):
        templates.require_chat_template(tokenizer)


def test_a_chat_template_carried_by_the_processor_counts(smollm2_tokenizer):
    """A (VLM) processor may carry the template its tokenizer lacks; TRL renders prompts with it."""
    from types import SimpleNamespace

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    template, tokenizer.chat_template = tokenizer.chat_template, None
    processor = SimpleNamespace(tokenizer=tokenizer, chat_template=template)
    templates.require_chat_template(processor)
    assert templates.chat_template_of(processor) == template and templates.chat_template_of(tokenizer) is None


def test_cli_stops_on_a_tokenizer_without_chat_template(tmp_path, smollm2_path, smollm2_tokenizer, no_model_load):
    model_dir = tmp_path / "no-template"
    write_weights(model_dir)
    (model_dir / "config.json").write_text((Path(smollm2_path) / "config.json").read_text())
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(model_dir)
    with pytest.raises(InputError, match="has no chat template"):
        cli.run("grpo", ["--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "out"),
                         "--use_cpu", "true"])


# ---------------------------------------------------------------------------------------------
# Model directories and checkpoints
# ---------------------------------------------------------------------------------------------

def test_missing_local_model_dir_names_the_path(tmp_path):
    missing = tmp_path / "outputs" / "smollm2-sft-quickstart"
    with pytest.raises(InputError, match=r"does not exist.*run that first"):
        sources.check_model_dir(str(missing))


def test_model_dir_with_config_only_is_incomplete(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InputError, match=r"incomplete weights: no model.safetensors.*found: config.json"):
        sources.check_model_dir(str(tmp_path))


def test_model_dir_without_config_is_an_error(tmp_path):
    write_weights(tmp_path)
    with pytest.raises(InputError, match=r"has no config.json \(found: model.safetensors\)"):
        sources.check_model_dir(str(tmp_path))


def test_truncated_safetensors_is_incomplete(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    weights = write_weights(tmp_path)
    sources.check_model_dir(str(tmp_path))  # complete: passes
    data = weights.read_bytes()
    weights.write_bytes(data[:-4])  # a save killed before the last bytes
    with pytest.raises(InputError, match=rf"{len(data) - 4} bytes, its header says {len(data)}"):
        sources.check_model_dir(str(tmp_path))


def test_sharded_checkpoint_with_a_missing_shard(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    write_weights(tmp_path, "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match=r"missing: \['model-00002-of-00002.safetensors'\]"):
        sources.check_model_dir(str(tmp_path))
    write_weights(tmp_path, "model-00002-of-00002.safetensors")
    sources.check_model_dir(str(tmp_path))


def test_peft_adapter_dir_checks_adapter_weights_and_base(tmp_path):
    base = tmp_path / "base"
    (base / "config.json").parent.mkdir()
    (base / "config.json").write_text("{}")
    write_weights(base)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    with pytest.raises(InputError, match=r"adapter dir .* no adapter_model.safetensors"):
        sources.check_model_dir(str(adapter))
    write_weights(adapter, "adapter_model.safetensors")
    sources.check_model_dir(str(adapter))
    (base / "model.safetensors").unlink()
    with pytest.raises(InputError, match=r"base model of PEFT adapter .* incomplete weights"):
        sources.check_model_dir(str(adapter))


def write_checkpoint(directory, weights="model.safetensors"):
    """Every file the Trainer writes into checkpoint-N (tiny stand-ins)."""
    write_weights(directory, weights)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({"state": torch.zeros(2)}, str(directory / name))
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": 1, "log_history": []}))
    return directory


def test_partial_resume_checkpoint_names_complete_ones_beside_it(tmp_path):
    good, partial = write_checkpoint(tmp_path / "checkpoint-10"), tmp_path / "checkpoint-20"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    checkpoints.check_resume_checkpoint(str(good))
    with pytest.raises(InputError, match=r"checkpoint-20' is incomplete: no trainer_state.json; no model.*"
                                         r"\['checkpoint-10'\].*--resume_from_checkpoint .*checkpoint-10"):
        checkpoints.check_resume_checkpoint(str(partial))
    with pytest.raises(InputError, match="holds no checkpoint-N dir"):
        checkpoints.find_last_checkpoint(str(tmp_path / "checkpoint-20"))


def test_resume_true_with_an_incomplete_newest_checkpoint_is_an_error_not_a_silent_step_back(tmp_path):
    write_checkpoint(tmp_path / "checkpoint-9")  # numeric order: checkpoint-10 is the newest
    newest = write_checkpoint(tmp_path / "checkpoint-10")
    assert checkpoints.find_last_checkpoint(str(tmp_path)) == str(newest)
    (newest / "rng_state.pth").unlink()  # killed after the optimizer, before the RNG state
    with pytest.raises(InputError, match=r"checkpoint-10' is incomplete: no rng_state.pth.*"
                                         r"--resume_from_checkpoint .*checkpoint-9\b.*left as it is"):
        checkpoints.find_last_checkpoint(str(tmp_path))
    assert newest.is_dir() and (newest / "optimizer.pt").is_file()  # nothing deleted


def test_checkpoint_files_cut_short_are_incomplete(tmp_path):
    ckpt = write_checkpoint(tmp_path / "checkpoint-1")
    optimizer = ckpt / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:-30])  # the zip directory at the end is gone
    (ckpt / "trainer_state.json").write_text('{"global_step": 1, "log_hi')
    with pytest.raises(InputError, match=r"trainer_state.json is not valid JSON.*optimizer.pt is \d+ bytes and not a "
                                         r"complete torch.save file"):
        checkpoints.check_resume_checkpoint(str(ckpt))


def test_model_only_checkpoint_is_named_as_such(tmp_path):
    ckpt = write_checkpoint(tmp_path / "checkpoint-1")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (ckpt / name).unlink()
    with pytest.raises(InputError, match=r"no optimizer, scheduler or RNG state .*weights-only save "
                                         r"\(save_only_model=True.*model_name_or_path") as err:
        checkpoints.check_resume_checkpoint(str(ckpt))
    assert "killed while saving" not in str(err.value)  # it used to say both


def test_resuming_a_finished_runs_output_dir_points_at_its_last_full_checkpoint(tmp_path):
    """A finished run's output_dir holds final weights + trainer_state.json (no optimizer) and its checkpoints."""
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoint-4")
    write_weights(run)
    (run / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    with pytest.raises(InputError, match=r"weights-only save .*resume from a full checkpoint: \S+checkpoint-4\.$") \
            as err:
        checkpoints.check_resume_checkpoint(str(run))
    assert "killed while saving" not in str(err.value)


def test_checkpoint_needs_the_files_its_trainer_adds(tmp_path):
    ckpt = write_checkpoint(tmp_path / "checkpoint-1")
    required = ("grpotrl_template.json", "discriminator/model.safetensors", "discriminator/optimizer.pt")
    with pytest.raises(InputError, match=r"no grpotrl_template.json; no discriminator/model.safetensors; "
                                         r"no discriminator/optimizer.pt"):
        checkpoints.check_resume_checkpoint(str(ckpt), required)
    (ckpt / "grpotrl_template.json").write_text("{}")
    write_weights(ckpt / "discriminator")
    torch.save({}, str(ckpt / "discriminator" / "optimizer.pt"))
    checkpoints.check_resume_checkpoint(str(ckpt), required)


def test_resume_files_follow_the_trainer_and_its_settings():
    from types import SimpleNamespace

    from grpotrl.checkpoints import resume_files

    assert resume_files(SimpleNamespace(check_template=True, use_adaptive_entropy=False), "grpo") == (
        "grpotrl_template.json",)
    not_sharded = dict(deepspeed=None, fsdp=None)  # GAD's optimizer file follows the launch (test_gad_engine.py)
    assert resume_files(SimpleNamespace(check_template=False, use_adaptive_entropy=True, **not_sharded), "gad") == (
        "entropy_ctrl_state.json", "discriminator/model.safetensors", "discriminator/optimizer.pt")


def test_lora_checkpoint_needs_a_lora_run_and_full_one_a_full_run(tmp_path):
    from types import SimpleNamespace

    from grpotrl.checkpoints import resume_checkpoint

    args = SimpleNamespace(check_template=False, use_adaptive_entropy=False, output_dir=str(tmp_path),
                           steps_per_generation=1, num_iterations=1, gradient_accumulation_steps=1)
    lora = write_checkpoint(tmp_path / "checkpoint-1", "adapter_model.safetensors")
    (lora / "adapter_config.json").write_text("{}")
    assert resume_checkpoint(True, args, "grpo", use_peft=True) == str(lora)
    with pytest.raises(InputError, match=r"holds a LoRA adapter but this run has use_peft: false"):
        resume_checkpoint(str(lora), args, "grpo", use_peft=False)


def test_peft_and_deepspeed_checkpoints_are_complete_in_their_own_layout(tmp_path):
    lora = write_checkpoint(tmp_path / "lora" / "checkpoint-1", "adapter_model.safetensors")
    (lora / "adapter_config.json").write_text("{}")
    checkpoints.check_resume_checkpoint(str(lora))
    ds = tmp_path / "ds" / "checkpoint-1"
    (ds / "global_step1").mkdir(parents=True)  # DeepSpeed: weights and optimizer live in global_stepN/
    torch.save({}, str(ds / "rng_state_0.pth"))
    (ds / "trainer_state.json").write_text("{}")
    (ds / "latest").write_text("global_step1")
    checkpoints.check_resume_checkpoint(str(ds))
    (ds / "latest").write_text("global_step2")
    with pytest.raises(InputError, match="'latest' names DeepSpeed state 'global_step2', which is not there"):
        checkpoints.check_resume_checkpoint(str(ds))


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------

def test_unknown_reward_name_lists_the_known_ones():
    assert resolve.resolve_reward_funcs(["exact_answer"]) == [rules.exact_answer_reward]
    with pytest.raises(InputError, match=r"\['exact_anwser'\].*Known: \['exact_answer', 'format', 'length', "
                                         r"'even_handed', 'accuracy_reward', "):
        resolve.resolve_reward_funcs(["exact_anwser", "format"])


def test_reward_needing_a_missing_column_is_caught_before_training():
    ds = Dataset.from_list([{"prompt": USER, "solution": "12"}])
    resolve.check_reward_columns([rules.format_reward], ds, "train")
    with pytest.raises(InputError, match=r"exact_answer_reward needs the dataset column\(s\) \['answer'\]"):
        resolve.check_reward_columns([rules.exact_answer_reward], ds, "train")


@pytest.mark.parametrize("per_task", [False, True], ids=["GRPOTrainer", "MultiTaskGRPOTrainer"])
def test_python_api_checks_the_columns_rewards_and_judges_read_before_the_load(tiny_llama, grpo_args, no_model_load,
                                                                                per_task):
    """A reward function or judge passed from Python (not named in a recipe) that reads a column the
    data lacks is refused in __init__, before any weights load; TRL would fail after generation."""
    from grpotrl import GRPOTrainer, MultiTaskGRPOTrainer
    from grpotrl.rewards.judges import HttpJudge
    from grpotrl.rewards.rubrics import HALLUCINATION

    judge = HttpJudge(HALLUCINATION, base_url="http://127.0.0.1:9/v1", model="judge", name="facts")
    train = Dataset.from_list([{"prompt": USER, "solution": "12", "task": "a"}] * 4)
    cls, funcs = (MultiTaskGRPOTrainer, {"a": judge}) if per_task else (GRPOTrainer, [rules.format_reward, judge])
    with pytest.raises(InputError, match=r"Judge 'facts' \(rubric 'hallucination'\) reads the dataset column\(s\) "
                                         r"\['reference'\]"):
        cls(tiny_llama, reward_funcs=funcs, args=grpo_args(), train_dataset=train)
    evals = Dataset.from_list([{"prompt": USER, "task": "a"}] * 4)  # train has 'answer'; the eval split does not
    funcs = {"a": rules.exact_answer_reward} if per_task else rules.exact_answer_reward
    with pytest.raises(InputError, match=r"exact_answer_reward needs the dataset column\(s\) \['answer'\], but the "
                                         r"'eval' split"):
        cls(tiny_llama, reward_funcs=funcs, args=grpo_args(eval_strategy="steps", eval_steps=1), eval_dataset=evals,
            train_dataset=Dataset.from_list([{"prompt": USER, "answer": "12", "task": "a"}] * 4))
    with pytest.raises(AssertionError, match="loaded before"):  # an eval set TRL never scores: no column is read
        cls(tiny_llama, reward_funcs=funcs, args=grpo_args(), eval_dataset=evals,
            train_dataset=Dataset.from_list([{"prompt": USER, "answer": "12", "task": "a"}] * 4))


# ---------------------------------------------------------------------------------------------
# CLI: parse errors and the order of checks
# ---------------------------------------------------------------------------------------------

def test_mistyped_recipe_key_errors_before_the_model_loads(tmp_path, no_model_load):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: smollm2-135m-instruct\nlerning_rate: 1.0e-5\nuse_cpu: true\n")
    with pytest.raises(InputError, match=r"recipe.yaml: 'lerning_rate' \(did you mean 'learning_rate'"):
        cli.run("grpo", ["--config", str(recipe)])


def test_mistyped_command_line_key_is_an_error(tmp_path, no_model_load):
    with pytest.raises(InputError, match=r"'num_generation' \(did you mean 'num_generations'"):
        cli.parse_args("grpo", ["--output_dir", str(tmp_path), "--num_generation", "4"])


def test_recipe_yaml_is_read_with_safe_load(tmp_path):
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(f'output_dir: !!python/object/apply:os.makedirs ["{tmp_path / "pwned"}"]\n')
    with pytest.raises(Exception, match="could not determine a constructor"):
        cli.parse_args("sft", ["--config", str(recipe)])
    assert not (tmp_path / "pwned").exists()


def test_bad_dataset_file_stops_the_cli_before_the_model_loads(tmp_path, smollm2_path, no_model_load):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question": "What is 7 + 5?", "answer": "12"}) + "\n")
    with pytest.raises(InputError, match=r"'prompt' column.*\['question', 'answer'\]"):
        cli.run("grpo", ["--model_name_or_path", smollm2_path, "--dataset_name", str(data),
                         "--output_dir", str(tmp_path / "out"), "--use_cpu", "true"])


def test_valid_recipe_reaches_the_model_load_last(smollm2_path, tmp_path, monkeypatch):
    """All checks pass on the real quickstart inputs, and loading the model is the next step."""
    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", reached)
    with pytest.raises(Reached):
        cli.run("grpo", ["--config", str(GRPO_RECIPE), "--model_name_or_path", smollm2_path,
                         "--output_dir", str(tmp_path / "out")])


def test_model_whose_stop_tokens_cannot_be_determined_is_an_error(smollm2_path):
    from transformers import AutoTokenizer

    from grpotrl.chat.templates import stop_token_ids

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.eos_token = None
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(InputError, match="Cannot determine the stop tokens") as err:
        stop_token_ids(tok, generation_config=None)
    assert "eos_token" in str(err.value)  # says what to set
    # the template's end-of-turn alone is enough, and generation_config's ids count too
    from transformers import GenerationConfig

    assert stop_token_ids(tok, GenerationConfig(eos_token_id=[5, 7])) == [5, 7]


def test_output_dir_with_a_finished_run_or_foreign_files_is_never_overwritten_silently(tmp_path):
    """Re-running a recipe into a finished run's output_dir replaced its model and log."""
    run = tmp_path / "run"
    write_weights(run)
    (run / "trainer_state.json").write_text(json.dumps({"global_step": 25}))
    (run / "checkpoint-20").mkdir()
    with pytest.raises(InputError, match=r"a finished run of 25 steps \(trainer_state.json, model.safetensors\) "
                                         r"and checkpoints \['checkpoint-20'\].*resume_from_checkpoint.*overwrite"):
        checkpoints.check_output_dir(str(run))
    checkpoints.check_output_dir(str(run), resume=True)
    checkpoints.check_output_dir(str(run), overwrite=True)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("mine")
    with pytest.raises(InputError, match=r"files grpotrl did not write \(README.md\)"):
        checkpoints.check_output_dir(str(tmp_path / "notes"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(InputError, match=r"is a file"):
        checkpoints.check_output_dir(str(tmp_path / "afile"), overwrite=True)
    (tmp_path / "empty").mkdir()
    checkpoints.check_output_dir(str(tmp_path / "empty"))
    checkpoints.check_output_dir(str(tmp_path / "new"))
    assert (run / "model.safetensors").is_file()  # nothing was touched


@pytest.mark.parametrize("field, value", [
    ("beta", -1.0), ("num_generations", 0), ("temperature", 0.0), ("temperature", -0.5), ("learning_rate", [1]),
    ("learning_rate", float("nan")), ("max_completion_length", 0), ("max_steps", 1.5), ("epsilon", -0.2),
    ("per_device_train_batch_size", 0), ("top_p", 1.5), ("entropy_coef", float("inf")), ("top_k", 1),
    ("delta", 1.0), ("top_entropy_quantile", 1.5), ("off_policy_mask_threshold", -0.5), ("sapo_temperature_neg", 0.0),
    ("ref_model_mixup_alpha", 2.0), ("ref_model_sync_steps", 0), ("entropy_coef_delta", -0.005),
    ("generation_batch_size", 0), ("health_patience", 0), ("health_flat_reward_steps", -3),
    ("health_min_entropy", -1.0), ("health_max_one_token_share", 1.5), ("health_report_steps", -1),
    ("health_logit_steps", -1), ("dynamic_sampling_max_rounds", -1)])
def test_numeric_settings_out_of_range_are_refused_before_anything_runs(field, value, tmp_path):
    """beta -1 trained and saved; num_generations 0 was a ZeroDivisionError inside TRL; temperature 0
    and a NaN learning rate were caught only after the model loaded; top_k 1 decoded greedily,
    ref_model_mixup_alpha 2 moved the reference past the policy at each sync, and grpotrl's own counts and
    thresholds (health_patience 0, a negative health_flat_reward_steps) were taken as they were."""
    import trl

    import grpotrl

    with pytest.raises(InputError, match=rf"^{field}={re.escape(repr(value))} \(\w+\): it must be"):
        grpotrl.GRPOConfig(output_dir=str(tmp_path), **{field: value})
    ok = {"max_steps": 1, "learning_rate": 1e-6, "beta": 0.0, "num_generations": 8, "temperature": 1.0,
          "max_completion_length": 8, "epsilon": 0.2, "per_device_train_batch_size": 8, "top_p": 1.0,
          "entropy_coef": 0.0}
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **ok)
    setattr(args, field, value)  # TRL's own config, set after its checks: the trainer checks it before loading
    with pytest.raises(InputError, match=rf"^{field}="):
        checks.check_ranges(args)


def test_cli_refuses_to_overwrite_a_finished_run_before_the_model_loads(tmp_path, smollm2_path, no_model_load,
                                                                         capsys):
    """Re-running a recipe into a finished run's output_dir replaced a 25-step model and its log."""
    out = tmp_path / "run"
    weights = write_weights(out)
    (out / "trainer_state.json").write_text(json.dumps({"global_step": 25, "log_history": [{"loss": 1.0}]}))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit) as exit_:
        cli.main(["grpo", "--config", str(GRPO_RECIPE), "--model_name_or_path", smollm2_path,
                  "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("grpotrl grpo: error: output_dir")
    assert "a finished run of 25 steps" in err and "overwrite_output_dir" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and weights.is_file()


def test_temperature_zero_says_what_to_do_with_the_configs_grpotrl_has(tmp_path):
    """Temperature 0 suggested `do_sample=False`, which no config has."""
    import grpotrl

    with pytest.raises(InputError, match=r"temperature=0 \(int\): it must be a finite number > 0: .*greedy decoding "
                                         r"\(T = 0\) would give every completion of a group the same text.*such as "
                                         r"0.1") as err:
        grpotrl.GRPOConfig(output_dir=str(tmp_path), temperature=0)
    assert "do_sample" not in str(err.value)


def test_python_api_refuses_to_train_over_a_finished_run_only(tmp_path, tiny_llama, grpo_args):
    """The Python API's rule: TRL and transformers write into an existing output_dir, and TRL's own tests
    build trainers in fresh temp dirs, so only a FINISHED run (final weights + trainer_state.json at the root) is
    refused, at train() before anything is written, unless resuming or train(overwrite_output_dir=True)."""
    import grpotrl
    from conftest import arithmetic_prompts, length_reward

    out = tmp_path / "out"
    weights = write_weights(out)
    (out / "trainer_state.json").write_text(json.dumps({"global_step": 25, "log_history": [{"loss": 1.0}]}))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                  args=grpo_args(output_dir=str(out), max_steps=1, guard_steps=0))
    with pytest.raises(InputError, match=r"output_dir '\S+out' holds a finished run of 25 steps \(model.safetensors, "
                                         r"trainer_state.json\).*overwrite_output_dir"):
        trainer.train()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and weights.is_file()
    checkpoints.check_finished_run(str(tmp_path / "fresh"))  # missing, empty, checkpoints only: TRL's behaviour
    (tmp_path / "ckpts" / "checkpoint-2").mkdir(parents=True)
    checkpoints.check_finished_run(str(tmp_path / "ckpts"))
    (out / "model.safetensors").unlink()  # weights without trainer_state.json, or the reverse: not a finished run
    checkpoints.check_finished_run(str(out))
    (out / "model.safetensors").write_bytes(before["model.safetensors"])
    trainer.train(overwrite_output_dir=True)  # the user said so
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 25  # save_state not called yet
    assert trainer.state.global_step == 1


def test_an_unknown_loss_type_is_refused_before_the_model_loads(tiny_llama, grpo_args):
    with pytest.raises(InputError, match=r"loss_type='gspo': TRL 1.16 takes 'grpo', "):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(loss_type="gspo"),
                            train_dataset=arithmetic_prompts())
    args = grpo_args()
    args.loss_type = "gspo"  # set after the config checked itself: the trainer's preflight still refuses it
    with pytest.raises(InputError, match=r"loss_type='gspo' is not one of TRL 1.16's loss types: grpo, "):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args, train_dataset=arithmetic_prompts())


@pytest.mark.parametrize("setting", [{"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"min_new_tokens": 2},
                                     {"repetition_penalty": 1.3}])
def test_I6_penalties_in_the_multi_turn_loop_are_refused_for_tools_and_environments(tiny_llama, smollm2_tokenizer,
                                                                                     grpo_args, no_model_load,
                                                                                     setting):
    """The multi-turn loop calls generate once per turn: refused with ``tools``, and with an ``environment_factory``
    (whose public methods are tools too), which got past the check and trained with them. The repetition penalty,
    which grpotrl applies itself on transformers' generate (transformers' own set to 1), ran nowhere in that loop:
    silently dropped."""
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = qwen2_5_chat_template  # a template that renders tools
    args = grpo_args(per_device_train_batch_size=3, num_generations=3, **setting)
    (name, value), = setting.items()
    environment_rows = Dataset.from_list([{"start": i} for i in range(4)])  # reset() writes the prompt
    for kwargs in ({"tools": [CounterEnvironment().multiply],
                    "train_dataset": Dataset.from_list([{"prompt": USER}] * 4)},
                   {"environment_factory": CounterEnvironment, "train_dataset": environment_rows}):
        multi_turn = next(k for k in kwargs if k != "train_dataset")
        with pytest.raises(InputError, match=rf"^{name}={value} with {multi_turn}: .*not supported in the multi-turn "
                                             r"tool loop"):
            grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, processing_class=tokenizer, args=args,
                                **kwargs)


def test_I5_beam_search_from_the_models_generation_config_is_refused_where_the_sampler_logprobs_are_recorded(
        tmp_path, tiny_llama, grpo_args, monkeypatch):
    """TRL builds its GenerationConfig without num_beams, and generate fills it from the model's
    generation_config.json: a model that asks for beam search ran it beside the recorder of the sampler's
    logprobs, which failed after the first rollout ("recorded 8 rows, but generate returned 4"). Refused before
    the load, from a path and from a loaded model; generation_kwargs' num_beams=1 overrides the model's and trains."""
    import shutil

    from transformers import AutoModelForCausalLM, GenerationConfig

    model_dir = tmp_path / "beams"
    shutil.copytree(tiny_llama, model_dir)
    GenerationConfig(num_beams=2, eos_token_id=2, bos_token_id=1).save_pretrained(model_dir)
    loaded = AutoModelForCausalLM.from_pretrained(model_dir)
    bias = grpo_args().generation_kwargs
    with monkeypatch.context() as m:
        m.setattr(transformers.PreTrainedModel, "from_pretrained",
                  lambda *a, **k: pytest.fail("the model was loaded before the input was validated"))
        for model, where in ((str(model_dir), r"generation_config\.json of .*beams"),
                             (loaded, r"generation_config of the model passed")):
            with pytest.raises(InputError, match=rf"^num_beams=2 in the {where} \(.*\) with "
                                                 r"hf_importance_sampling_correction=True: .*no row has a sampler "
                                                 r"logprob of its own\. Pass generation_kwargs=\{'num_beams': 1\}"):
                grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=arithmetic_prompts(4),
                                    args=grpo_args(hf_importance_sampling_correction=True, max_steps=1))
    trainer = grpotrl.GRPOTrainer(model=str(model_dir), reward_funcs=length_reward, train_dataset=arithmetic_prompts(4),
                                  args=grpo_args(hf_importance_sampling_correction=True, max_steps=1,
                                                 per_device_train_batch_size=4, max_completion_length=6,
                                                 generation_kwargs={**bias, "num_beams": 1}))
    trainer.train()
    assert trainer.state.global_step == 1


def test_reward_weights_of_another_length_than_the_reward_functions_is_refused_before_the_model_loads(
        tiny_llama, grpo_args):
    """TRL 1.16 refuses it with a ValueError once the policy (and every reward model) has loaded; grpotrl in TRL's
    words, before anything loads (an InputError, which TRL never raises), for a list and for per-task rewards."""
    args = grpo_args(reward_weights=[1.0])
    with pytest.raises(InputError, match=r"Number of reward weights \(1\) must match number of reward functions \(2\)"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=[length_reward, length_reward], args=args,
                            train_dataset=arithmetic_prompts())
    resolve.check_reward_weights({"a": length_reward, "b": [length_reward, length_reward]}, [1.0, 1.0, 1.0])
    with pytest.raises(InputError, match=r"\(2\) must match number of reward functions \(3\)"):
        resolve.check_reward_weights({"a": length_reward, "b": [length_reward, length_reward]}, [1.0, 1.0])


def _add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def test_plain_text_prompts_with_tools_are_refused_before_the_model_loads(tiny_llama, grpo_args, no_model_load):
    """TRL 1.16 decodes a plain-text prompt's completions as strings and its tool loop reads each as chat messages
    (``completion[0].get("tool_calls")``): an AttributeError at the first step, after the model loaded. Refused
    before any weights load (``no_model_load``), for train and eval; the same rows as chat prompts get past it."""
    plain = Dataset.from_list([{"prompt": "What is 7 + 5?"}] * 4)
    with pytest.raises(InputError, match=r"'train' split has plain-text prompts .* with tools TRL reads each "
                                         r"completion as chat messages"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(), train_dataset=plain,
                            tools=[_add])
    with pytest.raises(InputError, match=r"'eval' split has plain-text prompts"):
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward,
                            args=grpo_args(eval_strategy="steps", eval_steps=1), train_dataset=arithmetic_prompts(),
                            eval_dataset=plain, tools=[_add])
    with pytest.raises(AssertionError, match="the model was loaded"):  # chat prompts pass every check
        grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=grpo_args(),
                            train_dataset=arithmetic_prompts(), tools=[_add])
