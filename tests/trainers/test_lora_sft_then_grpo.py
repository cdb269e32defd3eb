"""SFT with LoRA, then GRPO (or a second SFT) from the adapter directory it saved, through Python and the CLI.

LoRA SFT saves an adapter directory (``adapter_config.json``, ``adapter_model.safetensors``, the tokenizer and
``grpotrl_template.json``), no ``config.json``: TRL's ``create_model_from_path`` cannot load it ("Unrecognized
model", peft 0.21). grpotrl loads base + adapter and trains that adapter: the base stays frozen, the adapter's
weights move, and with ``beta > 0`` TRL's copy of it (adapter ``ref``) is the KL's reference, so the step-0 KL is
0 (I10) against the SFT policy, not the bare base. What cannot work is refused before the load: a ``peft_config``
beside the adapter (Python), ``use_peft: false`` or LoRA settings other than the adapter's (CLI), and a KL in the
reward with ``beta`` 0 (its reference would be the base). On a tiny Llama over the SmolLM2 tokenizer.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import arithmetic_prompts, length_reward
from datasets import Dataset
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedModel

import grpotrl
from grpotrl import InputError, InvariantError, cli
from grpotrl.guards.precision import tolerances

FP32 = tolerances(torch.float32)
ROOT = Path(__file__).resolve().parents[2]
GRPO_RECIPE = str(ROOT / "recipes" / "smollm2" / "grpo_quickstart.yaml")
SFT_RECIPE = str(ROOT / "recipes" / "smollm2" / "sft_quickstart.yaml")
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _sft_rows(n=8):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "completion": [{"role": "assistant", "content": str(i + 1)}]} for i in range(n)]


def _sft_args(output_dir, **kw):
    settings = dict(per_device_train_batch_size=4, max_steps=2, report_to="none", use_cpu=True, save_strategy="no",
                    learning_rate=1e-2, guard_steps=-1)
    return grpotrl.SFTConfig(output_dir=str(output_dir), **{**settings, **kw})


@pytest.fixture(scope="module")
def sft_adapter(tiny_llama, tmp_path_factory) -> str:
    """The adapter directory a LoRA SFT saves (2 steps at lr 1e-2: its lora_B is no longer 0)."""
    out = tmp_path_factory.mktemp("lora-sft")
    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(out), train_dataset=Dataset.from_list(_sft_rows()),
                                 peft_config=LoraConfig(**LORA))
    trainer.train()
    trainer.save_model(str(out))
    trainer.end()
    return str(out)


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was validated")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", refuse)  # what TRL's create_model_from_path reaches


def _saved_adapter(directory) -> dict[str, torch.Tensor]:
    """The adapter's saved weights, keyed as PEFT names the parameters of adapter 'default'."""
    saved = load_file(os.path.join(directory, "adapter_model.safetensors"))
    return {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"):
            v for k, v in saved.items()}


def _weights(model, adapter: str) -> dict[str, torch.Tensor]:
    """The parameters of ``adapter`` under the names of adapter 'default', detached copies."""
    return {n.replace(f".{adapter}.", ".default."): p.detach().clone() for n, p in model.named_parameters()
            if f".{adapter}." in n}


def _assert_trains_the_adapter(model, sft_dir) -> dict[str, torch.Tensor]:
    """The loaded model is the SFT adapter on its frozen base: the trainable parameters are exactly adapter
    'default''s, which start at the saved weights (trained: lora_B not 0). Returns the base's weights."""
    assert isinstance(model, PeftModel), type(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    saved = _saved_adapter(sft_dir)
    assert trainable == set(saved), sorted(trainable ^ set(saved))[:4]
    start = _weights(model, "default")
    assert all(torch.equal(start[n], saved[n]) for n in saved)
    assert any(n.endswith("lora_B.default.weight") and start[n].abs().max() > 1e-3 for n in saved)  # SFT moved it
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def _assert_moved_only_the_adapter(model, sft_dir, base_before) -> None:
    saved = _saved_adapter(sft_dir)
    after = _weights(model, "default")
    assert any(not torch.equal(after[n], saved[n]) for n in saved), "the adapter did not move"
    assert all(torch.equal(p, base_before[n]) for n, p in model.named_parameters() if "lora_" not in n)


# ---------------------------------------------------------------------------------------------
# Python
# ---------------------------------------------------------------------------------------------

def test_I10_grpo_from_a_lora_sft_dir_trains_that_adapter_against_its_own_copy(sft_adapter, grpo_args):
    """GRPO on the SFT adapter dir trains that adapter (base frozen); the reference is TRL's copy of it (``ref``),
    the SFT policy, whose step-0 KL and logprob gap are 0 (I10), while the bare base (adapter disabled) is not."""
    trainer = grpotrl.GRPOTrainer(model=sft_adapter, reward_funcs=length_reward,
                                  args=grpo_args(max_steps=1, beta=0.04, learning_rate=1e-2),
                                  train_dataset=arithmetic_prompts(8))
    base_before = _assert_trains_the_adapter(trainer.model, sft_adapter)
    saved = _saved_adapter(sft_adapter)
    ref = _weights(trainer.model, "ref")
    assert set(ref) == set(saved) and all(torch.equal(ref[n], saved[n]) for n in saved)  # the reference: SFT's
    ids = trainer.processing_class("What is 1 + 2?", return_tensors="pt").input_ids
    with torch.no_grad():
        policy = trainer.model(input_ids=ids).logits
        with trainer.model.disable_adapter():
            bare = trainer.model(input_ids=ids).logits
    assert (policy - bare).abs().max() > 1e-3  # the SFT adapter changes the model: a base reference would not be 0
    trainer.train()
    step0 = trainer.state.log_history[0]
    assert step0["kl"] == 0.0, step0
    assert step0["identity/step0_ref_logp_gap/max"] <= FP32.identity_max, step0
    _assert_moved_only_the_adapter(trainer.model, sft_adapter, base_before)
    assert all(torch.equal(v, saved[n]) for n, v in _weights(trainer.model, "ref").items())  # the reference stays


def test_a_second_sft_from_a_lora_sft_dir_continues_that_adapter(sft_adapter, tmp_path):
    trainer = grpotrl.SFTTrainer(model=sft_adapter, args=_sft_args(tmp_path / "again", max_steps=1),
                                 train_dataset=Dataset.from_list(_sft_rows()))
    base_before = _assert_trains_the_adapter(trainer.model, sft_adapter)
    trainer.train()
    _assert_moved_only_the_adapter(trainer.model, sft_adapter, base_before)


def test_I2_the_fingerprint_in_the_adapter_dir_is_still_checked(sft_adapter, grpo_args, no_model_load):
    """Control (the preflight read the adapter dir's fingerprint before too): another template stops (I2)."""
    tok = AutoTokenizer.from_pretrained(sft_adapter, padding_side="left")
    tok.chat_template = ("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
                         "{% if add_generation_prompt %}A:{% endif %}")
    with pytest.raises(InvariantError, match=r"\[I2\]"):
        grpotrl.GRPOTrainer(model=sft_adapter, reward_funcs=length_reward, args=grpo_args(max_steps=1),
                            train_dataset=arithmetic_prompts(8), processing_class=tok)


def test_a_peft_config_beside_an_adapter_dir_is_refused_before_the_load(sft_adapter, grpo_args, no_model_load):
    """TRL refuses a PEFT model with a peft_config after the load; grpotrl says what each choice trains."""
    with pytest.raises(InputError, match=r"is a PEFT adapter, which grpotrl loads onto its base model and continues "
                                         r"training .* Drop peft_config.*merge_and_unload\(\)"):
        grpotrl.GRPOTrainer(model=sft_adapter, reward_funcs=length_reward, args=grpo_args(max_steps=1),
                            train_dataset=arithmetic_prompts(8), peft_config=LoraConfig(**LORA))


def test_a_kl_in_the_reward_with_beta_0_on_an_adapter_dir_is_refused(sft_adapter, grpo_args, no_model_load):
    """With beta 0 TRL makes no ``ref`` copy: the disabled adapter, the bare base, would be the KL's reference."""
    args = grpo_args(max_steps=1, beta=0.0, use_kl_in_reward=True, kl_in_reward_coef=0.01)
    with pytest.raises(InputError, match=r"use_kl_in_reward with beta=0.0 on the PEFT adapter .* the reference would "
                                         r"be the base model .* Set beta: 0.01 \(with use_kl_loss: false"):
        grpotrl.GRPOTrainer(model=sft_adapter, reward_funcs=length_reward, args=args,
                            train_dataset=arithmetic_prompts(8))


def test_a_resume_of_a_run_from_an_adapter_dir_is_checked_against_that_adapter(sft_adapter, grpo_args, monkeypatch):
    """The run trains a LoRA adapter, so its LoRA checkpoints resume; one of another rank than the adapter's is
    refused before the load, named by the adapter's own settings."""
    first = grpotrl.GRPOTrainer(model=sft_adapter, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                                args=grpo_args(max_steps=1, save_strategy="steps", save_steps=1))
    first.train()
    first.end()
    checkpoint = Path(first.args.output_dir) / "checkpoint-1"
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    (checkpoint / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(InputError, match=r"holds adapters of another shape than this run makes: lora r is 8 in .* "
                                         r"but 4 in this run's settings"):
        grpotrl.GRPOTrainer(model=sft_adapter, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
                            args=grpo_args(max_steps=2, resume_from_checkpoint=str(checkpoint)))


# ---------------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------------

def _cli(command: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "grpotrl.cli", command, *args], env=env, capture_output=True,
                          text=True, timeout=600)


def test_I10_cli_lora_sft_then_grpo_on_its_output_dir(tiny_llama, tmp_path):
    """``grpotrl sft --use_peft true`` then ``grpotrl grpo --use_peft true`` on its output: the GRPO run saves an
    adapter (no full weights: the base was frozen) whose weights moved, its step-0 KL is 0 (I10), and the
    reference it saved (``ref``) is the SFT adapter."""
    sft_dir, grpo_dir = tmp_path / "sft", tmp_path / "grpo"
    lora = ["--use_peft", "true", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj"]
    run = _cli("sft", "--config", SFT_RECIPE, "--model_name_or_path", tiny_llama, *lora, "--max_steps", "2",
               "--learning_rate", "1e-2", "--output_dir", str(sft_dir))
    assert run.returncode == 0, run.stderr[-3000:]
    assert {"adapter_config.json", "adapter_model.safetensors", "grpotrl_template.json"} <= set(os.listdir(sft_dir))
    run = _cli("grpo", "--config", GRPO_RECIPE, "--model_name_or_path", str(sft_dir), "--use_peft", "true",
               "--reward_funcs", "conftest.length_reward", "--beta", "0.04", "--learning_rate", "1e-2",
               "--max_steps", "1", "--guard_steps", "-1", "--output_dir", str(grpo_dir))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "`model_init_kwargs` will be ignored" not in run.stderr  # TRL's warning: grpotrl loaded the base with them
    names = set(os.listdir(grpo_dir))
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names, names
    step0 = json.loads((grpo_dir / "trainer_state.json").read_text())["log_history"][0]
    assert step0["kl"] == 0.0 and step0["identity/step0_ref_logp_gap/max"] <= FP32.identity_max, step0
    sft, grpo = load_file(sft_dir / "adapter_model.safetensors"), load_file(grpo_dir / "adapter_model.safetensors")
    assert set(grpo) == set(sft) and any(not torch.equal(grpo[k], sft[k]) for k in sft)
    ref = load_file(grpo_dir / "ref" / "adapter_model.safetensors")
    assert set(ref) == set(sft) and all(torch.equal(ref[k], sft[k]) for k in sft)


def test_cli_use_peft_false_on_an_adapter_dir_is_refused_before_the_load(sft_adapter, tmp_path, no_model_load):
    with pytest.raises(InputError, match=r"is a PEFT adapter and this run has use_peft: false.* Set `use_peft: true` "
                                         r"to continue training this adapter.*merge_and_unload\(\)"):
        cli.run("grpo", ["--config", GRPO_RECIPE, "--model_name_or_path", sft_adapter, "--output_dir", str(tmp_path)])


def test_cli_lora_settings_other_than_the_adapters_are_refused_before_the_load(sft_adapter, tmp_path, no_model_load):
    """Settings the recipe leaves at their defaults take the adapter's; one it sets must be the adapter's own."""
    with pytest.raises(InputError, match=r"the recipe sets other ones: lora_r: 8 \(the adapter's r is 4\); "
                                         r"lora_target_modules: \['q_proj'\] \(the adapter's target_modules is "):
        cli.run("grpo", ["--config", GRPO_RECIPE, "--model_name_or_path", sft_adapter, "--use_peft", "true",
                         "--lora_r", "8", "--lora_alpha", "8", "--lora_target_modules", "q_proj",
                         "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gpt2"])
def test_the_recipe_that_trained_an_all_linear_adapter_passes_on_it_and_another_target_is_refused(arch, request,
                                                                                                   tmp_path):
    """PEFT saves ``all-linear`` as the module names it expanded to (GPT-2's ``Conv1D`` layers included, the
    output layer left out): the recipe that trained the adapter (``all-linear``, ``lora_dropout`` its default) is
    compared with those names and passes; a one-name list is one name; another target set is refused. With
    ``disable_dropout`` (GRPO's default) a ``lora_dropout`` other than the adapter's is moot, else refused."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import ModelConfig

    from grpotrl.models.sources import adapter_config
    from grpotrl.preflight.model import check_adapter_settings

    base = request.getfixturevalue(arch)
    adapter_dir = str(tmp_path / "adapter")
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules="all-linear")) \
        .save_pretrained(adapter_dir)
    saved = adapter_config(adapter_dir)
    assert isinstance(saved["target_modules"], list) and len(saved["target_modules"]) >= 2  # expanded by PEFT

    def recipe(**kw):
        return ModelConfig(model_name_or_path=adapter_dir, use_peft=True, lora_r=4, **kw)

    check_adapter_settings(recipe(lora_target_modules=["all-linear"]), adapter_dir, saved)
    check_adapter_settings(recipe(lora_target_modules=list(reversed(saved["target_modules"]))), adapter_dir, saved)
    with pytest.raises(InputError, match=r"lora_target_modules: '(c_fc|q_proj)' \(the adapter's target_modules is "
                                         r"\['(c_attn', 'c_fc', 'c_proj|down_proj', 'gate_proj', 'k_proj', 'o_proj', "
                                         r"'q_proj', 'up_proj', 'v_proj)'\]\)"):
        check_adapter_settings(recipe(lora_target_modules=["c_fc" if arch == "tiny_gpt2" else "q_proj"]),
                               adapter_dir, saved)
    check_adapter_settings(recipe(lora_dropout=0.1), adapter_dir, saved, dropout_disabled=True)
    with pytest.raises(InputError, match=r"lora_dropout: 0.1 \(the adapter's lora_dropout is 0.0\)"):
        check_adapter_settings(recipe(lora_dropout=0.1), adapter_dir, saved)
