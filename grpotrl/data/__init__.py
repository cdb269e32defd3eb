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
    file), where ``datasets`` would ignore it. A ``load_dataset`` source's splits come as ``ConfigSplits`` (they
    remember the config), so that ``pick_split`` can name the other configs that hold a split this one lacks.
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
        return ConfigSplits(datasets.load_dataset(name, name=config), config)
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


class ConfigSplits(dict):
    """Split name -> ``datasets.Dataset`` of one config of a ``datasets.load_dataset`` source, with the ``config`` it
    was loaded with (None: the dataset's only or default config)."""

    def __init__(self, splits, config: str | None):
        super().__init__(splits)
        self.config = config


def _configs_with_split(name: str, config: str | None, split: str) -> str:
    """A sentence for a refusal of ``split``, which config ``config`` of the ``load_dataset`` source ``name`` lacks:
    the other configs that hold it ("split 'test' is in config 'b', not 'a': set dataset_config: b"), and those whose
    splits cannot be known without loading data; "" when there is no other config. Metadata only, no rows read: each
    config's ``data_files`` as the builder resolved them (a README's ``configs``, or a folder's files by name). A Hub
    id offline loads through the datasets cache, whose builder lists no configs: their names come from the README in
    the Hugging Face cache, and each one's splits from the ``dataset_info.json`` written when it was prepared."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(name, config)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as err:
        return f" The other configs of {name!r} cannot be listed ({_first_line(err)})."
    current = builder.config.name
    others = [c for c in (list(builder.builder_configs) or _cached_card_configs(name)) if c != current]
    if not builder.builder_configs and not others:
        return (f" Other configs of {name!r}, if any, cannot be listed: it loaded from the datasets cache, and no "
                "README in the Hugging Face cache names its configs.")
    found, unknown = [], []
    for other in others:
        files = getattr(builder.builder_configs.get(other), "data_files", None)
        splits, why = ([str(s) for s in files], None) if files else _prepared_splits(name, other)
        if splits is None:
            unknown.append(f"{other!r} ({why})")
        elif split in splits:
            found.append(other)
    text = ""
    if found:
        text += (f" Split {split!r} is in config{'s' if len(found) > 1 else ''} {', '.join(map(repr, found))}, not "
                 f"{current!r}: set dataset_config: {found[0]} (`--dataset_config {found[0]}`).")
    if unknown:
        text += (f" Config{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} may hold it: "
                 f"{'their' if len(unknown) > 1 else 'its'} splits cannot be known without loading data.")
    return text


def _prepared_splits(name: str, config: str) -> tuple[list[str] | None, str | None]:
    """``(split names, None)`` of ``config`` from the dataset info ``datasets`` holds without reading rows (offline: the
    ``dataset_info.json`` of its prepared cache), or ``(None, why not)``."""
    import datasets

    try:
        info_splits = datasets.load_dataset_builder(name, config).info.splits
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as err:
        return None, _first_line(err)
    return ([str(s) for s in info_splits], None) if info_splits else (None, "its dataset info names no splits")


def _cached_card_configs(name: str) -> list[str]:
    """The config names in the README (dataset card) of the Hub dataset ``name`` in the Hugging Face cache; [] when
    there is none there, or it does not parse."""
    import yaml
    from huggingface_hub import DatasetCard, try_to_load_from_cache

    try:
        readme = try_to_load_from_cache(name, "README.md", repo_type="dataset")  # ValueError: not a Hub id
        configs = DatasetCard.load(readme).data.to_dict().get("configs") if isinstance(readme, str) else None
    except (OSError, ValueError, yaml.YAMLError):
        return []
    configs = configs if isinstance(configs, list) else []
    return [c["config_name"] for c in configs if isinstance(c, dict) and isinstance(c.get("config_name"), str)]


# The split each dataset was picked as, for error messages (``Dataset.split`` is None for data files
# and save_to_disk folders): dataset -> its split name, as long as the dataset lives.
SPLIT_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pick_split(splits, split: str, name: str):
    """``splits[split]``, or an ``InputError`` naming the splits there are (for ``ConfigSplits``, also the other
    configs that hold ``split``: ``_configs_with_split``); the name is remembered
    (``SPLIT_NAMES``) so that later errors about its rows name the split as the recipe does."""
    if split not in splits:
        single = " (a single data file is the 'train' split only)" if os.path.isfile(os.path.expanduser(name)) else ""
        elsewhere = _configs_with_split(name, splits.config, split) if isinstance(splits, ConfigSplits) else ""
        raise InputError(f"Dataset {name!r} has splits {list(splits)}, not {split!r}{single}. Set "
                         "dataset_train_split / dataset_test_split to one of those (or eval_strategy: 'no')."
                         + elsewhere)
    SPLIT_NAMES[splits[split]] = split  # a datasets.Dataset / IterableDataset: weak-referenceable
    return splits[split]


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400].rstrip(".")
