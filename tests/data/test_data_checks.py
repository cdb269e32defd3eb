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
