"""grpotrl's configs as a drop-in for TRL's: ``import grpotrl`` and a default config print nothing;
grpotrl's trainers accept ``trl.GRPOConfig`` and a user's subclass of it (open-r1's, a TrlParser
script's), keeping the user's object and its fields; TRL's values stay as TRL computes them."""

import dataclasses
import os
import subprocess
import sys

import pytest
import trl
from conftest import arithmetic_prompts, length_reward

import grpotrl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(grpotrl.__file__)))


def _python(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_import_and_default_configs_print_nothing(tmp_path):
    """Issue 14 item 6: no bitsandbytes kernel message, no gradient_checkpointing FutureWarning."""
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


def test_multitask_trainer_takes_a_trl_config(tiny_llama, tmp_path):
    from datasets import Dataset

    rows = [{"prompt": [{"role": "user", "content": f"Question {i}?"}], "task": "ab"[i % 2]} for i in range(8)]
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                          report_to="none")
    trainer = grpotrl.MultiTaskGRPOTrainer(model=tiny_llama, reward_funcs={"a": length_reward, "b": length_reward},
                                           args=args, train_dataset=Dataset.from_list(rows))
    assert trainer.args is args and args.cagrad == "off" and trainer.task_names == ["a", "b"]
