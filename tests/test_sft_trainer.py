"""I2: SFT and RL share one chat template, on the real SmolLM2 tokenizer (pad == eos)."""

import json
import os

import pytest
import torch
from conftest import arithmetic_prompts, length_reward
from datasets import Dataset

import grpotrl
from grpotrl import InvariantError, templates

PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]
ANSWER = [{"role": "assistant", "content": "5"}]


def _trl_rl_prompt_ids(tok, messages):
    """What trl.GRPOTrainer._tokenize_prompts feeds generation (same call, same arguments)."""
    return tok.apply_chat_template(conversation=[messages], tools=None, chat_template=None,
                                   add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"][0]


def test_I2_sft_sequence_starts_with_rl_prompt_ids(smollm2_tokenizer):
    ex = templates.tokenize_sft_example(smollm2_tokenizer, PROMPT, ANSWER, [2])
    rl = _trl_rl_prompt_ids(smollm2_tokenizer, PROMPT)
    assert ex["input_ids"][: len(rl)] == list(rl)
    assert ex["completion_mask"] == [0] * len(rl) + [1] * (len(ex["input_ids"]) - len(rl))


def test_I2_loss_covers_response_and_end_of_turn_only(smollm2_tokenizer):
    ex = templates.tokenize_sft_example(smollm2_tokenizer, PROMPT, ANSWER, [2])
    in_loss = [t for t, m in zip(ex["input_ids"], ex["completion_mask"]) if m]
    # "5<|im_end|>": the stop token is learned; the template's "\n" after it is not (RL never generates it)
    assert smollm2_tokenizer.decode(in_loss) == "5<|im_end|>"
    assert ex["input_ids"][-1] == 2


def test_I2_template_that_renders_prompt_differently_is_an_error(smollm2_tokenizer):
    drifting = ("{% if messages[-1]['role'] == 'assistant' %}[train]{% endif %}"
                + smollm2_tokenizer.chat_template)
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*does not start with the RL prompt ids"):
        templates.tokenize_sft_example(smollm2_tokenizer, PROMPT, ANSWER, [2], chat_template=drifting)


def _sft_rows(n=16):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "completion": [{"role": "assistant", "content": str(i + 1)}]} for i in range(n)]


def _sft_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                report_to="none", use_cpu=True, save_strategy="no", guard_steps=-1, learning_rate=1e-3)
    base.update(kw)
    return grpotrl.SFTConfig(**base)


def test_I2_sft_run_guards_labels_and_saves_fingerprint(tiny_llama, tmp_path):
    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path),
                                 train_dataset=Dataset.from_list(_sft_rows()))
    row = trainer.train_dataset[0]
    in_loss = [t for t in row["labels"] if t != -100]
    assert row["input_ids"][-1] == 2 and trainer.processing_class.decode(in_loss) == "1<|im_end|>"
    trainer.train()
    trainer.save_model()
    with open(os.path.join(tmp_path / "sft", templates.FINGERPRINT_FILE)) as f:
        saved = json.load(f)
    assert saved["sha256"] == templates.template_fingerprint(trainer.processing_class)["sha256"]


def test_I2_messages_rows_become_prompt_completion(tiny_llama, tmp_path):
    rows = [{"messages": r["prompt"] + r["completion"]} for r in _sft_rows()]
    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, max_steps=1),
                                 train_dataset=Dataset.from_list(rows))
    assert [t for t in trainer.train_dataset[0]["labels"] if t != -100] == [33, 2]  # "1<|im_end|>"
    trainer.train()


def test_I2_guard_stops_seed_bug1_plain_concatenation(tiny_llama, smollm2_tokenizer, tmp_path):
    """Seed 000 bug #1: SFT on prompt + "\\n\\n" + answer, not on the chat template."""
    rows = []
    for r in _sft_rows():
        p = smollm2_tokenizer(r["prompt"][0]["content"] + "\n\n")["input_ids"]
        a = smollm2_tokenizer(r["completion"][0]["content"])["input_ids"] + [2]
        rows.append({"input_ids": p + a, "completion_mask": [0] * len(p) + [1] * len(a)})
    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path), train_dataset=Dataset.from_list(rows))
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*not after the generation prompt"):
        trainer.train()


def test_I2_grpo_on_checkpoint_with_other_template_stops_before_loading(tiny_llama, tmp_path, grpo_args,
                                                                        monkeypatch):
    from transformers import AutoTokenizer

    sft = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, max_steps=1),
                             train_dataset=Dataset.from_list(_sft_rows()))
    sft.train()
    sft.save_model()
    ckpt = str(tmp_path / "sft")
    other = AutoTokenizer.from_pretrained(ckpt)
    other.chat_template = other.chat_template.replace("<|im_start|>assistant\n", "<|im_start|>bot\n")

    import transformers

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the template check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*another chat template"):
        grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(),
                            train_dataset=arithmetic_prompts(), processing_class=other)
    monkeypatch.undo()
    # a deliberate change is allowed with check_template=False; the same template passes by default
    grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(check_template=False),
                        train_dataset=arithmetic_prompts(), processing_class=other)
    trainer = grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(max_steps=1),
                                  train_dataset=arithmetic_prompts())
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))
