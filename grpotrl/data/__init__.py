"""The quickstart dataset shipped with grpotrl: small-integer arithmetic with checkable answers.

240 rows made by ``scripts/make_quickstart_data.py`` (200 train, 40 test), each with
``prompt`` (one user message), ``answer`` (a string such as ``"12"``) and ``completion``
(one assistant message holding just the answer, for SFT). GRPO reads ``prompt`` and passes
``answer`` to the reward functions; SFT reads ``prompt`` and ``completion``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError

QUICKSTART_FILE = Path(__file__).resolve().parent / "quickstart.jsonl"
SPLITS = ("train", "test")


def load_quickstart(split: str = "train"):
    """The quickstart split as a ``datasets.Dataset`` with columns prompt, answer, completion.

    >>> ds = load_quickstart("test")
    >>> len(ds), ds.column_names
    (40, ['prompt', 'answer', 'completion'])
    """
    from datasets import Dataset

    if split not in SPLITS:
        raise InputError(f"The quickstart dataset has splits {list(SPLITS)}, not {split!r}. Use one of those.")
    with open(QUICKSTART_FILE) as f:
        rows = [json.loads(line) for line in f]
    rows = [{k: v for k, v in row.items() if k != "split"} for row in rows if row["split"] == split]
    return Dataset.from_list(rows)
