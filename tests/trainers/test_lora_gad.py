"""GAD from a LoRA SFT's adapter directory, through Python and the CLI: the student trains that adapter (as GRPO
does, tests/trainers/test_lora_sft_then_grpo.py), and the discriminator D, which starts from the student's
checkpoint, starts from the policy that adapter is: its base with the adapter merged, under D's new score head,
every weight trainable. What D cannot start from is refused before any weights load: a prompt-learning adapter
(nothing to merge) and a DeepSpeed ZeRO-3 run (D's weights load partitioned; PeftModel merges whole weights).
On a tiny Llama over the SmolLM2 tokenizer, fp32: the merge is the same arithmetic as PEFT's own on the causal
LM, so D's backbone equals it bit for bit.
"""

from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import PeftModel, PromptTuningConfig, get_peft_model
from safetensors.torch import load_file
from test_gad import gad_args, toy_rows  # noqa: F401 (gad_args: a fixture)
from test_lora_sft_then_grpo import _cli, no_model_load, sft_adapter  # noqa: F401 (fixtures)
from transformers import AutoModelForCausalLM, PreTrainedModel

import grpotrl
from grpotrl import InputError

ROOT = Path(__file__).resolve().parents[2]
GAD_RECIPE = str(ROOT / "recipes" / "smollm2" / "gad_quickstart.yaml")


def _merged_backbone(tiny_llama, sft_dir) -> dict[str, torch.Tensor]:
    """The SFT policy's backbone, merged independently: PEFT's own merge on the causal LM (fp32)."""
    causal = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), sft_dir).merge_and_unload()
    return {k: v.detach().clone() for k, v in causal.model.state_dict().items()}


def _base_backbone(tiny_llama) -> dict[str, torch.Tensor]:
    return dict(AutoModelForCausalLM.from_pretrained(tiny_llama).model.state_dict())


def test_gad_from_a_lora_sft_dir_starts_the_discriminator_from_the_sft_policy(tiny_llama, sft_adapter, gad_args):
    """D's backbone is base + the SFT adapter merged (not the bare base, as D's load by the base model's name gave),
    every D weight trainable; the student trains that adapter; a GAD step runs and D's loss is finite."""
    trainer = grpotrl.GADTrainer(model=sft_adapter, args=gad_args(max_steps=1),
                                 train_dataset=Dataset.from_list(toy_rows(8)))
    assert isinstance(trainer.model, PeftModel)
    d = trainer.discriminator.hf_model
    merged, base = _merged_backbone(tiny_llama, sft_adapter), _base_backbone(tiny_llama)
    state = d.model.state_dict()
    assert set(state) == set(merged)
    assert all(torch.equal(state[k], merged[k]) for k in merged), [k for k in merged if not torch.equal(state[k],
                                                                                                       merged[k])]
    moved = [k for k in merged if not torch.equal(merged[k], base[k])]  # the adapter's q_proj, v_proj
    assert moved and all("q_proj" in k or "v_proj" in k for k in moved), moved
    assert not any("lora_" in n for n, _ in d.named_parameters())  # merged, not an adapter on D
    assert all(p.requires_grad for p in d.parameters())  # D trains fully (discriminator_lora_r 0)
    trainer.train()
    assert 0 < trainer.state.log_history[0]["gad/d_loss"] < 5


def test_cli_gad_on_a_lora_sft_dir_starts_the_discriminator_from_the_sft_policy(tiny_llama, sft_adapter, tmp_path):
    """``grpotrl gad --model_name_or_path <adapter dir> --use_peft true``: the run saves an adapter (the student)
    and D's full weights, whose adapted projections are one AdamW step (lr 1e-5: at most lr plus its weight
    decay per weight) from the merged SFT policy, and far from the bare base (D's start by the base's name)."""
    out = tmp_path / "gad"
    lr = 1e-5
    run = _cli("gad", "--config", GAD_RECIPE, "--model_name_or_path", sft_adapter, "--use_peft", "true",
               "--max_steps", "1", "--discriminator_warmup_steps", "0", "--max_completion_length", "8",
               "--discriminator_learning_rate", str(lr), "--guard_steps", "-1", "--output_dir", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    saved = load_file(out / "discriminator" / "model.safetensors")  # Discriminator.model: the SeqCls model
    merged, base = _merged_backbone(tiny_llama, sft_adapter), _base_backbone(tiny_llama)
    adapted = [k for k in merged if "q_proj" in k or "v_proj" in k]
    step = max((saved[f"model.model.{k}"] - merged[k]).abs().max().item() for k in adapted)
    start_gap = min((merged[k] - base[k]).abs().max().item() for k in adapted)
    assert step <= 2 * lr < 1e-3 < start_gap, (step, start_gap)


def test_a_prompt_learning_adapter_is_refused_for_the_discriminator_before_the_load(tiny_llama, gad_args, tmp_path,
                                                                                     monkeypatch):
    """A prompt-tuning adapter holds virtual tokens, no weights to merge into D's backbone."""
    adapter = tmp_path / "prompt-tuning"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    get_peft_model(model, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)).save_pretrained(adapter)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(InputError, match=r"a PEFT adapter \(PROMPT_TUNING\) that it would load merged into its base "
                                         r"model, and it is a prompt-learning adapter.*merge_and_unload\(\)"):
        grpotrl.GADTrainer(model=str(adapter), args=gad_args(), train_dataset=Dataset.from_list(toy_rows(8)))


def test_a_zero3_discriminator_from_an_adapter_dir_is_refused_before_the_load(sft_adapter, gad_args, no_model_load):
    """Under ZeRO-3 (transformers' DeepSpeed config live: from_pretrained would load D partitioned) D cannot be the
    merged adapter; setting discriminator_model_name_or_path is the way out."""
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    args = gad_args()
    ds = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        with pytest.raises(InputError, match=r"this run is under DeepSpeed ZeRO-3, where the discriminator's weights "
                                             r"load partitioned.*set discriminator_model_name_or_path: MERGED"):
            grpotrl.GADTrainer(model=sft_adapter, args=args, train_dataset=Dataset.from_list(toy_rows(8)))
    finally:
        del ds
    assert not is_deepspeed_zero3_enabled()
