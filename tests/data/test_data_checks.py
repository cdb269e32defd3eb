"""Dataset checks (``grpotrl.data.checks``) on inputs a user meets: streams as well as map-style datasets."""

import pytest
from datasets import Dataset, IterableDataset

from grpotrl.data import checks
from grpotrl.errors import InputError

CHAT = {"prompt": [{"role": "user", "content": "What is 7 + 5?"}]}
PLAIN = {"prompt": "What is 7 + 5?"}


def _stream(rows):
    def gen():
        yield from rows

    return IterableDataset.from_generator(gen)


@pytest.mark.parametrize("first", ["chat", "plain"])
def test_a_stream_mixing_chat_and_plain_prompts_in_its_checked_rows_is_refused(first):
    """TRL formats a batch by its first row, so a stream whose first rows mix chat and plain-text prompts fails
    at the first step (``TypeError: string indices must be integers``), after the model loaded: the check refuses
    the mix in the rows it reads from the stream, naming the rows. (Arrow cannot hold the mix in a map-style
    ``Dataset``; a stream from a generator holds anything.)"""
    rows = [CHAT] * 5 + [PLAIN] if first == "chat" else [PLAIN] + [CHAT] * 5
    plain_row = 5 if first == "chat" else 0
    with pytest.raises(InputError, match=rf"'train' split mixes chat prompts .*plain-text prompts \(row {plain_row}\)"):
        checks.check_dataset(_stream(rows), "train", kind="grpo")


def test_a_stream_of_one_prompt_kind_passes():
    """Controls: all chat, or all plain text, passes in a stream as in a map-style dataset."""
    checks.check_dataset(_stream([CHAT] * 4), "train", kind="grpo")
    checks.check_dataset(_stream([PLAIN] * 4), "train", kind="grpo")


SYSTEM = {"role": "system", "content": "Answer with just the number."}


@pytest.mark.parametrize("prompt, why", [
    ([{"role": "user", "content": ""}], r"prompt is 1 message with empty content"),
    ([{"role": "system", "content": " "}, {"role": "user", "content": "\n"}],
     r"prompt is 2 messages with empty content"),
    ([SYSTEM, {"role": "user", "content": ""}], r"prompt\[1\], its last user message, has empty content ''"),
    ([{"role": "user", "content": "What is 7 + 5?"}, {"role": "assistant", "content": "12"},
      {"role": "user", "content": "  "}], r"prompt\[2\], its last user message, has empty content '  '"),
    ([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
      {"role": "user", "content": [{"type": "text", "text": ""}]}], r"prompt\[1\], its last user message"),
])
def test_a_chat_prompt_with_no_question_is_refused_as_a_blank_text_prompt_is(prompt, why):
    """A chat prompt whose messages are all empty, or whose last user message is, renders with no question (the
    model is sampled on the template's headers alone), like the plain prompt "" that is already refused; both name
    the row."""
    asked = [{**m, "content": [{"type": "text", "text": "What is 7 + 5?"}] if isinstance(m["content"], list)
              else "What is 7 + 5?"} for m in prompt]  # the same shape with text: rows 0 and 1 pass
    rows = [{"prompt": asked}, {"prompt": asked}, {"prompt": prompt}]
    with pytest.raises(InputError, match=rf"Row 2 of the 'train' split \(GRPO\): {why}"):
        checks.check_dataset(Dataset.from_list(rows), "train", kind="grpo")
    with pytest.raises(InputError, match=rf"Row 2 of the 'train' split \(GRPO\): {why}"):
        checks.check_dataset(_stream(rows), "train", kind="grpo")
    with pytest.raises(InputError, match=r"Row 1 of the 'train' split \(GRPO\): prompt is an empty string"):
        checks.check_dataset(Dataset.from_list([PLAIN, {"prompt": ""}]), "train", kind="grpo")  # the plain one


def test_a_chat_prompt_with_a_question_passes_whatever_else_is_empty():
    """Controls: an empty system message before a real user turn, an empty earlier user turn, an image with no
    text, a prompt ending in tool results, and, with an environment_factory (TRL appends its reset() text to the
    last message; its own placeholder is one user message with content ""), an empty chat prompt."""
    rows = [
        {"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "What is 7 + 5?"}]},
        {"prompt": [{"role": "user", "content": ""}, {"role": "assistant", "content": "Ask away."},
                    {"role": "user", "content": "What is 7 + 5?"}]},
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ""}]}]},
        {"prompt": [{"role": "user", "content": "What is 3 x 4?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]},
                    {"role": "tool", "name": "multiply", "content": "12"}]},
    ]
    for row in rows:
        checks.check_dataset(_stream([row]), "train", kind="grpo")
    checks.check_dataset(Dataset.from_list([{"prompt": [{"role": "user", "content": ""}]}] * 2), "train",
                         kind="grpo", prompt_optional=True)


# ---------------------------------------------------------------- SFT rows with no answer

Q = {"role": "user", "content": "What is 7 + 5?"}
A = {"role": "assistant", "content": "12"}
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 7, "b": 5}}}]}


EMPTY_TURN = {"messages": [Q, {"role": "assistant", "content": ""}]}


def _filter_in(message: str):
    """The function the error's ``dataset.filter(...)`` advice names, evaluated."""
    import re

    return eval(re.search(r"`dataset\.filter\((.*)\)`", message).group(1))  # noqa: S307  our own message


@pytest.mark.parametrize("answered, empty, why", [
    ({"messages": [Q, A]}, {"messages": [Q, {"role": "assistant", "content": ""}]},
     r"messages\[1\] \(role 'assistant'\) has content '' and no tool_calls"),
    ({"messages": [Q, A, Q, A]}, {"messages": [Q, {"role": "assistant", "content": " \n"}, Q, A]},
     r"messages\[1\] \(role 'assistant'\) has content ' \\n'"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
     {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]},
     r"conversations\[1\] \(role 'gpt'\) has content ''"),
    ({"prompt": [Q], "completion": [A]}, {"prompt": [Q], "completion": [{"role": "assistant", "content": ""}]},
     r"completion\[0\] \(role 'assistant'\) has content ''"),
    ({"prompt": "7 + 5 =", "completion": " 12"}, {"prompt": "7 + 5 =", "completion": ""}, r"'completion' is ''"),
    ({"prompt": "7 + 5 =", "completion": " 12"}, {"prompt": "7 + 5 =", "completion": "  "}, r"'completion' is '  '"),
    ({"text": "7 + 5 = 12"}, {"text": ""}, r"'text' is ''"),
])
def test_an_sft_row_whose_answer_is_empty_is_refused_naming_rows_column_and_the_filter(answered, empty, why):
    """trl.SFTTrainer trains a row whose assistant turn (or completion) is empty on its end-of-turn token alone
    (``<|im_end|>`` after the generation prompt, on SmolLM2): the one-token completion the health signals watch
    for in RL, taught in SFT. A text row "" is the end-of-document token alone. The check refuses such rows
    whatever their share, a map-style dataset's every row and a stream's first rows, naming the first rows, the
    column and a ``dataset.filter`` that keeps the answered rows; that filter makes the dataset pass."""
    rows = [answered] * 3 + [empty] + [answered] * 2 + [empty]
    for dataset in (Dataset.from_list(rows), _stream(rows)):
        with pytest.raises(InputError, match=rf"'train' split \(SFT\) has rows with an empty answer \(rows 3, 6\); "
                                             rf"row 3: {why}.*one-token completion") as err:
            checks.check_dataset(dataset, "train", kind="sft")
        kept = dataset.filter(_filter_in(str(err.value)))
        checks.check_dataset(kept, "train", kind="sft")
        assert len(list(kept)) == 5


def test_the_filter_an_empty_answer_error_suggests_keeps_every_turn_the_check_takes():
    """A turn whose content is blank but that reasons (``reasoning_content``) or calls a tool has an answer: the
    suggested filter keeps it and drops only the empty turn."""
    reasoning = {"messages": [Q, {"role": "assistant", "content": "", "reasoning_content": "7 + 5 is 12."}]}
    calling = {"messages": [Q, {**CALL, "content": ""}, {"role": "tool", "content": "12"}, A]}
    dataset = Dataset.from_list([reasoning, EMPTY_TURN, calling])
    with pytest.raises(InputError, match=r"empty answer \(row 1\)") as err:
        checks.check_dataset(dataset, "train", kind="sft")
    kept = dataset.filter(_filter_in(str(err.value)))["messages"]  # Arrow gives every message every key
    assert [(m[1]["reasoning_content"], bool(m[1]["tool_calls"])) for m in kept] == [("7 + 5 is 12.", False),
                                                                                     (None, True)]


def test_one_stray_empty_answer_among_many_rows_is_refused():
    """A share too small to see in the metrics is still refused: filtering it costs one line."""
    rows = [{"prompt": "7 + 5 =", "completion": f" {i}"} for i in range(2_000)]
    rows[1_997] = {"prompt": "7 + 5 =", "completion": ""}
    with pytest.raises(InputError, match=r"\(row 1997\); row 1997: 'completion' is ''"):
        checks.check_dataset(Dataset.from_list(rows), "train", kind="sft")


def test_an_sft_turn_with_tool_calls_or_reasoning_but_no_text_has_an_answer():
    """Controls: an assistant turn that only calls a tool (content None or ""), one whose answer is its reasoning,
    an image answer, and empty system or user messages train real tokens, and pass; so do rows with a
    ``formatting_func`` (the function's text is its business)."""
    reasoning = {"role": "assistant", "content": "", "reasoning_content": "7 + 5 is 12."}
    image = {"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": ""}]}
    for rows in ([{"messages": [Q, CALL, {"role": "tool", "content": "12"}, A]}],
                 [{"messages": [Q, {**CALL, "content": ""}, {"role": "tool", "content": "12"}, A]}],
                 [{"messages": [{"role": "system", "content": ""}, Q, reasoning]}],
                 [{"messages": [{"role": "user", "content": ""}, A]}],
                 [{"prompt": [Q], "completion": [CALL, {"role": "tool", "content": "12"}, A]}],
                 [{"prompt": [Q], "completion": [image]}]):
        checks.check_dataset(_stream(rows), "train", kind="sft")
    checks.check_dataset(Dataset.from_list([{"text": ""}]), "train", kind="sft", formatting_func=lambda r: "x")


def test_an_empty_assistant_turn_in_a_trained_prompt_is_refused_only_when_the_prompt_is_trained():
    """With ``completion_only_loss=False`` TRL 1.16 labels the whole prompt + completion (its labels take the
    completion mask only when completion_only_loss is true; None resolves to true for prompt-completion rows), so an
    assistant turn of the prompt with blank content and no tool calls trains its end-of-turn token alone, as an empty
    completion does: refused with the completion's empty answers, naming the rows and a ``dataset.filter`` over prompt
    and completion that makes the dataset pass. Under the default (None) and true the prompt is masked: accepted."""
    import inspect

    import trl

    assert 'self.completion_only_loss = "prompt" in dataset_sample and "completion" in dataset_sample' in \
        inspect.getsource(trl.SFTTrainer.__init__)  # None: True exactly for prompt-completion rows
    assert 'if self.completion_only_loss and "completion_mask" in column_names' in \
        inspect.getsource(trl.SFTTrainer._prepare_dataset)  # False: the prompt's tokens are labelled

    answered = {"prompt": [Q, A, Q], "completion": [A]}
    calling = {"prompt": [Q, CALL, {"role": "tool", "content": "12"}, Q], "completion": [A]}  # a tool call answers
    empty_turn = {"prompt": [Q, {"role": "assistant", "content": ""}, Q], "completion": [A]}
    empty_completion = {"prompt": [Q], "completion": [{"role": "assistant", "content": " "}]}
    rows = [answered, calling, answered, empty_turn, answered, answered, empty_completion]
    for dataset in (Dataset.from_list(rows), _stream(rows)):
        with pytest.raises(InputError, match=r"'train' split \(SFT\) has rows with an empty answer \(rows 3, 6\); "
                                             r"row 3: prompt\[1\] \(role 'assistant'\) has content '' and no "
                                             r"tool_calls\. With completion_only_loss=False TRL trains the prompt's "
                                             r"tokens too.*an empty one teaches the model to answer with its "
                                             r"end-of-turn token alone") as err:
            checks.check_dataset(dataset, "train", kind="sft", completion_only_loss=False)
        kept = dataset.filter(_filter_in(str(err.value)))
        checks.check_dataset(kept, "train", kind="sft", completion_only_loss=False)
        assert len(list(kept)) == 5
        with pytest.raises(InputError, match=r"empty answer \(row 6\); row 6: completion\[0\]"):
            checks.check_dataset(dataset, "train", kind="sft")  # the default masks the prompt: its completion only
    masked = Dataset.from_list([answered, calling, empty_turn])
    for completion_only_loss in (None, True):
        checks.check_dataset(masked, "train", kind="sft", completion_only_loss=completion_only_loss)
    checks.check_dataset(_stream([answered, calling, empty_turn]), "train", kind="sft")


# ---------------------------------------------------------------- GRPO environments need chat prompts

@pytest.mark.parametrize("prompt", ["What is 7 + 5?", ""])
def test_plain_text_prompts_with_an_environment_factory_are_refused_before_the_model_loads(prompt):
    """With an environment_factory TRL 1.16 appends each environment's reset() text to ``prompt[-1]['content']``
    (and reads completions as chat messages for tool calls): on a plain-text prompt that is a ``TypeError:
    string indices must be integers`` (``IndexError`` on "") at the first step, after the model loaded. The check
    refuses it (``prompt_optional`` is set exactly when an environment_factory is given), map-style or streamed;
    the same rows without an environment pass (non-blank ones), as do chat prompts with one."""
    rows = [{"prompt": prompt, "start": i} for i in range(3)]
    for dataset in (Dataset.from_list(rows), _stream(rows)):
        with pytest.raises(InputError, match=r"'train' split has plain-text prompts \(row 0: .*environment_factory"
                                             r".*Make every prompt a list of chat messages"):
            checks.check_dataset(dataset, "train", kind="grpo", prompt_optional=True)
    chat = Dataset.from_list([{"prompt": [{"role": "user", "content": prompt}], "start": i} for i in range(3)])
    checks.check_dataset(chat, "train", kind="grpo", prompt_optional=True)
    if prompt:
        checks.check_dataset(Dataset.from_list(rows), "train", kind="grpo")


def test_the_filter_an_empty_answer_error_suggests_takes_multimodal_parts():
    """Multimodal messages hold their content as a list of parts: a turn whose text parts are all blank is empty
    (the check refuses it), one with an image part or a non-blank text part answers. The suggested filter reads
    parts too (a filter that called ``.strip()`` on the list would fail on the first row), and makes the dataset
    pass, keeping exactly the answered rows."""
    def turn(*parts):
        return {"role": "assistant", "content": list(parts)}

    question = {"role": "user", "content": [{"type": "text", "text": "What is 7 + 5?"}]}
    text, blank, image = {"type": "text", "text": "12"}, {"type": "text", "text": " "}, {"type": "image"}
    rows = [{"messages": [question, turn(text)]}, {"messages": [question, turn(blank)]},
            {"messages": [question, turn(blank, image)]}, {"messages": [question, turn()]}]
    dataset = Dataset.from_list(rows)
    with pytest.raises(InputError, match=r"empty answer \(rows 1, 3\)") as err:
        checks.check_dataset(dataset, "train", kind="sft")
    kept = dataset.filter(_filter_in(str(err.value)))
    checks.check_dataset(kept, "train", kind="sft")
    assert [len(m[1]["content"]) for m in kept["messages"]] == [1, 2]


def test_the_filter_an_empty_answer_error_suggests_reads_each_turn_as_it_is_stored():
    """With completion_only_loss=False the prompt's assistant turns are trained too, and a prompt may hold its
    content as strings while the completion holds parts: the suggested filter reads each message as it is stored
    (a string's characters are not parts), and keeps exactly the answered rows."""
    prompt = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "an earlier answer"},
              {"role": "user", "content": "q2"}]
    rows = [{"prompt": prompt, "completion": [{"role": "assistant", "content": [{"type": "text", "text": a}]}]}
            for a in ("ok", " ", "yes")]
    dataset = Dataset.from_list(rows)
    with pytest.raises(InputError, match=r"empty answer \(row 1\)") as err:
        checks.check_sft_dataset(dataset, "train", completion_only_loss=False)
    kept = dataset.filter(_filter_in(str(err.value)))
    checks.check_sft_dataset(kept, "train", completion_only_loss=False)
    assert [m[0]["content"][0]["text"] for m in kept["completion"]] == ["ok", "yes"]
