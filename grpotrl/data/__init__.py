"""The datasets shipped with grpotrl. quickstart: small-integer arithmetic with checkable answers;
multitask: the same arithmetic (task hallucination) beside fairness questions (task fairness).

quickstart: 240 rows made by ``scripts/make_quickstart_data.py`` (200 train, 40 test), each
with ``prompt`` (one user message), ``answer`` (a string such as ``"12"``) and ``completion``
(one assistant message holding just the answer, for SFT). GRPO reads ``prompt`` and passes
``answer`` to the reward functions; SFT reads ``prompt`` and ``completion``.
multitask: 144 rows made by ``scripts/make_multitask_data.py`` (120 train, 24 test), with
``prompt``, ``task``, ``answer`` (hallucination rows) and ``groups`` (fairness rows).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError

QUICKSTART_FILE = Path(__file__).resolve().parent / "quickstart.jsonl"
MULTITASK_FILE = Path(__file__).resolve().parent / "multitask.jsonl"
SHIPPED = {"quickstart": QUICKSTART_FILE, "multitask": MULTITASK_FILE}
SPLITS = ("train", "test")


def load_quickstart(split: str = "train"):
    """The quickstart split as a ``datasets.Dataset`` with columns prompt, answer, completion.

    >>> ds = load_quickstart("test")
    >>> len(ds), ds.column_names
    (40, ['prompt', 'answer', 'completion'])
    """
    return load_shipped("quickstart", split)


def load_multitask(split: str = "train"):
    """The two-task split (``scripts/make_multitask_data.py``): ``task`` is ``fairness`` (reward
    ``even_handed`` on ``groups``) or ``hallucination`` (``exact_answer`` on ``answer``).

    >>> ds = load_multitask("test")
    >>> len(ds), ds.column_names, sorted(set(ds["task"]))
    (24, ['prompt', 'answer', 'groups', 'task'], ['fairness', 'hallucination'])
    """
    return load_shipped("multitask", split)


def load_shipped(name: str, split: str = "train"):
    """A split of a dataset shipped with grpotrl (``quickstart`` or ``multitask``)."""
    from datasets import Dataset

    if name not in SHIPPED:
        raise InputError(f"grpotrl ships the datasets {list(SHIPPED)}, not {name!r}.")
    if split not in SPLITS:
        raise InputError(f"The {name} dataset has splits {list(SPLITS)}, not {split!r}. Use one of those.")
    with open(SHIPPED[name]) as f:
        rows = [json.loads(line) for line in f]
    rows = [{k: v for k, v in row.items() if k != "split"} for row in rows if row["split"] == split]
    return Dataset.from_list(rows)
