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
