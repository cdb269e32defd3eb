"""The datasets shipped with grpotrl. quickstart: small-integer arithmetic with checkable answers;
multitask: the same arithmetic (task hallucination) beside fairness questions (task fairness).

quickstart: 240 rows made by ``scripts/make_quickstart_data.py`` (200 train, 40 test), each
with ``prompt`` (one user message), ``answer`` (a string such as ``"12"``) and ``completion``
(one assistant message holding just the answer, for SFT). GRPO reads ``prompt`` and passes
``answer`` to the reward functions; SFT reads ``prompt`` and ``completion``.
multitask: 144 rows made by ``scripts/make_multitask_data.py`` (120 train, 24 test), with
``prompt``, ``task``, ``answer`` (hallucination rows) and ``groups`` (fairness rows).
gad_toy: 200 rows made by ``scripts/make_gad_toy_data.py`` (train only): the quickstart's train
questions with ``answer``, a teacher's ``teacher_response`` and the same as ``completion``.

``load_splits`` is what a recipe's ``dataset_name`` goes through: a shipped name, a
``save_to_disk`` folder, or anything ``datasets.load_dataset`` takes (a local data file or
folder, a Hub id), handed to it unchanged.
"""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

from ..errors import InputError

QUICKSTART_FILE = Path(__file__).resolve().parent / "quickstart.jsonl"
MULTITASK_FILE = Path(__file__).resolve().parent / "multitask.jsonl"
GAD_TOY_FILE = Path(__file__).resolve().parent / "gad_toy.jsonl"
SHIPPED = {"quickstart": QUICKSTART_FILE, "multitask": MULTITASK_FILE, "gad_toy": GAD_TOY_FILE}


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
    """A split of a dataset shipped with grpotrl (``quickstart``, ``multitask`` or ``gad_toy``).

    >>> len(load_shipped("gad_toy")), load_shipped("gad_toy").column_names
    (200, ['prompt', 'answer', 'teacher_response', 'completion'])
    """
    return pick_split(_shipped_splits(name), split, name)


def _shipped_splits(name: str) -> dict:
    """Split name -> ``datasets.Dataset`` of a shipped file; rows without a ``split`` field are train."""
    from datasets import Dataset

    if name not in SHIPPED:
        raise InputError(f"grpotrl ships the datasets {list(SHIPPED)}, not {name!r}.")
    by_split: dict[str, list] = {}
    with open(SHIPPED[name]) as f:
        for line in f:
            row = json.loads(line)
            by_split.setdefault(row.pop("split", "train"), []).append(row)
    return {split: Dataset.from_list(rows) for split, rows in by_split.items()}


def load_splits(name: str, config: str | None = None):
    """Every split of a recipe's dataset, as a mapping split -> ``datasets.Dataset``:

    * a shipped name (``SHIPPED``);
    * a ``save_to_disk`` folder (``datasets.load_from_disk``; a saved single Dataset is the
      ``train`` split);
    * anything else goes to ``datasets.load_dataset(name, name=config)`` unchanged, as TRL's
      scripts do: a local data file or folder (json/jsonl/parquet/csv, in subfolders too, as a Hub
      dataset lays them out; a single file is the ``train`` split), or a Hub id (downloaded and cached
      by ``datasets``; offline, from its cache).

    A dataset that cannot be found or read is one ``InputError``; so is a ``config`` the dataset does not have
    (naming those it has, as ``datasets`` lists them), no ``config`` for a Hub dataset or folder with several and no
    default, and a ``config`` for a source that has none (a shipped name, a ``save_to_disk`` folder, a single data
    file), where ``datasets`` would ignore it.
    """
    import datasets

    if name in SHIPPED:
        if config:
            raise InputError(f"dataset_config {config!r} was given, but the shipped dataset {name!r} has no "
                             "configs. Drop dataset_config.")
        return _shipped_splits(name)
    path = os.path.expanduser(name)
    if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")):
        _refuse_config(config, name, "a save_to_disk folder, which has no configs (load_from_disk takes none)")
        try:
            saved = datasets.load_from_disk(path)
        except (OSError, ValueError) as err:
            raise InputError(f"dataset_name {name!r} looks like a save_to_disk folder but cannot be read: "
                             f"{_first_line(err)}. Save it again with Dataset(Dict).save_to_disk.") from None
        return dict(saved) if isinstance(saved, datasets.DatasetDict) else {"train": saved}
    from .checks import check_data_file, load_error_cause

    local_files = [path] if os.path.isfile(path) else _data_folder_files(path) if os.path.isdir(path) else []
    for file in local_files:  # empty or not UTF-8: datasets raises StopIteration or fails at the first row read
        check_data_file(file)
    if os.path.isdir(path) and not any(f.lower().endswith((".json", ".jsonl", ".parquet", ".csv", ".arrow", ".txt"))
                                       for f in local_files):
        raise InputError(f"dataset_name {name!r} is a folder with no data files (found: "
                         f"{', '.join(sorted(os.listdir(path))[:12]) or 'nothing'}). Put train.jsonl (and test.jsonl) "
                         "there, json/jsonl/parquet/csv, or point dataset_name at a data file.")
    if os.path.isfile(path):
        _refuse_config(config, name, "a single data file, which has no configs (its rows are the 'train' split; "
                       "datasets would only label its cache with the name)")
    try:
        if os.path.isfile(path):  # one data file: load_dataset takes its format's builder, the file as 'train'
            from datasets.packaged_modules import _EXTENSION_TO_MODULE

            ext = os.path.splitext(path)[1].lower()
            if ext not in _EXTENSION_TO_MODULE:
                raise InputError(f"dataset_name {name!r} is a file of unknown format {ext!r}; use one of "
                                 f"{sorted(_EXTENSION_TO_MODULE)} (json/jsonl/parquet/csv), or a folder of them.")
            builder, kwargs = _EXTENSION_TO_MODULE[ext]
            return dict(datasets.load_dataset(builder, data_files=path, **kwargs))
        return dict(datasets.load_dataset(name, name=config))
    except (OSError, ValueError, StopIteration, datasets.exceptions.DatasetsError) as err:
        where = (f"the local path {os.path.abspath(path)}" if os.path.exists(path)
                 else "a local path (none exists there) or a dataset on the Hugging Face Hub")
        if isinstance(err, ValueError) and "config" in str(err).lower():  # datasets names the configs there are
            raise InputError(
                f"Cannot load dataset_name {name!r} " + (f"with dataset_config {config!r}" if config else
                                                          "without a dataset_config")
                + f" as {where}: {_config_message(err)}. Set dataset_config to one of the configs named there "
                "(`--dataset_config NAME` on the command line)."
            ) from None
        cause = load_error_cause(path, err) if os.path.exists(path) else _first_line(err)  # not datasets' wrapper
        raise InputError(
            f"Cannot load dataset_name {name!r}" + (f" with dataset_config {config!r}" if config else "")
            + f" as {where}: {cause}. Use a shipped dataset {list(SHIPPED)}, a local data file or "
            "folder (json/jsonl/parquet/csv), a save_to_disk folder, or a Hub dataset id (with network, or "
            "already in the datasets cache when offline); check dataset_config against the configs it lists."
        ) from None


def _data_folder_files(folder: str) -> list[str]:
    """The files of a local dataset folder, in its subfolders too (a Hub dataset's layout: ``data/train-*.parquet``,
    or the folders a README's ``configs`` name), as ``load_dataset`` finds them: hidden names left out."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, f) for f in sorted(files) if not f.startswith(".")]
    return found


def _refuse_config(config: str | None, name: str, what: str) -> None:
    """``InputError`` when a ``dataset_config`` is given for ``name``, which is ``what`` (a source without configs)."""
    if config:
        raise InputError(f"dataset_config {config!r} was given, but dataset_name {name!r} is {what}. Drop "
                         "dataset_config, or point dataset_name at a dataset that has that config.")


def _config_message(err: ValueError) -> str:
    """datasets' message about a config it cannot load, on one line: the configs it lists are on its later
    lines; its Python usage examples (``load_dataset(...)``) are left out."""
    lines = [line.strip() for line in str(err).strip().splitlines()]
    kept = [line for line in lines if line and "load_dataset(" not in line and line != "Example of usage:"]
    return " ".join(line.removesuffix(", e.g.").rstrip(".") + "." for line in kept).rstrip(".")[:600]


# The split each dataset was picked as, for error messages (``Dataset.split`` is None for data files
# and save_to_disk folders): dataset -> its split name, as long as the dataset lives.
SPLIT_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pick_split(splits, split: str, name: str):
    """``splits[split]``, or an ``InputError`` naming the splits there are; the name is remembered
    (``SPLIT_NAMES``) so that later errors about its rows name the split as the recipe does."""
    if split not in splits:
        single = " (a single data file is the 'train' split only)" if os.path.isfile(os.path.expanduser(name)) else ""
        raise InputError(f"Dataset {name!r} has splits {list(splits)}, not {split!r}{single}. Set "
                         "dataset_train_split / dataset_test_split to one of those (or eval_strategy: 'no').")
    SPLIT_NAMES[splits[split]] = split  # a datasets.Dataset / IterableDataset: weak-referenceable
    return splits[split]


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400].rstrip(".")
