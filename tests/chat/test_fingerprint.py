"""I2's template fingerprint covers the vocabulary: a checkpoint whose tokenizer gained tokens in SFT, started from
with the base tokenizer, renders the same prompt text into other ids, and is refused before the model loads; the
same tokenizer saved and loaded again, and fingerprints written before the vocabulary was recorded, pass. It also
records the template SFT rendered its rows with where the tokenizer does not carry it (TRL's training variant under
assistant_only_loss), and GRPO's prompts must render under GRPO's template as under that one."""

import json
import logging
import os

import pytest
import transformers
from conftest import arithmetic_prompts, length_reward
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import get_json_schema

import grpotrl
from grpotrl import InvariantError
from grpotrl.chat import templates


def _rows(n=4):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "completion": [{"role": "assistant", "content": str(i + 1)}]} for i in range(n)]


def _with_tool_token(path):
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    return tok


def test_I2_fingerprint_records_the_vocabulary_and_its_added_tokens(smollm2_path, tmp_path):
    base, grown = AutoTokenizer.from_pretrained(smollm2_path), _with_tool_token(smollm2_path)
    a, b = templates.template_fingerprint(base), templates.template_fingerprint(grown)
    assert a["sha256"] == b["sha256"]  # one template, one set of bos/eos/pad: the text of every prompt is the same
    assert a["vocab_sha256"] != b["vocab_sha256"] and b["vocab_size"] == a["vocab_size"] + 1
    assert b["added_tokens"][str(len(base))] == "<tool_call>" and str(len(base)) not in a["added_tokens"]
    # the same tokenizer saved and loaded again: the same fingerprint (no false alarm on a reload)
    grown.save_pretrained(tmp_path / "tok")
    assert templates.template_fingerprint(AutoTokenizer.from_pretrained(tmp_path / "tok")) == b


def test_I2_a_tokenizer_without_the_checkpoints_added_token_is_refused(smollm2_path, tmp_path):
    base, grown = AutoTokenizer.from_pretrained(smollm2_path), _with_tool_token(smollm2_path)
    templates.save_fingerprint(str(tmp_path), grown)
    n = len(base)
    with pytest.raises(InvariantError, match=rf"(?s)\[I2\].*another vocabulary.*has {n + 1} tokens, this run's {n}; "
                                             rf"added tokens only the checkpoint's has: {n} '<tool_call>'"):
        templates.check_fingerprint(str(tmp_path), base)
    assert templates.check_fingerprint(str(tmp_path), grown) is True


def test_I2_the_vocabulary_is_compared_after_sft_on_plain_text_too(smollm2_path, tmp_path):
    """No template to compare after SFT on plain text (a warning), but other ids for the same text still are."""
    templates.save_fingerprint(str(tmp_path), _with_tool_token(smollm2_path), trained_on_template=False)
    with pytest.raises(InvariantError, match="another vocabulary"):
        templates.check_fingerprint(str(tmp_path), AutoTokenizer.from_pretrained(smollm2_path))


def test_I2_a_fingerprint_written_before_the_vocabulary_was_recorded_still_passes(smollm2_path, tmp_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    templates.save_fingerprint(str(tmp_path), tok)
    path = tmp_path / templates.FINGERPRINT_FILE
    old = {k: v for k, v in json.loads(path.read_text()).items()
           if k not in ("vocab_sha256", "vocab_size", "added_tokens")}
    path.write_text(json.dumps(old))
    assert templates.check_fingerprint(str(tmp_path), _with_tool_token(smollm2_path)) is True


def test_I2_grpo_from_an_sft_checkpoint_with_added_tokens_and_the_base_tokenizer_stops_before_loading(
        tiny_llama, grpo_args, tmp_path, monkeypatch):
    """SFT on a tokenizer that gained a token (embeddings resized, as a user does), then GRPO from the SFT
    checkpoint handed the base model's tokenizer: refused before the model loads; the checkpoint's own passes."""
    tok = _with_tool_token(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    model.resize_token_embeddings(len(tok))
    sft = grpotrl.SFTTrainer(
        model=model, processing_class=tok, train_dataset=Dataset.from_list(_rows()),
        args=grpotrl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=1, per_device_train_batch_size=4,
                               report_to="none", use_cpu=True, save_strategy="no", bf16=False))
    sft.train()
    sft.save_model()
    ckpt = str(tmp_path / "sft")
    assert json.load(open(os.path.join(ckpt, templates.FINGERPRINT_FILE)))["vocab_size"] == len(tok)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the vocabulary was checked")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", no_load)
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*another vocabulary.*'<tool_call>'"):
        grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(),
                            train_dataset=arithmetic_prompts(), processing_class=AutoTokenizer.from_pretrained(tiny_llama))
    sft_args = grpotrl.SFTConfig(output_dir=str(tmp_path / "sft2"), report_to="none", use_cpu=True, bf16=False)
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*another vocabulary.*'<tool_call>'"):  # a token lost
        grpotrl.SFTTrainer(model=ckpt, args=sft_args, train_dataset=Dataset.from_list(_rows()),
                           processing_class=AutoTokenizer.from_pretrained(tiny_llama))
    monkeypatch.undo()
    grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(), train_dataset=arithmetic_prompts())
    more = AutoTokenizer.from_pretrained(ckpt)
    more.add_tokens(["<answer>"])  # a second SFT adds a token: it trains it
    grpotrl.SFTTrainer(model=ckpt, args=sft_args, train_dataset=Dataset.from_list(_rows()), processing_class=more)


def test_I2_sft_from_a_checkpoint_may_add_tokens_but_not_lose_or_move_them(smollm2_path, tmp_path):
    """SFT trains the tokens it adds (``vocabulary_may_grow``): the checkpoint's tokens at their ids plus
    appended ones pass there, and only there; a tokenizer that lacks one of the checkpoint's tokens fails in both."""
    base, grown = AutoTokenizer.from_pretrained(smollm2_path), _with_tool_token(smollm2_path)
    templates.save_fingerprint(str(tmp_path / "base"), base)
    assert templates.check_fingerprint(str(tmp_path / "base"), grown, vocabulary_may_grow=True) is True
    with pytest.raises(InvariantError, match=r"another vocabulary.*only this run's has: \d+ '<tool_call>'"):
        templates.check_fingerprint(str(tmp_path / "base"), grown)  # GRPO: ids the model never saw in SFT
    templates.save_fingerprint(str(tmp_path / "grown"), grown)
    with pytest.raises(InvariantError, match="another vocabulary"):
        templates.check_fingerprint(str(tmp_path / "grown"), base, vocabulary_may_grow=True)
    other = _with_tool_token(smollm2_path)
    other.add_special_tokens({"additional_special_tokens": ["<a>"]})  # <tool_call> kept, <a> appended: growth
    assert templates.check_fingerprint(str(tmp_path / "grown"), other, vocabulary_may_grow=True) is True
    moved = AutoTokenizer.from_pretrained(smollm2_path)
    moved.add_special_tokens({"additional_special_tokens": ["<a>", "<tool_call>"]})  # <tool_call> at another id
    with pytest.raises(InvariantError, match=r"only the checkpoint's has: (\d+) '<tool_call>'"):
        templates.check_fingerprint(str(tmp_path / "grown"), moved, vocabulary_may_grow=True)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


MULTI_TURN = [{"role": "user", "content": "What is 2 + 3?"},
              {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n5"},
              {"role": "user", "content": "And 4 + 4?"}]


def _qwen3_sft(tiny_llama, tmp_path, template):
    from trl.chat_template_utils import qwen3_chat_template

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = qwen3_chat_template
    if template == "training":
        from trl.chat_template_utils import get_training_chat_template
        tok.chat_template = get_training_chat_template(tok)
    rows = [{**row, "tools": [get_json_schema(add)]} for row in _rows()]  # SFT rendered its rows with the tool
    sft = grpotrl.SFTTrainer(
        model=tiny_llama, processing_class=tok, train_dataset=Dataset.from_list(rows),
        args=grpotrl.SFTConfig(output_dir=str(tmp_path / template), max_steps=1, per_device_train_batch_size=4,
                               report_to="none", use_cpu=True, save_strategy="no", bf16=False))
    sft.train()
    sft.save_model()
    return str(tmp_path / template)


def test_I2_grpo_with_tools_on_trls_training_template_must_render_the_prompts_sft_saw(tiny_llama, grpo_args, tmp_path,
                                                                                     monkeypatch):
    """Qwen3's template is not prefix-preserving, so trl.GRPOTrainer with tools renders prompts with its training
    variant, which keeps an earlier assistant turn's reasoning that the original (what SFT trained on) drops: a
    multi-turn prompt SFT saw otherwise stops before the model loads; single-turn prompts render alike and pass,
    and so does SFT on the training variant itself."""
    ckpt = _qwen3_sft(tiny_llama, tmp_path, "original")
    multi = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 1 + 1?"}]}, {"prompt": MULTI_TURN}])

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the prompts' rendering was compared")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", no_load)
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*prefix-preserving training template.*renders prompt 1 "
                                             r"otherwise.*GRPO's template: .*add them.*get_training_chat_template"):
        grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(), train_dataset=multi,
                            tools=[add])
    monkeypatch.undo()
    single = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}]} for i in range(4)])
    grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(), train_dataset=single, tools=[add])
    with pytest.raises(InvariantError, match="rendered with tools \\[add\\]; this run renders them with no tools"):
        grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(), train_dataset=multi)
    grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(check_template=False),
                        train_dataset=multi, tools=[add])
    # SFT on TRL's training variant, then GRPO with the original template, which TRL swaps for that variant
    on_variant = _qwen3_sft(tiny_llama, tmp_path, "training")
    grpotrl.GRPOTrainer(model=on_variant, reward_funcs=length_reward, args=grpo_args(), train_dataset=multi,
                        tools=[add], processing_class=AutoTokenizer.from_pretrained(ckpt))
    with pytest.raises(InvariantError, match="another chat template"):  # without tools TRL renders the original
        grpotrl.GRPOTrainer(model=on_variant, reward_funcs=length_reward, args=grpo_args(), train_dataset=multi,
                            processing_class=AutoTokenizer.from_pretrained(ckpt))


def _messages_sft(tiny_llama, tmp_path, name, assistant_only_loss):
    """A real grpotrl SFT on Qwen3's template (set on the test tokenizer) over multi-turn ``messages`` rows whose
    earlier assistant turn reasons; half the rows carry the ``add`` tool (both ways are recorded)."""
    from trl.chat_template_utils import qwen3_chat_template

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = qwen3_chat_template
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                          {"role": "assistant", "content": f"<think>\nadd one\n</think>\n\n{i + 1}"},
                          {"role": "user", "content": "And doubled?"},
                          {"role": "assistant", "content": str(2 * i + 2)}],
             "tools": json.dumps([get_json_schema(add)]) if i % 2 else None} for i in range(4)]
    sft = grpotrl.SFTTrainer(
        model=tiny_llama, processing_class=tok, train_dataset=Dataset.from_list(rows),
        args=grpotrl.SFTConfig(output_dir=str(tmp_path / name), max_steps=1, per_device_train_batch_size=4,
                               report_to="none", use_cpu=True, save_strategy="no", bf16=False,
                               assistant_only_loss=assistant_only_loss))
    sft.train()
    sft.save_model()
    return str(tmp_path / name)


def test_I2_sft_on_trls_assistant_only_template_then_grpo_on_multi_turn_prompts_stops_before_loading(
        tiny_llama, grpo_args, tmp_path, monkeypatch):
    """Under assistant_only_loss TRL renders SFT's rows with its ``{% generation %}`` variant of Qwen3's template,
    which keeps an earlier assistant turn's reasoning, while the tokenizer saved beside the weights keeps the
    original, which drops it. The fingerprint records the variant; GRPO without tools (the original) on a multi-turn
    prompt stops before the model loads, naming the prompt and the fix. Controls: single-turn prompts render alike
    and pass, and so do GRPO with the variant set on the tokenizer (the fix) and GRPO with tools (TRL swaps in the
    same variant)."""
    from trl.chat_template_utils import get_training_chat_template, qwen3_chat_template

    ckpt = _messages_sft(tiny_llama, tmp_path, "aol", assistant_only_loss=True)
    saved = json.load(open(os.path.join(ckpt, templates.FINGERPRINT_FILE)))
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.chat_template == saved["template"] == qwen3_chat_template  # the saved tokenizer keeps the original
    assert saved["trained_template"] == get_training_chat_template(tok)
    multi = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 1 + 1?"}]}, {"prompt": MULTI_TURN}])

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the prompts' rendering was compared")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", no_load)
    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*rendered the rows .* with TRL's training template.*renders "
                                             r"prompt 1 otherwise.*checkpoint's template: .*add them.*GRPO's template: "
                                             r"(?:(?!add them).)*\n.*get_training_chat_template.*processing_class"):
        grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(), train_dataset=multi)
    monkeypatch.undo()
    single = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}]} for i in range(4)])
    grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(), train_dataset=single)
    on_variant = AutoTokenizer.from_pretrained(ckpt)
    on_variant.chat_template = get_training_chat_template(on_variant)  # what the error says to do
    grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(), train_dataset=multi,
                        processing_class=on_variant)
    grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(), train_dataset=multi, tools=[add])


def test_I2_sft_and_grpo_on_the_original_template_pass_and_older_fingerprints_compare_as_before(
        tiny_llama, grpo_args, tmp_path, caplog):
    """The reverse: SFT without assistant_only_loss renders with the tokenizer's own template and records no other,
    and GRPO with it on multi-turn prompts passes. A fingerprint without ``trained_template`` (written before it was
    recorded) compares the tokenizer's template only, as it did."""
    ckpt = _messages_sft(tiny_llama, tmp_path, "plain", assistant_only_loss=False)
    path = os.path.join(ckpt, templates.FINGERPRINT_FILE)
    assert "trained_template" not in json.load(open(path))
    multi = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 1 + 1?"}]}, {"prompt": MULTI_TURN}])
    grpotrl.GRPOTrainer(model=ckpt, reward_funcs=length_reward, args=grpo_args(), train_dataset=multi)
    from trl.chat_template_utils import get_training_chat_template

    tok = AutoTokenizer.from_pretrained(ckpt)
    templates.save_fingerprint(ckpt, tok, trained_template=tok.chat_template)  # the same template: nothing extra
    assert "trained_sha256" not in json.load(open(path))
    templates.save_fingerprint(ckpt, tok, trained_template=get_training_chat_template(tok))
    with pytest.raises(InvariantError, match="renders prompt 1 otherwise"):
        templates.check_fingerprint(ckpt, tok, tool_sets=[None], prompts=multi)
    with caplog.at_level(logging.WARNING, logger="grpotrl.chat.templates"):  # an environment_factory's tools
        assert templates.check_fingerprint(ckpt, tok, tool_sets=None, prompts=multi, tools_unknown=True) is True
    assert "does not compare how the two render them" in caplog.text
    old = {k: v for k, v in json.load(open(path)).items() if k not in ("trained_template", "trained_sha256")}
    json.dump(old, open(path, "w"))
    assert templates.check_fingerprint(ckpt, tok, tool_sets=[None], prompts=multi) is True
