"""Real model, real tokenizer (pad == eos == <|im_end|>): a short SFT then GRPO on
SmolLM2-135M-Instruct with every guard on every step; weights change and the checkpoint
reloads into a trainer that passes the template check. About 23 s on 2 CPU cores: in the default run."""

import os

from conftest import logged_max
import torch
from transformers import AutoModelForCausalLM

import grpotrl
from grpotrl.data import load_quickstart
from grpotrl.rewards.rules import exact_answer_reward


def brevity(completions, **kwargs):
    """Varies within every group, so GRPO's advantages are not all zero and the weights move."""
    return [-len(c[0]["content"]) / 10 for c in completions]


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_smollm2_sft_then_grpo_guarded_and_reloadable(smollm2_path, tmp_path):
    train = load_quickstart("train").select(range(16))

    sft_dir = str(tmp_path / "sft")
    sft = grpotrl.SFTTrainer(
        model=smollm2_path, train_dataset=train.select_columns(["prompt", "completion"]),
        args=grpotrl.SFTConfig(output_dir=sft_dir, per_device_train_batch_size=4, max_steps=1, learning_rate=2e-5,
                               logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", guard_steps=-1),
    )
    before = _weights(sft.model)
    sft.train()
    sft.save_model()
    assert any(not torch.equal(p, before[n]) for n, p in sft.model.named_parameters())
    assert os.path.isfile(os.path.join(sft_dir, "grpotrl_template.json"))

    grpo_dir = str(tmp_path / "grpo")
    grpo = grpotrl.GRPOTrainer(
        model=sft_dir, reward_funcs=[exact_answer_reward, brevity], train_dataset=train,
        args=grpotrl.GRPOConfig(output_dir=grpo_dir, per_device_train_batch_size=4, num_generations=2,
                                max_completion_length=16, max_steps=2, learning_rate=1e-5, logging_steps=1,
                                report_to="none", use_cpu=True, save_strategy="no", guard_steps=-1, seed=0),
    )
    before = _weights(grpo.model)
    grpo.train()
    grpo.save_model()
    assert any(not torch.equal(p, before[n]) for n, p in grpo.model.named_parameters())
    assert logged_max(grpo) < 1e-5  # I5 on the real model, fp32
    logged = [h for h in grpo.state.log_history if "reward" in h]
    assert len(logged) == 2 and all(0.0 <= h["rewards/exact_answer_reward/mean"] <= 1.0 for h in logged)

    reloaded = AutoModelForCausalLM.from_pretrained(grpo_dir)
    for n, p in reloaded.named_parameters():
        assert torch.equal(p, dict(grpo.model.named_parameters())[n].detach()), n
    # the saved checkpoint carries its template: RL on it passes the I2 fingerprint check
    grpotrl.GRPOTrainer(model=grpo_dir, reward_funcs=exact_answer_reward, train_dataset=train,
                        args=grpotrl.GRPOConfig(output_dir=str(tmp_path / "again"), report_to="none",
                                                use_cpu=True, num_generations=4, per_device_train_batch_size=8))
