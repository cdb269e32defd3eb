"""I2 along chains of runs from grpotrl checkpoints. A second SFT renders its rows whole; where the checkpoint was
trained on another rendering (TRL's training template under assistant_only_loss on one side only), a row that
renders otherwise under the two stops before the model loads. GRPO with tools on a template that is not
prefix-preserving records TRL's variant as the template it trained on, beside the tokenizer's own: its resume builds,
and SFT after it compares renderings instead of refusing the checkpoint's own tokenizer. An
environment_factory that is not a class with a recorded variant: one warning for its one cause."""

import json
import logging
import os

import pytest
import torch
import transformers
from conftest import CounterEnvironment, length_reward
from datasets import Dataset
from test_fingerprint import MULTI_TURN, _messages_sft, add
from transformers import AutoTokenizer

import grpotrl
from grpotrl import InvariantError
from grpotrl.chat import templates


def _messages(multi_turn: bool, n: int = 4) -> Dataset:
    """``messages`` rows; multi-turn ones hold an earlier assistant turn that reasons (Qwen3's template drops that
    reasoning, TRL's training variant keeps it), single-turn ones render alike under both."""
    rows = []
    for i in range(n):
        earlier = [{"role": "user", "content": f"What is {i} + 1?"},
                   {"role": "assistant", "content": f"<think>\nadd one\n</think>\n\n{i + 1}"}] if multi_turn else []
        rows.append({"messages": earlier + [{"role": "user", "content": "And doubled?"},
                                            {"role": "assistant", "content": str(2 * i + 2)}]})
    return Dataset.from_list(rows)


def _sft(model, out, rows, **kw) -> grpotrl.SFTTrainer:
    args = grpotrl.SFTConfig(output_dir=str(out), max_steps=1, per_device_train_batch_size=4, report_to="none",
                             use_cpu=True, save_strategy="no", bf16=False, **kw)
    return grpotrl.SFTTrainer(model=model, args=args, train_dataset=rows)


def _no_load(monkeypatch, what: str):
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained",
                        lambda *a, **k: pytest.fail(f"the model was loaded before {what}"))


def test_I2_second_sft_without_assistant_only_loss_on_rows_the_checkpoint_saw_otherwise_stops_before_loading(
        tiny_llama, tmp_path, monkeypatch):
    """Stage 1 (a real grpotrl SFT, assistant_only_loss on Qwen3's template) trained on TRL's training variant, which
    keeps an earlier assistant turn's reasoning; stage 2 on the checkpoint's tokenizer without assistant_only_loss
    renders the same multi-turn rows with the original, which drops it: I2 stops before the model loads, showing
    both renderings and the fix. Controls: the fix (assistant_only_loss, TRL renders with the same variant), rows that
    render alike (single-turn), and check_template=False build."""
    ckpt = _messages_sft(tiny_llama, tmp_path, "aol", assistant_only_loss=True)
    assert "trained_template" in json.load(open(os.path.join(ckpt, templates.FINGERPRINT_FILE)))
    with monkeypatch.context() as m:
        _no_load(m, "the rows' rendering was compared")
        with pytest.raises(InvariantError, match=r"(?s)\[I2\].*rendered the rows .* with TRL's training template.*"
                                                 r"row 0 renders otherwise.*checkpoint's template: .*add one.*"
                                                 r"this run's template: (?:(?!add one).)*\n.*assistant_only_loss=True"):
            _sft(ckpt, tmp_path / "2", _messages(multi_turn=True))
        prompt_completion = Dataset.from_list([{"prompt": MULTI_TURN, "completion": [
            {"role": "assistant", "content": "8"}]}])  # I2 rows: rendered whole too
        with pytest.raises(InvariantError, match=r"(?s)\[I2\].*row 0 renders otherwise.*add them"):
            _sft(ckpt, tmp_path / "2", prompt_completion)
    _sft(ckpt, tmp_path / "3", _messages(multi_turn=True), assistant_only_loss=True)
    _sft(ckpt, tmp_path / "4", _messages(multi_turn=False))
    _sft(ckpt, tmp_path / "5", _messages(multi_turn=True), check_template=False)


def test_I2_second_sft_with_assistant_only_loss_after_one_on_the_original_template_stops_before_loading(
        tiny_llama, tmp_path, monkeypatch):
    """The reverse: stage 1 without assistant_only_loss trained on Qwen3's own template; stage 2 with it renders its
    rows with TRL's training variant (the tokenizer has no `{% generation %}` markers). A multi-turn row rendered
    otherwise stops before the load; single-turn rows, and stage 2 without assistant_only_loss, build."""
    ckpt = _messages_sft(tiny_llama, tmp_path, "plain", assistant_only_loss=False)
    with monkeypatch.context() as m:
        _no_load(m, "the rows' rendering was compared")
        with pytest.raises(InvariantError, match=r"(?s)\[I2\].*This run renders its rows with TRL's training template.*"
                                                 r"row 0 renders otherwise.*checkpoint's template: (?:(?!add one).)*\n"
                                                 r"  this run's template: .*add one.*drop assistant_only_loss"):
            _sft(ckpt, tmp_path / "2", _messages(multi_turn=True), assistant_only_loss=True)
    _sft(ckpt, tmp_path / "3", _messages(multi_turn=False), assistant_only_loss=True)
    _sft(ckpt, tmp_path / "4", _messages(multi_turn=True))


def _grpo_args(out, **kw):
    return grpotrl.GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=4,
                              max_completion_length=4, max_steps=1, report_to="none", use_cpu=True, **kw)


def _prompts(multi_turn: bool) -> Dataset:
    return Dataset.from_list([{"prompt": MULTI_TURN if multi_turn else [{"role": "user", "content": "What is 1 + 1?"}]}
                              for _ in range(4)])


def _as_resumable(directory: str) -> None:
    """What the Trainer writes into a checkpoint beside the weights (empty state), so that a resume's preflight
    takes the directory as complete."""
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({}, os.path.join(directory, name))
    with open(os.path.join(directory, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 1, "log_history": []}, f)


def test_I2_grpo_with_tools_records_trls_variant_and_resume_grpo_and_sft_after_it_compare_renderings(
        tiny_llama, tmp_path, monkeypatch):
    """trl.GRPOTrainer with tools renders Qwen3 prompts with its prefix-preserving training variant; the tokenizer it
    saves keeps the original. The fingerprint records the original as the template and the variant as
    ``trained_template``, so: resuming the run (the checkpoint's own tokenizer, the same tools) builds; GRPO without
    the tools stops before the load naming them (not "another chat template", the checkpoint's own); SFT after it
    builds on single-turn rows and with assistant_only_loss (the same variant), and stops before the load on
    multi-turn rows rendered with the original."""
    from trl.chat_template_utils import get_training_chat_template, qwen3_chat_template

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = qwen3_chat_template
    grpo = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=_grpo_args(tmp_path / "grpo"),
                               train_dataset=_prompts(False), processing_class=tok, tools=[add])
    grpo.save_model()
    ckpt = str(tmp_path / "grpo")
    saved = json.load(open(os.path.join(ckpt, templates.FINGERPRINT_FILE)))
    assert saved["template"] == AutoTokenizer.from_pretrained(ckpt).chat_template == qwen3_chat_template
    assert saved["trained_template"] == get_training_chat_template(tok)
    _as_resumable(ckpt)
    grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, train_dataset=_prompts(False), tools=[add],
                        args=_grpo_args(tmp_path / "resumed", resume_from_checkpoint=ckpt))
    with monkeypatch.context() as m:
        _no_load(m, "the template was compared")
        with pytest.raises(InvariantError, match=r"(?s)\[I2\].*rendered with tools \[add\]; this run renders them "
                                                 r"with no tools"):  # the cause, not "another chat template"
            grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, train_dataset=_prompts(False),
                                args=_grpo_args(tmp_path / "grpo2"))
        with pytest.raises(InvariantError, match=r"(?s)\[I2\].*rendered the rows .* with TRL's training template.*"
                                                 r"row 0 renders otherwise.*add one"):
            _sft(ckpt, tmp_path / "sft", _messages(multi_turn=True))
    _sft(ckpt, tmp_path / "sft2", _messages(multi_turn=False))
    _sft(ckpt, tmp_path / "sft3", _messages(multi_turn=True), assistant_only_loss=True)


def test_I2_an_environment_factory_that_is_not_a_class_warns_once_for_its_unknown_tools(tiny_llama, tmp_path, caplog):
    """GRPO from a checkpoint trained on TRL's training variant (SFT under assistant_only_loss) with a factory
    function: its tools are known only once TRL calls it, so neither they nor the prompts' rendering are compared,
    one warning naming both. A checkpoint without a variant: the same warning, without the rendering part."""
    variant = _messages_sft(tiny_llama, tmp_path, "aol", assistant_only_loss=True)
    plain = _messages_sft(tiny_llama, tmp_path, "plain", assistant_only_loss=False)
    for ckpt, renders in ((variant, True), (plain, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, train_dataset=_prompts(True),
                                args=_grpo_args(tmp_path / "grpo"), environment_factory=lambda: CounterEnvironment())
        said = [r.getMessage() for r in caplog.records if r.name.startswith("grpotrl") and "I2" in r.getMessage()]
        assert len(said) == 1, said
        assert "environment_factory is not a class" in said[0]
        assert ("does not compare how the two render them" in said[0]) == renders
