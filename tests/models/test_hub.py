"""Models by Hugging Face Hub id, as TRL takes them, resolved offline from the session's own HF cache
(tests/hub_cache.py, ``HF_HUB_OFFLINE=1``): the real loading code, nothing patched. Pre-load checks read
config, tokenizer, generation config and template fingerprint before any weights; offline and not
cached is one clear error."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from conftest import HUB_CACHE, arithmetic_prompts, length_reward, logged_max
from datasets import Dataset
from hub_cache import add_to_cache

import grpotrl
from grpotrl.models import sources as hub
from grpotrl.chat import templates
from grpotrl.errors import InputError, InvariantError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_weights_read(monkeypatch):
    """Loading weights fails the test: the checks must stop the run before."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the input was validated")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", refuse)  # every architecture class's


def test_grpo_trainer_takes_a_hub_id_like_trl(hub_tiny_llama, grpo_args):
    """TRL's first example, offline: model by Hub id, no processing_class; the tokenizer is loaded as
    TRL loads it (left padding and truncation) and the run trains with every guard on."""
    trainer = grpotrl.GRPOTrainer(model=hub_tiny_llama, reward_funcs=length_reward, args=grpo_args(max_steps=1),
                                  train_dataset=arithmetic_prompts(8))
    assert trainer.model.config._name_or_path == hub_tiny_llama
    assert trainer.processing_class.padding_side == "left" and trainer.processing_class.truncation_side == "left"
    assert trainer.stop_token_ids == [2]
    trainer.train()
    assert trainer.state.global_step == 1 and logged_max(trainer) < 1e-5


def test_sft_trainer_and_peft_take_a_hub_id(hub_tiny_llama, grpo_args, tmp_path):
    from peft import LoraConfig

    rows = [{"prompt": [{"role": "user", "content": f"{i} + 1?"}],
             "completion": [{"role": "assistant", "content": str(i + 1)}]} for i in range(4)]
    sft = grpotrl.SFTTrainer(model=hub_tiny_llama, train_dataset=Dataset.from_list(rows),
                             args=grpotrl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=1, use_cpu=True,
                                                    report_to="none", per_device_train_batch_size=4))
    sft.train()
    assert sft.state.global_step == 1
    grpo = grpotrl.GRPOTrainer(model=hub_tiny_llama, reward_funcs=length_reward, args=grpo_args(max_steps=1),
                               train_dataset=arithmetic_prompts(8), peft_config=LoraConfig(r=4, target_modules="all-linear"))
    assert hasattr(grpo.model, "peft_config")


def test_offline_and_not_cached_is_one_clear_error_before_any_weights(grpo_args, no_weights_read):
    with pytest.raises(InputError) as err:
        grpotrl.GRPOTrainer(model="Qwen/Qwen2-0.5B-Instruct", reward_funcs=length_reward, args=grpo_args(),
                            train_dataset=arithmetic_prompts(8))
    text = str(err.value)
    assert "'Qwen/Qwen2-0.5B-Instruct'" in text and HUB_CACHE in text and "HF_HUB_OFFLINE" in text


def test_cached_without_weights_is_incomplete_offline(tiny_llama, grpo_args, no_weights_read):
    add_to_cache(HUB_CACHE, "grpotrl-test/no-weights", tiny_llama, skip=("model.safetensors",))
    with pytest.raises(InputError, match=r"'grpotrl-test/no-weights' is in the local Hugging Face cache.*but not "
                                         r"completely.*no model.safetensors"):
        grpotrl.GRPOTrainer(model="grpotrl-test/no-weights", reward_funcs=length_reward, args=grpo_args(),
                            train_dataset=arithmetic_prompts(8))


def test_revision_is_honoured_by_the_template_check(tiny_llama, grpo_args, smollm2_tokenizer, no_weights_read):
    """model_init_kwargs={'revision': ...} selects the snapshot whose fingerprint I2 reads, before weights."""
    other = {**templates.template_fingerprint(smollm2_tokenizer, "{{ messages }}"), "template": "{{ messages }}"}
    add_to_cache(HUB_CACHE, "grpotrl-test/two-revisions", tiny_llama)  # main: no fingerprint, a base model
    add_to_cache(HUB_CACHE, "grpotrl-test/two-revisions", tiny_llama, revision="other-template",
                 extra={templates.FINGERPRINT_FILE: json.dumps(other)})
    assert templates.check_fingerprint("grpotrl-test/two-revisions", smollm2_tokenizer) is False
    with pytest.raises(InvariantError, match=r"\[I2\].*another chat template"):
        grpotrl.GRPOTrainer(model="grpotrl-test/two-revisions", reward_funcs=length_reward,
                            args=grpo_args(model_init_kwargs={"revision": "other-template"}),
                            train_dataset=arithmetic_prompts(8))


def test_unknown_revision_and_reward_model_are_errors_before_weights(hub_tiny_llama, grpo_args, no_weights_read):
    with pytest.raises(InputError, match=r"'grpotrl-test/tiny-llama' \(revision 'nope'\) is not in the local"):
        hub.check_model_source(hub_tiny_llama, "nope")
    with pytest.raises(InputError, match=r"Reward model 'org/missing-reward-model' is not in the local"):
        grpotrl.GRPOTrainer(model=hub_tiny_llama, reward_funcs=[length_reward, "org/missing-reward-model"],
                            args=grpo_args(), train_dataset=arithmetic_prompts(8))


def test_local_paths_are_never_taken_for_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not hub.looks_like_hub_id("./outputs/run") and not hub.looks_like_hub_id("/abs/run")
    assert hub.looks_like_hub_id("outputs/run") and hub.looks_like_hub_id("gpt2")
    (tmp_path / "outputs" / "run").mkdir(parents=True)
    assert not hub.looks_like_hub_id("outputs/run")  # it exists: a local directory
    with pytest.raises(InputError, match=r"'outputs/run' has no config.json"):
        hub.check_model_source("outputs/run")


def test_gad_discriminator_by_hub_id(hub_tiny_llama, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{i} + 1?"}], "teacher_response": str(i + 1)} for i in range(4)]
    args = grpotrl.GADConfig(output_dir=str(tmp_path / "gad"), per_device_train_batch_size=4, num_generations=2,
                             max_completion_length=4, max_steps=1, use_cpu=True, report_to="none",
                             discriminator_model_name_or_path=hub_tiny_llama)
    trainer = grpotrl.GADTrainer(model=hub_tiny_llama, args=args, train_dataset=Dataset.from_list(rows))
    assert trainer.discriminator is not None
    with pytest.raises(InputError, match=r"Discriminator model 'org/no-such-d' is not in the local"):
        grpotrl.GADTrainer(model=hub_tiny_llama, args=grpotrl.GADConfig(
            output_dir=str(tmp_path / "gad2"), use_cpu=True, discriminator_model_name_or_path="org/no-such-d"),
            train_dataset=Dataset.from_list(rows))


def test_cli_trains_a_hub_id_offline(hub_tiny_llama, tmp_path):
    """``grpotrl grpo --model_name_or_path org/name`` as a user types it, offline from the cache."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "grpotrl.cli", "grpo", "--config", str(ROOT / "recipes/smollm2/grpo_quickstart.yaml"),
         "--model_name_or_path", hub_tiny_llama, "--output_dir", str(out), "--max_steps", "1",
         "--max_completion_length", "8", "--per_device_train_batch_size", "4", "--num_generations", "4",
         "--save_strategy", "no", "--report_to", "none"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / templates.FINGERPRINT_FILE).is_file()
    missing = subprocess.run([sys.executable, "-m", "grpotrl.cli", "grpo", "--model_name_or_path", "org/not-cached",
                              "--output_dir", str(tmp_path / "o2")], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path)
    assert missing.returncode == 2 and "'org/not-cached' is not in the local Hugging Face cache" in missing.stderr


@pytest.fixture(scope="session")
def hub_tiny_reward(smollm2_tokenizer, tmp_path_factory) -> str:
    """A random 2-layer sequence classifier (one label) over the SmolLM2 tokenizer, as the Hub id
    ``grpotrl-test/tiny-reward`` in the session's HF cache: what ``reward_funcs="org/rm"`` loads."""
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, num_labels=1,
                                   pad_token_id=smollm2_tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("tiny-reward")
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    add_to_cache(HUB_CACHE, "grpotrl-test/tiny-reward", str(path))
    return "grpotrl-test/tiny-reward"


TRL_FIRST_EXAMPLE = """
import dataclasses, json, sys
from datasets import load_dataset
from my_rewards import short_answer
from grpotrl import GRPOConfig, GRPOTrainer
from grpotrl.rewards.judges import HttpJudge
from grpotrl.rewards.rubrics import HALLUCINATION

model, dataset, reward_model, judge_url, out = sys.argv[1:]
facts = dataclasses.replace(HALLUCINATION, columns={"reference": "answer"})  # the rubric reads our column
judge = HttpJudge(facts, base_url=judge_url, model="judge", max_retries=0, name="facts")
trainer = GRPOTrainer(
    model=model,
    reward_funcs=[short_answer, judge, reward_model],
    args=GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                    max_steps=1, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no"),
    train_dataset=load_dataset(dataset, split="train"),
)
trainer.train()
print(json.dumps([h for h in trainer.state.log_history if "reward" in h][0]))
"""


def test_trl_first_example_everything_by_hub_id(hub_tiny_llama, hub_tiny_reward, tmp_path):
    """TRL's first documented example as a user writes it, end to end: policy and reward model by Hub
    id, ``load_dataset("org/name", split="train")`` really downloaded (over a loopback Hub, then
    offline from the cache like a cluster without network), a reward function from the user's own
    module and an HTTP judge; one step trains and every reward is logged."""
    from judge_server import LoopbackJudge
    from hub_server import LoopbackHub
    from test_cli_inputs import _parquet

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? Answer with just the number."}],
             "answer": str(2 * i)} for i in range(8)]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": HUB_CACHE,
           "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": str(ROOT / "tests")}
    with LoopbackHub({"tester/sums": {"data/train-00000-of-00001.parquet": _parquet(rows)}}) as server:
        fetch = subprocess.run([sys.executable, "-c", "import datasets; datasets.load_dataset('tester/sums')"],
                               env={**env, "HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0",
                                    "HF_DATASETS_OFFLINE": "0"}, capture_output=True, text=True, timeout=300)
        assert fetch.returncode == 0, fetch.stderr[-3000:]
        assert any(p.endswith(".parquet") for m, p in server.requests if m == "GET")
    with LoopbackJudge(reply="VERDICT: 5") as judge:
        proc = subprocess.run([sys.executable, "-c", TRL_FIRST_EXAMPLE, hub_tiny_llama, "tester/sums",
                               hub_tiny_reward, judge.url, str(tmp_path / "out")],
                              env={**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert len(judge.chat_requests) == 4  # one step: 1 prompt x 4 generations, each judged once
    logs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0.0 <= logs["rewards/short_answer/mean"] <= 1.0
    assert logs["rewards/facts/mean"] == pytest.approx(1.0)  # VERDICT 5 on 1-5
    assert math.isfinite(logs["rewards/tiny-reward/mean"])  # the reward model scored every completion


def test_recipe_by_hub_ids_with_dotted_reward_and_http_judge_through_cli_and_accelerate(hub_tiny_llama, tmp_path):
    """The same run as a recipe: model and dataset by Hub id, a dotted reward from the user's module
    and an HTTP judge, through `grpotrl grpo` and through `accelerate launch` (offline, from the cache)."""
    import yaml
    from hub_server import LoopbackHub
    from judge_server import LoopbackJudge
    from test_cli_inputs import _parquet

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? Answer with just the number."}],
             "answer": str(2 * i)} for i in range(8)]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": HUB_CACHE, "HF_HUB_DISABLE_TELEMETRY": "1",
           "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    with LoopbackHub({"tester/sums": {"data/train-00000-of-00001.parquet": _parquet(rows)}}) as server:
        fetch = subprocess.run([sys.executable, "-c", "import datasets; datasets.load_dataset('tester/sums')"],
                               env={**env, "HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0",
                                    "HF_DATASETS_OFFLINE": "0"}, capture_output=True, text=True, timeout=300)
        assert fetch.returncode == 0, fetch.stderr[-3000:]
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with LoopbackJudge(reply="VERDICT: 5") as judge:
        for launcher in (["-m", "grpotrl.cli"],
                         ["-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
                          str(ROOT / "recipes/accelerate/single.yaml"), "-m", "grpotrl.cli"]):
            out = tmp_path / f"out-{len(launcher)}"
            recipe = tmp_path / f"recipe-{len(launcher)}.yaml"
            recipe.write_text(yaml.safe_dump({
                "model_name_or_path": hub_tiny_llama, "dataset_name": "tester/sums",
                "reward_funcs": ["my_rewards.short_answer", "facts"],
                "judges": {"facts": {"base_url": judge.url, "model": "judge", "rubric": "hallucination",
                                     "rubric_columns": {"reference": "answer"}, "max_retries": 0}},
                "output_dir": str(out), "max_steps": 1, "logging_steps": 1, "save_strategy": "no",
                "report_to": "none", "use_cpu": True, "bf16": False, "max_completion_length": 6,
                "per_device_train_batch_size": 4, "num_generations": 4, "health_report_steps": 0}))
            proc = subprocess.run([sys.executable, *launcher, "grpo", "--config", str(recipe)], env=offline,
                                  capture_output=True, text=True, timeout=900, cwd=tmp_path)
            assert proc.returncode == 0, proc.stderr[-4000:]
            logs = [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "reward" in h]
            assert logs and logs[0]["rewards/facts/mean"] == pytest.approx(1.0)
            assert 0.0 <= logs[0]["rewards/short_answer/mean"] <= 1.0
        assert len(judge.chat_requests) == 8  # 4 completions judged in each of the two runs
