"""grpotrl.SFTTrainer as a drop-in trl.SFTTrainer, and I2 where it applies, on tiny models over the
real SmolLM2 tokenizer (pad == eos == <|im_end|>, id 2).

Every input type trl.SFTTrainer takes is built side by side with trl.SFTTrainer on the same data and
settings: the same input ids and labels, then one training step with the guards on every step. The
one deliberate difference, on conversational prompt-completion rows (I2): the sequence ends at the
end-of-turn token (TRL also trains on the template's newline after it), and a prompt the template
renders differently in the full conversation is an error (TRL warns)."""

import json
import logging
import os

import pytest
import torch
import trl
from conftest import CounterEnvironment, arithmetic_prompts, length_reward
from datasets import Dataset

import grpotrl
from grpotrl import InvariantError
from grpotrl.chat import templates
from grpotrl.trainers.sft import check_sft_labels

PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]
ANSWER = [{"role": "assistant", "content": "5"}]
NL = 198  # "\n", what ChatML writes after <|im_end|>

# ChatML like SmolLM2's, plus tools, tool calls, `{% generation %}` markers (assistant_only_loss) and a
# Qwen3-like `enable_thinking` kwarg that changes the generation prompt
TOY_TEMPLATE = (
    "{%- if tools -%}{{ '<|im_start|>system\nTools: ' + (tools | map(attribute='function.name') | join(', ')) "
    "+ '<|im_end|>\n' }}{%- endif -%}"
    "{%- set think = '<think>\n\n</think>\n\n' if (enable_thinking is defined and not enable_thinking) else '' -%}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{ '<|im_start|>assistant\n' + think }}"
    "{% generation %}{{ m.content or '' }}{%- for c in m.tool_calls or [] -%}"
    "{{ '<tool_call>' + c.function.name + '</tool_call>' }}{%- endfor -%}{{ '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}{%- else -%}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' + think }}{%- endif -%}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def _trl_rl_prompt_ids(tok, messages, **kwargs):
    """What trl.GRPOTrainer._tokenize_prompts feeds generation (same call, same arguments)."""
    return tok.apply_chat_template(conversation=[messages], tools=None, chat_template=None,
                                   add_generation_prompt=True, tokenize=True, return_dict=True,
                                   **kwargs)["input_ids"][0]


def _sft_rows(n=8):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "completion": [{"role": "assistant", "content": str(i + 1)}]} for i in range(n)]


def _settings(**kw):
    base = dict(per_device_train_batch_size=4, max_steps=1, logging_steps=1, report_to="none", use_cpu=True,
                save_strategy="no", bf16=False, learning_rate=1e-3)
    base.update(kw)
    return base


def _sft_args(tmp_path, **kw):
    return grpotrl.SFTConfig(output_dir=str(tmp_path / "sft"), guard_steps=-1, **_settings(**{"max_steps": 2, **kw}))


def _side_by_side(model, rows, tmp_path, dataset=Dataset.from_list, tokenizer=None, trainer_kwargs=None, **cfg):
    """trl.SFTTrainer and grpotrl.SFTTrainer on the same data and settings (guards on every step)."""
    from transformers import AutoTokenizer

    built = []
    for name, trainer_cls, config_cls, extra in [("trl", trl.SFTTrainer, trl.SFTConfig, {}),
                                                 ("ours", grpotrl.SFTTrainer, grpotrl.SFTConfig, {"guard_steps": -1})]:
        tok = AutoTokenizer.from_pretrained(model)
        if tokenizer is not None:
            tok.chat_template = tokenizer
        args = config_cls(output_dir=str(tmp_path / name), **_settings(**cfg), **extra)
        built.append(trainer_cls(model=model, args=args, train_dataset=dataset(rows), processing_class=tok,
                                 **(trainer_kwargs or {})))
    return built


def _rows_of(trainer, n=4):
    ds = trainer.train_dataset
    rows = [r for _, r in zip(range(n), iter(ds))]
    return [(r["input_ids"], r["labels"]) for r in rows]


def _loss_text(tok, row):
    return tok.decode([t for t in row["labels"] if t != -100])


# ---------------------------------------------------------------------------------------------
# I2 tokenization (pure)
# ---------------------------------------------------------------------------------------------

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


def test_I2_tokens_merged_across_the_boundary_start_from_the_rl_prompt_ids(smollm2_tokenizer):
    """The generation prompt ends with a space the response's first token absorbs (" five"): same
    text, other ids. TRL trains on the merged ids; grpotrl on RL's prompt ids, then the response's own."""
    answer = [{"role": "assistant", "content": "five"}]
    spaced = smollm2_tokenizer.chat_template.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant: '")
    spaced = spaced.replace("'<|im_start|>' + message['role'] + '\n'",
                            "'<|im_start|>' + message['role'] + (': ' if message['role'] == 'assistant' else '\n')")
    full = smollm2_tokenizer.apply_chat_template(PROMPT + answer, chat_template=spaced, tokenize=True,
                                                 return_dict=True)["input_ids"]
    rl = smollm2_tokenizer.apply_chat_template(PROMPT, chat_template=spaced, add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]
    assert list(full[: len(rl)]) != list(rl)  # the merge this test is about
    ex = templates.tokenize_sft_example(smollm2_tokenizer, PROMPT, answer, [2], chat_template=spaced)
    assert ex["input_ids"][: len(rl)] == list(rl)
    assert smollm2_tokenizer.decode(ex["input_ids"][len(rl):]) == "five<|im_end|>"


# ---------------------------------------------------------------------------------------------
# Every input trl.SFTTrainer takes, side by side with it
# ---------------------------------------------------------------------------------------------

def test_I2_chat_prompt_completion_is_trls_tokenization_minus_the_template_trailer(tiny_llama, tmp_path):
    theirs, ours = _side_by_side(tiny_llama, _sft_rows(), tmp_path)
    for (t_ids, t_labels), (o_ids, o_labels) in zip(_rows_of(theirs), _rows_of(ours)):
        assert t_ids == o_ids + [NL] and t_labels == o_labels + [NL]  # TRL also trains on "\n" after <|im_end|>
    row = ours.train_dataset[0]
    assert row["input_ids"][-1] == 2 and _loss_text(ours.processing_class, row) == "1<|im_end|>"
    ours.train()


def _text_rows():
    return [{"text": f"The number after {i} is {i + 1}."} for i in range(8)]


def _plain_prompt_completion_rows():
    return [{"prompt": f"The number after {i} is", "completion": f" {i + 1}."} for i in range(8)]


def _messages_rows():
    return [{"messages": r["prompt"] + r["completion"]} for r in _sft_rows()]


def _tool_call_rows():
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    return [{"messages": [{"role": "user", "content": f"Add 1 and {i}"},
                          {"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "content": str(i + 1)},
                          {"role": "assistant", "content": f"It is {i + 1}."}],
             "tools": json.dumps(TOOLS)} for i in range(8)]


def _pretokenized_rows(mask):
    return [{"input_ids": [1, 504, 314 + i, 2, 1, 9531, 198, 33 + i, 2], mask: [0, 0, 0, 0, 0, 0, 0, 1, 1]}
            for i in range(8)]


TRL_INPUTS = {  # id: (rows, chat_template, config, trainer kwargs)
    "text": (_text_rows, None, {}, {}),
    "text_field": (lambda: [{"body": r["text"]} for r in _text_rows()], None, {"dataset_text_field": "body"}, {}),
    "plain_prompt_completion": (_plain_prompt_completion_rows, None, {}, {}),
    "plain_prompt_completion_full_loss": (_plain_prompt_completion_rows, None, {"completion_only_loss": False}, {}),
    "messages": (_messages_rows, None, {}, {}),
    "messages_assistant_only": (_messages_rows, TOY_TEMPLATE, {"assistant_only_loss": True}, {}),
    "tool_calls_with_tools_column": (_tool_call_rows, TOY_TEMPLATE, {}, {}),
    "chat_prompt_completion_full_loss": (_sft_rows, None, {"completion_only_loss": False}, {}),
    "pretokenized": (lambda: [{"input_ids": r["input_ids"]} for r in _pretokenized_rows("m")], None, {}, {}),
    "pretokenized_completion_mask": (lambda: _pretokenized_rows("completion_mask"), None, {}, {}),
    "pretokenized_assistant_masks": (lambda: _pretokenized_rows("assistant_masks"), None, {}, {}),
    "formatting_func": (lambda: [{"q": str(i), "a": str(i + 1)} for i in range(8)], None, {},
                        {"formatting_func": lambda row: f"Q: {row['q']} A: {row['a']}"}),
    "packing": (_text_rows, None, {"packing": True, "max_length": 16}, {}),
    "padding_free": (_text_rows, None, {"padding_free": True, "max_length": None}, {}),
}


@pytest.mark.parametrize("kind", list(TRL_INPUTS))
def test_trains_like_trl(kind, tiny_llama, tmp_path):
    """What I2 does not apply to reaches TRL unchanged: the same ids and labels, and the guards (on
    every step) stay silent."""
    rows, template, cfg, trainer_kwargs = TRL_INPUTS[kind]
    theirs, ours = _side_by_side(tiny_llama, rows(), tmp_path, tokenizer=template, trainer_kwargs=trainer_kwargs,
                                 **cfg)
    assert _rows_of(ours) == _rows_of(theirs)
    ours.train()
    assert torch.isfinite(torch.tensor(ours.state.log_history[-1]["train_loss"]))


def test_iterable_dataset_trains_like_a_map_style_one(tiny_llama, tmp_path):
    """Streaming rows are tokenized on the RL template lazily, row by row, the same way (I2 included)."""
    stream = lambda rows: Dataset.from_list(rows).to_iterable_dataset()  # noqa: E731
    theirs, ours = _side_by_side(tiny_llama, _sft_rows(), tmp_path, dataset=stream)
    _, mapped = _side_by_side(tiny_llama, _sft_rows(), tmp_path / "map")
    assert _rows_of(ours) == _rows_of(mapped)
    assert [(i + [NL], lab + [NL]) for i, lab in _rows_of(ours)] == _rows_of(theirs)
    ours.train()


def test_I2_assistant_only_loss_on_prompt_completion_with_several_turns(tiny_llama, tmp_path):
    """TRL's own case: a completion holding a user turn between two assistant turns; the user turn
    is masked (a hole in the loss), each assistant turn ends with its <|im_end|>."""
    rows = [{"prompt": r["prompt"], "completion": r["completion"] + r["prompt"] + r["completion"]}
            for r in _sft_rows()]
    theirs, ours = _side_by_side(tiny_llama, rows, tmp_path, tokenizer=TOY_TEMPLATE, assistant_only_loss=True)
    for (t_ids, t_labels), (o_ids, o_labels) in zip(_rows_of(theirs), _rows_of(ours)):
        assert t_ids == o_ids + [NL] and t_labels == o_labels + [-100]  # the "\n" was masked anyway
    assert _loss_text(ours.processing_class, ours.train_dataset[0]) == "1<|im_end|>1<|im_end|>"
    ours.train()


def test_skip_prepare_dataset_hands_rows_to_the_collator(tiny_llama, tmp_path):
    rows = [{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}] * 8
    theirs, ours = _side_by_side(tiny_llama, rows, tmp_path, dataset_kwargs={"skip_prepare_dataset": True})
    assert ours.train_dataset[:] == theirs.train_dataset[:] == Dataset.from_list(rows)[:]
    ours.train()


def test_plain_trl_config_and_a_user_subclass_get_grpotrls_defaults(tiny_llama, tmp_path, monkeypatch):
    from dataclasses import dataclass

    @dataclass
    class MyConfig(trl.SFTConfig):
        my_field: int = 3

    seen = []
    monkeypatch.setattr(grpotrl.trainers.sft, "check_sft_labels", lambda *a, **k: seen.append(1))
    for args in (trl.SFTConfig(output_dir=str(tmp_path / "a"), **_settings(max_steps=3)),
                 MyConfig(output_dir=str(tmp_path / "b"), **_settings(max_steps=3))):
        trainer = grpotrl.SFTTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(_sft_rows()))
        trainer.train()
        assert trainer.args is args
    assert len(seen) == 2 * 2  # guard_steps' default, 2, on each run


def test_training_arguments_and_no_args_are_taken_like_trl(tiny_llama, tmp_path, monkeypatch):
    from transformers import TrainingArguments

    monkeypatch.chdir(tmp_path)
    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=TrainingArguments(output_dir="ta", use_cpu=True),
                                 train_dataset=Dataset.from_list(_text_rows()))
    assert isinstance(trainer.args, grpotrl.SFTConfig) and trainer.args.output_dir == "ta"
    trainer = grpotrl.SFTTrainer(model=tiny_llama, train_dataset=Dataset.from_list(_text_rows()))
    assert trainer.args.output_dir == os.path.basename(tiny_llama) + "-SFT"


def test_model_by_hub_id(hub_tiny_llama, tmp_path):
    trainer = grpotrl.SFTTrainer(model=hub_tiny_llama, args=_sft_args(tmp_path, max_steps=1),
                                 train_dataset=Dataset.from_list(_sft_rows()))
    trainer.train()


def test_peft_prompt_tuning(tiny_llama, tmp_path):
    from peft import PromptTuningConfig, TaskType

    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, max_steps=1),
                                 train_dataset=Dataset.from_list(_sft_rows()),
                                 peft_config=PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))
    before = trainer.model.prompt_encoder.default.embedding.weight.clone()
    trainer.train()
    assert not torch.equal(before, trainer.model.prompt_encoder.default.embedding.weight)


# ---------------------------------------------------------------------------------------------
# I2 still caught where it applies
# ---------------------------------------------------------------------------------------------

def test_I2_sft_run_guards_labels_and_saves_fingerprint(tiny_llama, tmp_path):
    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path),
                                 train_dataset=Dataset.from_list(_sft_rows()))
    trainer.train()
    trainer.save_model()
    with open(os.path.join(tmp_path / "sft", templates.FINGERPRINT_FILE)) as f:
        saved = json.load(f)
    assert saved["sha256"] == templates.template_fingerprint(trainer.processing_class)["sha256"]
    assert saved["trained_on_template"] is True and saved["chat_template_kwargs"] == [{}]


def test_I2_a_push_to_hub_during_training_uploads_the_fingerprint_with_the_weights(tiny_llama, tmp_path,
                                                                                   hub_uploads):
    """push_to_hub with checkpoints: each save copies the checkpoint's weights, config and tokenizer to output_dir
    and uploads that folder; the fingerprint must go with them, or GRPO from the Hub repo finds none and checks
    nothing (a base model without one passes)."""
    args = _sft_args(tmp_path, max_steps=1, save_strategy="steps", save_steps=1, push_to_hub=True,
                     hub_model_id="me/sft")
    grpotrl.SFTTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(_sft_rows())).train()
    assert len(hub_uploads) == 1 and "model.safetensors" in hub_uploads[0]
    assert templates.FINGERPRINT_FILE in hub_uploads[0]
    with open(tmp_path / "sft" / templates.FINGERPRINT_FILE) as f:
        assert json.load(f)["chat_template_kwargs"] == [{}]


def test_I2_drift_in_the_data_stops_before_the_model_loads(tiny_llama, tmp_path, monkeypatch):
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = "{% if messages[-1]['role'] == 'assistant' %}[train]{% endif %}" + tok.chat_template
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained",  # what TRL's create_model_from_path calls
                        lambda *a, **k: pytest.fail("the model was loaded before I2 was checked"))
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*does not start with the RL prompt ids"):
        grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path), processing_class=tok,
                           train_dataset=Dataset.from_list(_sft_rows()))


# TOY_TEMPLATE with `{% endgeneration %}` before <|im_end|>: the assistant mask leaves the end-of-turn out
EOT_OUTSIDE_GENERATION = TOY_TEMPLATE.replace("{{ '<|im_end|>' }}{% endgeneration %}",
                                              "{% endgeneration %}{{ '<|im_end|>' }}")


@pytest.mark.parametrize("rows, template, match", [
    (_sft_rows, None, r"has no markers and TRL cannot add them"),  # SmolLM2's: TRL raises after the load
    (lambda: [{"messages": r["prompt"] + r["completion"]} for r in _sft_rows()], None,
     r"has no markers and TRL cannot add them"),
    (_sft_rows, EOT_OUTSIDE_GENERATION, r"(?s)loss ends with '1', not a stop token.*never teach the model to stop"),
])
def test_I2_assistant_only_loss_on_a_template_that_cannot_mask_stops_before_the_model_loads(
        rows, template, match, tiny_llama, tmp_path, monkeypatch):
    """assistant_only_loss=True: a template TRL cannot mark assistant turns in (it raises once the model is
    loaded), and on prompt/completion rows a `{% generation %}` block that leaves the end-of-turn out of the
    loss (the label guard stopped it only at the first step, blaming a collator), are refused before any load."""
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = template or tok.chat_template
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model was loaded before the template was checked"))
    with pytest.raises(grpotrl.InputError, match=match):
        grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, assistant_only_loss=True), processing_class=tok,
                           train_dataset=Dataset.from_list(rows()))


# TOY_TEMPLATE whose `{% generation %}` marks more than the assistant replies: the user turns (every one, or every
# one but "What is 0 + 1?", the first row's), or the assistant header before the generation prompt
_USER_TURN = "{%- else -%}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif -%}"
USER_MARKED = TOY_TEMPLATE.replace(_USER_TURN, "{%- else -%}{{ '<|im_start|>' + m.role + '\n' }}{% generation %}"
                                   "{{ m.content + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{%- endif -%}")
LATER_USERS_MARKED = TOY_TEMPLATE.replace(_USER_TURN, (
    "{%- elif m.content == 'What is 0 + 1?' -%}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\n' }}{% generation %}{{ m.content + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}{%- endif -%}"))
HEADER_MARKED = TOY_TEMPLATE.replace("{{ '<|im_start|>assistant\n' + think }}{% generation %}",
                                     "{% generation %}{{ '<|im_start|>assistant\n' + think }}")
# Mistral-like, no generation prompt: the mask's start cannot be checked, the assistant's text can
NO_GEN_PROMPT_USER_MARKED = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{% generation %}{{ '[INST] ' + m.content + "
    "' [/INST]' + eos_token }}{% endgeneration %}{% else %}{{ m.content + eos_token }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("template, match", [
    (USER_MARKED, r"loss span 1 of 2 \('What is 0 \+ 1\?<\|im_end\|>'\) starts after '<\|im_start\|>user\\n', not "
                  r"after the generation prompt '<\|im_start\|>assistant\\n'.*2 spans and the row 1 assistant message"),
    (HEADER_MARKED, r"the loss starts after .*, not after the generation prompt '<\|im_start\|>assistant\\n'"),
    (NO_GEN_PROMPT_USER_MARKED, r"loss span 1 \('\[INST\] What is 0 \+ 1\? \[/INST\]<\|im_end\|>'\) does not end with "
                                r"assistant message 1's content 'It is 1.'"),
], ids=["user_turn", "header_before_the_generation_prompt", "no_generation_prompt"])
def test_I2_messages_template_marking_other_tokens_stops_before_the_model_loads(template, match, tiny_llama,
                                                                               tmp_path, monkeypatch):
    """assistant_only_loss=True on `messages` rows: TRL trains on whatever the `{% generation %}` blocks mark. A
    template marking a user turn, or the header before the generation prompt, is refused on the first row before
    any weights load (TRL trains on it without a word), naming the span; guard_steps=0 turns the check off."""
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = template
    rows = [{"messages": [*r["messages"][:1], {"role": "assistant", "content": f"It is {i + 1}."}]}
            for i, r in enumerate(_messages_rows())]
    with monkeypatch.context() as m:
        m.setattr(transformers.PreTrainedModel, "from_pretrained",
                  lambda *a, **k: pytest.fail("the model was loaded before the assistant masks were checked"))
        with pytest.raises(InvariantError, match=r"(?s)\[I2\] assistant_only_loss=True on `messages` rows: the chat "
                                                 r"template of .* marks the first row's tokens wrongly: .*" + match
                                                 + r".*`guard_steps=0` turns this check off"):
            grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, assistant_only_loss=True),
                               processing_class=tok, train_dataset=Dataset.from_list(rows))
    off = grpotrl.SFTConfig(output_dir=str(tmp_path / "off"), guard_steps=0, assistant_only_loss=True, **_settings())
    grpotrl.SFTTrainer(model=tiny_llama, args=off, processing_class=tok, train_dataset=Dataset.from_list(rows)).train()


def test_I2_guard_stops_messages_rows_whose_template_marks_a_later_row_wrongly(tiny_llama, tmp_path):
    """The first row's mask is right (it passes before the load), the others mark their user turn too: the label
    guard stops the first step, naming the span."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = LATER_USERS_MARKED
    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, assistant_only_loss=True),
                                 processing_class=tok, train_dataset=Dataset.from_list(_messages_rows()))
    with pytest.raises(InvariantError, match=r"(?s)\[I2\] SFT row \d: loss span 1 of 2 \('What is [1-7] \+ 1\?"
                                             r"<\|im_end\|>'\) starts after '<\|im_start\|>user\\n', not after the "
                                             r"generation prompt.*These are `messages` rows.*`guard_steps=0` turns "
                                             r"this check off"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_I2_messages_rows_with_a_correct_template_train_like_trl_and_are_guarded(tiny_llama, tmp_path, monkeypatch):
    """Tool calls (an assistant message without content) and two assistant turns per row, assistant_only_loss:
    the same ids and labels as trl.SFTTrainer, and the label guard runs on each step and stays silent."""
    calls = []
    real = grpotrl.trainers.sft.check_sft_labels
    monkeypatch.setattr(grpotrl.trainers.sft, "check_sft_labels",
                        lambda *a, **k: calls.append(k["messages"]) or real(*a, **k))
    theirs, ours = _side_by_side(tiny_llama, _tool_call_rows(), tmp_path, tokenizer=TOY_TEMPLATE,
                                 assistant_only_loss=True, max_steps=2)
    assert _rows_of(ours) == _rows_of(theirs)
    assert _loss_text(ours.processing_class, ours.train_dataset[0]) == \
        "<tool_call>add</tool_call><|im_end|>It is 1.<|im_end|>"
    ours.train()
    assert calls == [True, True]


def test_I2_assistant_mask_problems_names_each_broken_claim(smollm2_tokenizer):
    from grpotrl.chat.sft_rows import assistant_mask_problems

    tok = smollm2_tokenizer
    # <|im_start|>user\nA<|im_end|>\n<|im_start|>assistant\nB<|im_end|>\n
    ids = [1, 4093, 198, 49, 2, 198, 1, 520, 9531, 198, 50, 2, 198]
    assert tok.decode(ids) == "<|im_start|>user\nA<|im_end|>\n<|im_start|>assistant\nB<|im_end|>\n"
    gen = [[1, 520, 9531, 198]]  # <|im_start|>assistant\n
    messages = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]

    def problems(mask, **kw):
        return "; ".join(assistant_mask_problems(tok, ids, mask, [2], gen, messages=messages, **kw))

    good = [0] * 10 + [1, 1, 0]  # "B<|im_end|>"
    assert problems(good) == ""
    assert problems([0] * 3 + [1, 1] + [0] * 5 + [1, 1, 0]) == (  # the user turn's "A<|im_end|>" too
        "loss span 1 of 2 ('A<|im_end|>') starts after '<|im_start|>user\\n', not after the generation prompt "
        "'<|im_start|>assistant\\n'; the assistant mask has 2 spans and the row 1 assistant message")
    assert problems([0] * 6 + [1] * 6 + [0]) == (  # from the header on
        "the loss starts after '\\nA<|im_end|>\\n', not after the generation prompt '<|im_start|>assistant\\n'")
    assert problems([0] * 10 + [1, 0, 0]) == "the loss ends with 'B', not a stop token"  # <|im_end|> left out
    assert problems([0] * 10 + [1, 1, 1]) == (  # ChatML's newline after <|im_end|> in the loss
        "the loss ends with '\\n', not a stop token ('\\n' after the stop token '<|im_end|>': what the template "
        "writes after the turn, which RL never generates)")
    # where TRL's tokenization is checked, whitespace around the turn (TRL's Qwen training templates mark the
    # generation prompt's last newline and the one after <|im_end|>) is noted, not a problem; text never is
    notes = []
    assert problems([0] * 9 + [1, 1, 1, 1], whitespace=notes) == ""
    assert notes == ["spans start with '\\n', the end of the generation prompt",
                     "spans end with '\\n' after the stop token '<|im_end|>'"]
    assert problems([0] * 8 + [1] * 5, whitespace=[]).startswith("the loss starts after")  # "assistant" is text
    messages[1]["content"] = "C"
    assert problems(good) == "loss span 1 ('B<|im_end|>') does not end with assistant message 1's content 'C'"
    messages[1] = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}
    assert problems(good) == ""  # no text to compare
    # a template that writes no generation prompt (Mistral's) or no stop token: not claimed
    assert assistant_mask_problems(tok, ids, [0] * 6 + [1] * 5 + [0] * 2, [2], [[]], ends_with_stop=False) == []
    # truncation: keep_start cut the row inside the span (its end is unknown), keep_end cut the header off
    assert assistant_mask_problems(tok, ids[:11], good[:11], [2], gen, end_cut=True) == []
    assert assistant_mask_problems(tok, ids[9:], good[9:], [2], gen, start_cut=True) == []
    assert "not a stop token" in "".join(assistant_mask_problems(tok, ids[:11], good[:11], [2], gen))


def test_I2_assistant_span_must_end_its_turn_with_the_messages_content(smollm2_tokenizer):
    """A one-character answer proves little by being somewhere in its span: the span must end (before its stop
    token) with the message's last line, and a span that runs past its turn's stop token into the next turn
    (its header and the user's text in the loss) is named, whatever that text holds."""
    from grpotrl.chat.sft_rows import assistant_mask_problems

    tok = smollm2_tokenizer
    messages = [{"role": "user", "content": "2 - 1?"}, {"role": "assistant", "content": "1"},
                {"role": "user", "content": "0 + 1?"}, {"role": "assistant", "content": "1"}]
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True)
    ids = list(out["input_ids"])
    gen = [[1, 520, 9531, 198]]  # <|im_start|>assistant\n
    starts = [i + 4 for i in range(len(ids)) if ids[i:i + 4] == gen[0]]  # each reply's first token
    ends = [ids.index(2, s) + 1 for s in starts]  # through each reply's <|im_end|>
    mask = [int(any(s <= i < e for s, e in zip(starts, ends))) for i in range(len(ids))]
    assert assistant_mask_problems(tok, ids, mask, [2], gen, messages=messages) == []  # the right mask: a control
    # the first reply's markers close at the next turn's end: "1<|im_end|>\n<|im_start|>user\n0 + 1?<|im_end|>"
    wide = [int(starts[0] <= i < ids.index(2, ends[0]) + 1 or starts[1] <= i < ends[1]) for i in range(len(ids))]
    assert tok.decode([t for t, m in zip(ids, wide) if m]).startswith("1<|im_end|>\n<|im_start|>user\n0 + 1?<|im_end|>1")
    problems = "; ".join(assistant_mask_problems(tok, ids, wide, [2], gen, messages=messages))
    assert "runs past the end of its turn: after the stop token '<|im_end|>' it holds '\\n<|im_start|>user" \
           in problems, problems
    # a span that holds the answer "1" only inside its other text: "1 more, so 2<|im_end|>" for reply "1"
    other = [{**m, "content": "1 more, so 2"} if k == 1 else m for k, m in enumerate(messages)]
    out = tok.apply_chat_template(other, tokenize=True, return_dict=True)
    ids2 = list(out["input_ids"])
    starts2 = [i + 4 for i in range(len(ids2)) if ids2[i:i + 4] == gen[0]]
    ends2 = [ids2.index(2, s) + 1 for s in starts2]
    mask2 = [int(any(s <= i < e for s, e in zip(starts2, ends2))) for i in range(len(ids2))]
    assert assistant_mask_problems(tok, ids2, mask2, [2], gen, messages=messages) == [
        "loss span 1 ('1 more, so 2<|im_end|>') does not end with assistant message 1's content '1'"]


@pytest.mark.parametrize("template", ["qwen3_chat_template", "qwen2_5_chat_template"])
def test_I2_messages_rows_on_trls_qwen_training_templates_train_like_trl_with_a_warning(template, tiny_llama,
                                                                                       tmp_path, caplog):
    """TRL swaps its Qwen training templates in under assistant_only_loss (the originals have no markers); their
    blocks also mark the newline after <|im_end|> (Qwen2.5's the generation prompt's last newline too): trained as
    TRL trains them, guarded every step, with one warning before the load that names the whitespace."""
    import trl.chat_template_utils as ctu

    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                          {"role": "assistant", "content": f"It is {i + 1}."},
                          {"role": "user", "content": "And plus 2?"},
                          {"role": "assistant", "content": f"It is {i + 3}."}]} for i in range(8)]
    with caplog.at_level(logging.WARNING, logger="grpotrl.chat.sft_rows"):
        theirs, ours = _side_by_side(tiny_llama, rows, tmp_path, tokenizer=getattr(ctu, template),
                                     assistant_only_loss=True, max_steps=2)
    assert _rows_of(ours) == _rows_of(theirs)
    assert "<|im_end|>\n" in _loss_text(ours.processing_class, ours.train_dataset[0])  # TRL's mask, unchanged
    assert caplog.text.count("also mark whitespace") == 1
    assert "spans end with '\\n' after the stop token '<|im_end|>'" in caplog.text
    ours.train()


# TOY_TEMPLATE whose `{% generation %}` markers also wrap a tool's reply
TOOL_TURN_MARKED = TOY_TEMPLATE.replace(
    "{%- else -%}{{ '<|im_start|>' + m.role",
    "{%- elif m.role == 'tool' -%}{% generation %}{{ '<|im_start|>tool\n' + m.content + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}{%- else -%}{{ '<|im_start|>' + m.role")


def _tool_turn_completion(i):
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": i, "b": 1}}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": str(i + 1)},
            {"role": "assistant", "content": f"It is {i + 1}."}]


def test_I2_prompt_completion_turns_marked_beyond_the_replies_stop(tiny_llama, tmp_path, monkeypatch):
    """assistant_only_loss on prompt/completion rows whose completion holds a tool's reply between two assistant
    turns: markers that wrap the tool's reply stop before the model loads (first row), or at the first step's guard
    when only a later row has such a turn; the same rows on TOY_TEMPLATE train."""
    import transformers
    from transformers import AutoTokenizer

    assert TOOL_TURN_MARKED != TOY_TEMPLATE
    rows = [{"prompt": [{"role": "user", "content": f"Add {i} and 1"}], "completion": _tool_turn_completion(i)}
            for i in range(8)]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = TOOL_TURN_MARKED
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model was loaded before the markers were checked"))
    with pytest.raises(InvariantError, match=r"(?s)\[I2\] assistant_only_loss=True on prompt/completion rows: the chat "
                                             r"template .* marks the first row's completion wrongly: loss span 2 of 3 "
                                             r"\('<\|im_start\|>tool\\n1<\|im_end\|>'\) starts after"):
        grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, assistant_only_loss=True), processing_class=tok,
                           train_dataset=Dataset.from_list(rows))
    monkeypatch.undo()
    later = [{"prompt": r["prompt"], "completion": r["completion"][-1:]} for r in rows[:4]] + rows[4:]
    trainer = grpotrl.SFTTrainer(model=tiny_llama, processing_class=tok, train_dataset=Dataset.from_list(later),
                                 args=_sft_args(tmp_path, assistant_only_loss=True, per_device_train_batch_size=8,
                                                max_steps=1))
    with pytest.raises(InvariantError, match=r"(?s)\[I2\] SFT row \d+: loss span 2 of 3 .*starts after.*markers"):
        trainer.train()
    good = AutoTokenizer.from_pretrained(tiny_llama)
    good.chat_template = TOY_TEMPLATE
    grpotrl.SFTTrainer(model=tiny_llama, processing_class=good, train_dataset=Dataset.from_list(rows),
                       args=_sft_args(tmp_path / "good", assistant_only_loss=True, max_steps=1)).train()


@pytest.mark.parametrize("config", [grpotrl.SFTConfig, trl.SFTConfig])
def test_padding_free_without_packing_under_max_length_stops_before_the_model_loads(config, tiny_llama, tmp_path,
                                                                                   monkeypatch):
    """TRL refuses padding_free=True without packing while max_length is set (it would not enforce it), once the
    model has loaded; max_length=None or packing is taken (TRL_INPUTS' "padding_free" and "packing")."""
    import transformers

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model was loaded before padding_free was checked"))
    args = config(output_dir=str(tmp_path / "sft"), padding_free=True, max_length=64, **_settings())
    with pytest.raises(grpotrl.InputError, match=r"`padding_free=True` without packing, `max_length` is not "
                                                 r"enforced, and max_length=64.*`max_length: null`.*`packing: true`"):
        grpotrl.SFTTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(_text_rows()))


@pytest.mark.parametrize("config", [grpotrl.SFTConfig, trl.SFTConfig])
def test_eos_token_outside_the_vocabulary_stops_before_the_model_loads(config, tiny_llama, tmp_path, monkeypatch):
    """TRL checks SFTConfig.eos_token against the vocabulary only once the model is loaded."""
    import transformers

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model was loaded before eos_token was checked"))
    args = config(output_dir=str(tmp_path / "sft"), eos_token="<|eot_id|>", **_settings())
    with pytest.raises(grpotrl.InputError, match=r"eos_token='<\|eot_id\|>' is not a token of the tokenizer"):
        grpotrl.SFTTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(_sft_rows()))


def test_I2_guard_catches_a_collator_that_drops_the_stop_token(tiny_llama, tmp_path):
    """A stop-dropping mask (``mask[first_eos:] = 0``) applied by a custom collator after grpotrl
    tokenized the rows: the loss no longer ends with <|im_end|>."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    base = DataCollatorForLanguageModeling(pad_token_id=2)

    def seed_002(examples):
        batch = base(examples)
        batch["labels"][batch["labels"] == 2] = -100
        return batch

    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path), data_collator=seed_002,
                                 train_dataset=Dataset.from_list(_sft_rows()))
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*not a stop token"):
        trainer.train()


def test_I2_check_sft_labels_names_each_broken_claim(smollm2_tokenizer):
    ex = templates.tokenize_sft_example(smollm2_tokenizer, PROMPT, [{"role": "assistant", "content": "5 5"}], [2])
    ids = torch.tensor([ex["input_ids"]])  # [1, L]
    good = torch.where(torch.tensor([ex["completion_mask"]]) == 1, ids, -100)
    gen = [templates.generation_prompt_ids(smollm2_tokenizer)]
    check_sft_labels(smollm2_tokenizer, {"input_ids": ids, "labels": good}, [2], gen)
    late = good.clone()
    late[0, (good[0] != -100).nonzero()[0]] = -100  # the response's first token left out
    with pytest.raises(InvariantError, match="not after the generation prompt"):
        check_sft_labels(smollm2_tokenizer, {"input_ids": ids, "labels": late}, [2], gen)
    holes = good.clone()
    holes[0, (good[0] != -100).nonzero()[1]] = -100
    with pytest.raises(InvariantError, match="the loss span has holes"):
        check_sft_labels(smollm2_tokenizer, {"input_ids": ids, "labels": holes}, [2], gen)
    # assistant-only loss masks turns, never a token inside a reply: each span is a reply ending with its stop
    with pytest.raises(InvariantError, match=r"loss span 1 of 2 \('5'\) ends with '5', not a stop token"):
        check_sft_labels(smollm2_tokenizer, {"input_ids": ids, "labels": holes}, [2], gen, holes=True)
    # cut by max_length (keep_start): the end is not the response's end, nothing is claimed about it
    cut = {"input_ids": ids[:, :-1], "labels": good[:, :-1]}
    with pytest.raises(InvariantError, match="not a stop token"):
        check_sft_labels(smollm2_tokenizer, cut, [2], gen)
    check_sft_labels(smollm2_tokenizer, cut, [2], gen, max_length=ids.size(1) - 1)


def test_I2_guard_is_silent_on_rows_truncated_by_max_length(tiny_llama, tmp_path):
    rows = [{"prompt": r["prompt"], "completion": [{"role": "assistant", "content": "one two three " * 20}]}
            for r in _sft_rows()]
    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, max_length=40),
                                 train_dataset=Dataset.from_list(rows))
    assert len(trainer.train_dataset[0]["input_ids"]) == 40
    trainer.train()


def test_I2_packed_chat_rows_train(tiny_llama, tmp_path):
    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, packing=True, max_length=64),
                                 train_dataset=Dataset.from_list(_sft_rows()))
    packed = trainer.train_dataset[0]
    assert NL not in [t for t in packed["labels"] if t != -100]  # the I2 rows were packed, trailer-free
    trainer.train()


def test_rows_truncation_leaves_without_loss_are_counted_and_none_left_is_an_error(tiny_llama, tmp_path, caplog):
    """TRL drops each row whose prompt alone fills max_length (no loss token left), unsaid, and with none left
    fails at train() on `num_samples=0`. Prompts of 38 tokens (+ "2<|im_end|>") and of 69."""
    long = [{"prompt": [{"role": "user", "content": f"What is {i} + 1? " + "Think hard. " * 10}],
             "completion": [{"role": "assistant", "content": str(i + 1)}]} for i in range(3)]
    args = _sft_args(tmp_path, max_length=48)
    with caplog.at_level(logging.WARNING, logger="grpotrl.trainers.sft"):
        trainer = grpotrl.SFTTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(long + _sft_rows(5)))
    assert len(trainer.train_dataset) == 5
    assert "3 of the 8 rows of the 'train' dataset were dropped: truncated to max_length=48" in caplog.text
    with pytest.raises(grpotrl.InputError, match=r"Every row of the 'train' dataset \(3\) was dropped: truncated "
                                                 r"to max_length=48 \(truncation_mode='keep_start'\)"):
        grpotrl.SFTTrainer(model=tiny_llama, args=args, train_dataset=Dataset.from_list(long))


def test_I2_sequence_ends_at_the_end_of_turn_not_at_the_eos_the_template_writes_after_it(tiny_multistop, tmp_path):
    """Phi-3's template ends a conversation with eos after the last <|end|>\\n; RL stops at <|end|>.
    Here eos = <|endoftext|> (id 0) and the end-of-turn <|im_end|> (id 2), both stop ids: the loss
    ends at <|im_end|>, not at the eos two tokens later."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_multistop)
    tok.chat_template += "{% if not add_generation_prompt %}{{ eos_token }}{% endif %}"
    assert templates.stop_token_ids(tok) == [0, 2]
    assert tok.decode(templates.generation_prompt_ids(tok)) == "<|im_start|>assistant\n"  # what the guard checks
    trainer = grpotrl.SFTTrainer(model=tiny_multistop, args=_sft_args(tmp_path), processing_class=tok,
                                 train_dataset=Dataset.from_list(_sft_rows()))
    row = trainer.train_dataset[0]
    assert _loss_text(tok, row) == "1<|im_end|>" and row["input_ids"][-1] == 2  # not "1<|im_end|>\n<|endoftext|>"
    two_turns = templates.tokenize_sft_example(tok, PROMPT, ANSWER + PROMPT + ANSWER, [0, 2])
    assert tok.decode(two_turns["input_ids"][-3:]) == "\n5<|im_end|>"  # the last end-of-turn, with none after it
    trainer.train()


def test_I2_guard_takes_a_template_without_a_generation_prompt(tiny_llama, tmp_path):
    """Mistral-7B-Instruct-v0.1's template writes no generation prompt: the response follows
    ' [/INST]' directly. The loss is right ("1<|im_end|>"), and the guard (every step) stays silent."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
        "{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
    assert templates.generation_prompt_ids(tok) == []
    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path), processing_class=tok,
                                 train_dataset=Dataset.from_list(_sft_rows()))
    assert _loss_text(tok, trainer.train_dataset[0]) == "1<|im_end|>"
    trainer.train()


@pytest.mark.parametrize("column, value, why", [
    ("completion", [], "completion is an empty list of messages"),  # TRL drops the row silently
    ("prompt", [], "prompt is an empty list of messages"),  # TRL: IndexError after the model loads
    ("messages", [], "messages is an empty list of messages"),  # TRL: IndexError
    ("text", None, "'text' is a NoneType, not a string"),  # TRL: AttributeError (None.endswith)
])
def test_bad_row_after_the_first_is_named_before_the_model_loads(column, value, why, tiny_llama, tmp_path,
                                                                 monkeypatch):
    import transformers

    rows = {"messages": _messages_rows(), "text": _text_rows()}.get(column, _sft_rows())
    rows[3] = {**rows[3], column: value}
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model was loaded before the rows were checked"))
    with pytest.raises(grpotrl.InputError, match=rf"Row 3 of the 'train' split \(SFT\): {why}"):
        grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path), train_dataset=Dataset.from_list(rows))


# ---------------------------------------------------------------------------------------------
# The template SFT trained on: chat_template_path, chat_template_kwargs, check_template
# ---------------------------------------------------------------------------------------------

def _bot_template(tok):
    return tok.chat_template.replace("message['role']", "('bot' if message['role'] == 'assistant' else "
                                     "message['role'])").replace("'<|im_start|>assistant\n'", "'<|im_start|>bot\n'")


def test_I2_chat_template_path_file_is_what_sft_trains_on_and_fingerprints(tiny_llama, tmp_path, smollm2_tokenizer):
    path = tmp_path / "bot.jinja"
    path.write_text(_bot_template(smollm2_tokenizer))
    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, chat_template_path=str(path)),
                                 train_dataset=Dataset.from_list(_sft_rows()))
    tok = trainer.processing_class
    row = trainer.train_dataset[0]
    assert "<|im_start|>bot\n" in tok.decode(row["input_ids"])
    assert row["input_ids"][: len(_trl_rl_prompt_ids(tok, _sft_rows()[0]["prompt"]))] == list(
        _trl_rl_prompt_ids(tok, _sft_rows()[0]["prompt"]))
    trainer.train()
    trainer.save_model()
    with open(tmp_path / "sft" / templates.FINGERPRINT_FILE) as f:
        assert json.load(f)["template"] == path.read_text()
    assert templates.check_fingerprint(str(tmp_path / "sft"), tok) is True
    with pytest.raises(InvariantError, match="another chat template"):
        templates.check_fingerprint(str(tmp_path / "sft"), smollm2_tokenizer)


def test_I2_chat_template_path_tokenizer_dir_is_cloned_as_trl_does(tiny_llama, tmp_path, smollm2_tokenizer):
    """The template of a tokenizer directory (or Hub id): trl.clone_chat_template semantics."""
    source = tmp_path / "source-tokenizer"
    smollm2_tokenizer.save_pretrained(source)
    tok_json = source / "tokenizer_config.json"
    cfg = json.loads(tok_json.read_text())
    cfg["chat_template"] = _bot_template(smollm2_tokenizer)
    tok_json.write_text(json.dumps(cfg))
    (source / "chat_template.jinja").unlink(missing_ok=True)
    theirs, ours = _side_by_side(tiny_llama, _sft_rows(), tmp_path, chat_template_path=str(source))
    assert ours.processing_class.chat_template == theirs.processing_class.chat_template == _bot_template(
        smollm2_tokenizer)
    assert [(i + [NL], lab + [NL]) for i, lab in _rows_of(ours)] == _rows_of(theirs)
    ours.train()


def test_I2_chat_template_kwargs_are_applied_and_recorded(tiny_llama, tmp_path):
    """SFTConfig.chat_template_kwargs (grpotrl's, like GRPOConfig's) and trl's per-row column both
    reach the tokenization; the fingerprint records them, and GRPO with kwargs that render the
    prompt otherwise is an I2 error."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = TOY_TEMPLATE
    no_think = {"enable_thinking": False}
    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, chat_template_kwargs=no_think),
                                 processing_class=tok, train_dataset=Dataset.from_list(_sft_rows()))
    rl = _trl_rl_prompt_ids(tok, _sft_rows()[0]["prompt"], **no_think)
    assert tok.decode(rl).endswith("<think>\n\n</think>\n\n")
    assert trainer.train_dataset[0]["input_ids"][: len(rl)] == list(rl)
    trainer.train()
    trainer.save_model()
    ckpt = str(tmp_path / "sft")
    with open(os.path.join(ckpt, templates.FINGERPRINT_FILE)) as f:
        assert json.load(f)["chat_template_kwargs"] == [no_think]
    assert templates.check_fingerprint(ckpt, tok, chat_template_kwargs=no_think)
    assert templates.check_fingerprint(ckpt, tok, chat_template_kwargs=None)  # a caller that does not say
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*chat_template_kwargs.*enable_thinking"):
        templates.check_fingerprint(ckpt, tok, chat_template_kwargs={})
    # trl's per-row column, over the config's: rows rendered both ways are both recorded. SmolLM2 splits
    # "\n\n1" into "\n", "\n", "1" but ends the RL prompt with the one token "\n\n": TRL trains on the
    # former, grpotrl on RL's prompt ids and then the response's own ids (I2).
    rows = [{**r, "chat_template_kwargs": {"enable_thinking": bool(i % 2)}} for i, r in enumerate(_sft_rows())]
    theirs, ours = _side_by_side(tiny_llama, rows, tmp_path / "rows", tokenizer=TOY_TEMPLATE)
    for i, ((t_ids, _), (o_ids, o_labels)) in enumerate(zip(_rows_of(theirs), _rows_of(ours))):
        rl = list(_trl_rl_prompt_ids(tok, rows[i]["prompt"], **rows[i]["chat_template_kwargs"]))
        assert o_ids[: len(rl)] == rl and tok.decode(o_ids[len(rl):]) == f"{i + 1}<|im_end|>"
        assert o_labels == [-100] * len(rl) + o_ids[len(rl):]
        assert (t_ids == o_ids + [NL]) == (i % 2 == 1)  # thinking rows: TRL's ids but the trailer
    assert ours._template_kwargs == [{"enable_thinking": False}, {"enable_thinking": True}]
    templates.save_fingerprint(str(tmp_path / "fp"), tok, chat_template_kwargs=ours._template_kwargs)
    assert templates.check_fingerprint(str(tmp_path / "fp"), tok, chat_template_kwargs={})  # renders as True


def test_I2_grpo_from_sft_checkpoint_compares_chat_template_kwargs(tiny_llama, tmp_path, monkeypatch):
    """SFT recorded {"enable_thinking": false}; GRPO (Python and CLI) with kwargs that render the prompt
    otherwise stops with I2 before any weights load; with the same kwargs it builds, and its own
    checkpoint records them for the next stage."""
    from transformers import AutoTokenizer

    from grpotrl import cli

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = TOY_TEMPLATE
    no_think = {"enable_thinking": False}
    sft = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, chat_template_kwargs=no_think),
                             processing_class=tok, train_dataset=Dataset.from_list(_sft_rows()))
    sft.save_model()
    ckpt = str(tmp_path / "sft")
    prompts = Dataset.from_list([{"prompt": r["prompt"]} for r in _sft_rows(4)])
    data = tmp_path / "prompts.jsonl"
    prompts.to_json(data)

    def grpo_args(**kw):
        return grpotrl.GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=4, num_generations=4,
                                  max_completion_length=4, max_steps=1, report_to="none", use_cpu=True, **kw)

    loads = _count_loads(monkeypatch)
    for kwargs in ({}, {"enable_thinking": True}, None):  # None: TRL's default, renders as thinking on
        with pytest.raises(InvariantError, match=r"(?s)\[I2\].*chat_template_kwargs.*enable_thinking"):
            grpotrl.GRPOTrainer(model=ckpt, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                                args=grpo_args(chat_template_kwargs=kwargs), train_dataset=prompts)
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*chat_template_kwargs"):
        cli.run("grpo", ["--model_name_or_path", ckpt, "--dataset_name", str(data), "--reward_funcs", "length",
                         "--output_dir", str(tmp_path / "cli"), "--use_cpu", "true"])
    assert loads == []  # every refusal came before a weight was read
    grpo = grpotrl.GRPOTrainer(model=ckpt, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                               args=grpo_args(chat_template_kwargs=no_think), train_dataset=prompts)
    grpo.save_model()
    with open(tmp_path / "grpo" / templates.FINGERPRINT_FILE) as f:
        assert json.load(f)["chat_template_kwargs"] == [no_think]


def _tool_sft(tiny_llama, out, tools):
    """A tokenizer on TRL's Qwen2.5 template (it renders the tools' schemas into the system turn), and the
    checkpoint ``out/sft`` of an SFT on rows whose ``tools`` column is ``tools(i)``."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = qwen2_5_chat_template
    rows = [{**r, "tools": tools(i)} for i, r in enumerate(_sft_rows())]
    sft = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(out), processing_class=tok,
                             train_dataset=Dataset.from_list(rows))
    sft.save_model()
    return tok, sft, str(out / "sft")


def _grpo_on(model, out, **kwargs):
    args = grpotrl.GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=4,
                              max_completion_length=4, max_steps=1, report_to="none", use_cpu=True)
    prompts = Dataset.from_list([{"prompt": r["prompt"]} for r in _sft_rows(4)])
    return grpotrl.GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                               args=args, train_dataset=prompts, **kwargs)


def _count_loads(monkeypatch) -> list:
    import transformers

    real_load = transformers.PreTrainedModel.from_pretrained.__func__  # what TRL's create_model_from_path reaches
    loads = []
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(a) or real_load(cls, *a, **k)))
    return loads


# a tool as GRPOTrainer(tools=...) takes it, and the method of the environment class CounterEnvironment
MULTIPLY = CounterEnvironment().multiply


def test_I2_grpo_without_the_sft_rows_tools_stops_before_loading(tiny_llama, tmp_path, monkeypatch, caplog):
    """SFT on rows with a ``tools`` column records their schemas; GRPO from that checkpoint without tools
    stops with I2 before any weights load, naming both and showing the tools block; with the same tools
    (a callable, or an environment class whose method it is) it builds, and its own checkpoint records
    them, which a resume compares. A factory that is not a class: a warning that its tools were not compared."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(MULTIPLY)
    tok, _, ckpt = _tool_sft(tiny_llama, tmp_path, lambda i: json.dumps([schema]))
    loads = _count_loads(monkeypatch)
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*with tools \[multiply\]; this run renders them with no "
                                             r"tools.*checkpoint: '\\n\\n# Tools.*now:        ''.*tools="):
        _grpo_on(ckpt, tmp_path / "grpo")
    assert loads == []  # refused before a weight was read
    with open(os.path.join(ckpt, templates.FINGERPRINT_FILE)) as f:
        assert json.load(f)["tools"] == [[schema]]
    _grpo_on(ckpt, tmp_path / "grpo", tools=[MULTIPLY])
    _grpo_on(ckpt, tmp_path / "grpo", environment_factory=CounterEnvironment).save_model()
    with open(tmp_path / "grpo" / templates.FINGERPRINT_FILE) as f:
        assert json.load(f)["tools"] == [[schema]]
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*this run renders them with no tools"):
        templates.check_fingerprint(str(tmp_path / "grpo"), tok, tool_sets=[None])  # what a resume compares
    with caplog.at_level(logging.WARNING, logger="grpotrl.preflight"):
        _grpo_on(ckpt, tmp_path / "grpo", environment_factory=lambda: CounterEnvironment())
    assert "environment_factory is not a class" in caplog.text


def test_I2_grpo_with_tools_the_sft_rows_lacked_stops_before_loading(tiny_llama, tmp_path, monkeypatch):
    """The reverse: SFT rows without tools (recorded as null), GRPO with them: I2 before any weights load.
    SFT rows of both kinds record both, and GRPO with or without the tools passes."""
    from transformers.utils import get_json_schema

    _, sft, ckpt = _tool_sft(tiny_llama, tmp_path, lambda i: None)
    loads = _count_loads(monkeypatch)
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*with no tools; this run renders them with tools "
                                             r"\[multiply\].*now:        '\\n\\n# Tools"):
        _grpo_on(ckpt, tmp_path / "grpo", tools=[MULTIPLY])
    assert loads == []
    assert sft._template_tools == [None]
    schema = get_json_schema(MULTIPLY)
    tok, sft, mixed = _tool_sft(tiny_llama, tmp_path / "mixed", lambda i: json.dumps([schema]) if i % 2 else None)
    assert sft._template_tools == [[schema], None]
    for tools in ([None], [[MULTIPLY]]):
        assert templates.check_fingerprint(mixed, tok, tool_sets=tools)


def test_I2_tools_not_recorded_or_not_rendered_pass(tiny_llama, tmp_path):
    """A fingerprint without ``tools`` (written before they were recorded) compares none, and a template
    that does not render tools (SmolLM2's ChatML) renders the prompt alike with and without them."""
    from transformers import AutoTokenizer
    from transformers.utils import get_json_schema

    schema = get_json_schema(MULTIPLY)
    tok, _, ckpt = _tool_sft(tiny_llama, tmp_path, lambda i: json.dumps([schema]))
    path = os.path.join(ckpt, templates.FINGERPRINT_FILE)
    with open(path) as f:
        old = {k: v for k, v in json.load(f).items() if k != "tools"}
    with open(path, "w") as f:
        json.dump(old, f)
    assert templates.check_fingerprint(ckpt, tok, chat_template_kwargs={}, tool_sets=[None])
    _grpo_on(ckpt, tmp_path / "grpo")
    chatml = AutoTokenizer.from_pretrained(tiny_llama)
    templates.save_fingerprint(str(tmp_path / "chatml"), chatml, tools=[[schema]])
    assert templates.check_fingerprint(str(tmp_path / "chatml"), chatml, tool_sets=[None])


def test_I2_sft_from_a_checkpoint_with_another_template_stops_before_loading(tiny_llama, tmp_path, monkeypatch):
    import transformers
    from transformers import AutoTokenizer

    first = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, max_steps=1),
                               train_dataset=Dataset.from_list(_sft_rows()))
    first.train()
    first.save_model()
    ckpt = str(tmp_path / "sft")
    other = AutoTokenizer.from_pretrained(ckpt)
    other.chat_template = _bot_template(other)
    with monkeypatch.context() as m:
        m.setattr(transformers.PreTrainedModel, "from_pretrained",
                  lambda *a, **k: pytest.fail("the model was loaded before the template check"))
        with pytest.raises(InvariantError, match=r"(?s)\[I2\].*another chat template"):
            grpotrl.SFTTrainer(model=ckpt, args=_sft_args(tmp_path / "2"), processing_class=other,
                               train_dataset=Dataset.from_list(_sft_rows()))
    grpotrl.SFTTrainer(model=ckpt, args=_sft_args(tmp_path / "3", check_template=False), processing_class=other,
                       train_dataset=Dataset.from_list(_sft_rows()))


def test_guard_logprob_atol_is_not_an_sft_setting():
    """I5's tolerance has no meaning in SFT (nothing is sampled): SFTConfig has no such field."""
    assert "guard_logprob_atol" in grpotrl.GRPOConfig.__dataclass_fields__
    assert "guard_logprob_atol" not in grpotrl.SFTConfig.__dataclass_fields__
    with pytest.raises(TypeError, match="guard_logprob_atol"):
        grpotrl.SFTConfig(output_dir="x", guard_logprob_atol=1e-3)


def test_plain_text_sft_fingerprint_says_no_template_and_grpo_only_warns(tiny_llama, tmp_path, caplog):
    trainer = grpotrl.SFTTrainer(model=tiny_llama, args=_sft_args(tmp_path, max_steps=1),
                                 train_dataset=Dataset.from_list(_text_rows()))
    trainer.train()
    trainer.save_model()
    ckpt = str(tmp_path / "sft")
    with open(os.path.join(ckpt, templates.FINGERPRINT_FILE)) as f:
        saved = json.load(f)
    assert saved["trained_on_template"] is False and "chat_template_kwargs" not in saved
    other = trainer.processing_class
    other.chat_template = _bot_template(other)
    with caplog.at_level(logging.WARNING, logger="grpotrl.chat.templates"):
        assert templates.check_fingerprint(ckpt, other) is True
    assert "not on a chat template" in caplog.text


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

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", no_load)
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


def test_an_empty_assistant_turn_in_a_prompt_trl_trains_is_refused_before_the_model_loads(tmp_path, tiny_llama):
    """With ``completion_only_loss=False`` TRL labels prompt + completion, so an empty assistant turn inside a
    prompt is trained on its end-of-turn token alone: refused before any weights load (the model path does not
    exist, and the error is the data's). TRL's default masks the prompt: the same rows build a trainer."""
    rows = _sft_rows(4)
    rows[2]["prompt"] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  "},
                         {"role": "user", "content": "What is 2 + 1?"}]
    with pytest.raises(grpotrl.InputError, match=r"row 2: .*completion_only_loss=False TRL trains the prompt"):
        grpotrl.SFTTrainer(model=str(tmp_path / "not-loaded"), train_dataset=Dataset.from_list(rows),
                           args=_sft_args(tmp_path, completion_only_loss=False))
    grpotrl.SFTTrainer(model=tiny_llama, train_dataset=Dataset.from_list(rows), args=_sft_args(tmp_path))
