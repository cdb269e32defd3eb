"""Checks on user input that run before any model is loaded; each raises ``InputError``
saying what was wrong, with the value, and what to do.

* ``check_dataset``: GRPO needs a ``prompt`` column; SFT needs ``prompt`` + ``completion``
  or ``messages``; the first bad row is named by its index.
* ``check_model_dir``: a local checkpoint with ``config.json`` and complete weights (every
  shard of a sharded one; safetensors files not truncated), or a PEFT adapter dir whose base
  model passes the same check (Hub ids: ``grpotrl.hub.check_model_source``).
* ``check_resume_checkpoint`` / ``find_last_checkpoint``: a ``checkpoint-N`` dir that a SIGKILL
  during the save did not cut short: trainer state, weights, optimizer, scheduler, RNG and the
  files the trainer adds (``checkpoint_problems``), each present and not truncated.
* ``resolve_reward_funcs`` / ``check_reward_columns``: reward names from a recipe to the
  functions of ``grpotrl.rewards.rules``, and the dataset columns those functions need.
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import re
import struct
import zipfile

from .errors import InputError
from .rewards import rules

ROLES = ("system", "developer", "user", "assistant", "tool")

REWARD_FUNCS = {
    "exact_answer": rules.exact_answer_reward,
    "format": rules.format_reward,
    "length": rules.length_penalty,
    "even_handed": rules.even_handed_reward,
}

# Keyword arguments TRL's GRPOTrainer passes to every reward function besides the dataset columns.
_TRAINER_REWARD_KWARGS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"}


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------

def _messages_problem(value, what: str, last_role: str | None = None, min_len: int = 1) -> str | None:
    """Why ``value`` is not a list of chat messages, or None when it is."""
    if not isinstance(value, list):
        return f"{what} is a {type(value).__name__}, not a list of messages"
    if len(value) < min_len:
        return f"{what} has {len(value)} messages, needs at least {min_len}"
    for j, message in enumerate(value):
        if not isinstance(message, dict):
            return f"{what}[{j}] is a {type(message).__name__}, not a dict with 'role' and 'content'"
        if message.get("role") not in ROLES:
            return f"{what}[{j}] has role {message.get('role')!r}, not one of {list(ROLES)}"
        if not isinstance(message.get("content"), (str, list)) and not (message.get("content") is None
                                                                        and message.get("tool_calls")):
            return f"{what}[{j}] (role {message['role']!r}) has content {message.get('content')!r}, not text"
    if last_role is not None and value[-1]["role"] != last_role:
        return f"{what} ends with a {value[-1]['role']!r} message, not an {last_role!r} one"
    return None


def _text_or_messages_problem(value, what: str, last_role: str | None = None) -> str | None:
    if isinstance(value, str):
        return f"{what} is an empty string" if not value.strip() else None
    return _messages_problem(value, what, last_role)


ITERABLE_ROWS_CHECKED = 16  # rows of an IterableDataset (streaming) read before training: its first ones only


def _first_bad_row(dataset, column: str, problem) -> tuple[int, str] | None:
    """(index, why) of the first row whose ``column`` value ``problem`` rejects, or None."""
    values = (row[column] for row in dataset) if isinstance(dataset, list) else dataset[column]  # rows, or a Dataset
    for i, value in enumerate(values):
        why = problem(value)
        if why is not None:
            return i, why
    return None


def _rows_to_check(dataset, split_name: str):
    """``(dataset, columns)``: a map-style dataset as it is; an ``IterableDataset`` (streaming) as a
    list of its first ``ITERABLE_ROWS_CHECKED`` rows, read once (the stream restarts for training)."""
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__") and hasattr(dataset, "column_names"):
        return dataset, dataset.column_names
    if not hasattr(dataset, "__iter__") or isinstance(dataset, (str, bytes, dict)):
        raise InputError(
            f"The {split_name!r} split is a {type(dataset).__name__}, not a datasets.Dataset or IterableDataset. "
            "Load it with `datasets.load_dataset(...)` or `datasets.Dataset.from_list(rows)`."
        )
    rows = list(itertools.islice(iter(dataset), ITERABLE_ROWS_CHECKED))
    columns = getattr(dataset, "column_names", None) or (list(rows[0]) if rows else [])
    return rows, columns


def check_dataset(dataset, split_name: str, kind: str = "grpo", prompt_optional: bool = False) -> None:
    """Raise ``InputError`` unless ``dataset`` has the columns and row shapes ``kind`` needs.

    GRPO: ``prompt``, each row a non-empty list of chat messages (or a non-empty string); with
    ``prompt_optional`` (an ``environment_factory`` supplies prompts) rows may have none.
    SFT: ``prompt`` + ``completion`` (both messages lists, the completion ending with an
    assistant message, or both strings), or ``messages`` (at least one turn before a final
    assistant message), or already tokenized ``input_ids`` (the I2 label guard checks those at run
    time). Plain ``text`` is refused: it bypasses the chat template RL will use (seed bug #1).
    An ``IterableDataset`` (streaming) is checked on its first ``ITERABLE_ROWS_CHECKED`` rows.
    """
    if kind not in ("grpo", "sft"):
        raise ValueError(f"kind must be 'grpo' or 'sft', got {kind!r}")
    dataset, columns = _rows_to_check(dataset, split_name)
    if len(dataset) == 0:
        raise InputError(
            f"The {split_name!r} split is empty (columns {columns}). Point the recipe at a split with rows."
        )
    example = (
        '{"prompt": [{"role": "user", "content": "What is 7 + 5?"}], '
        '"completion": [{"role": "assistant", "content": "12"}]}'
    )
    if kind == "grpo":
        if "prompt" not in columns and prompt_optional:
            return
        if "prompt" not in columns:
            raise InputError(
                f"GRPO needs a 'prompt' column, but the {split_name!r} split has columns {columns}. Each prompt "
                'is a list of chat messages such as [{"role": "user", "content": "What is 7 + 5?"}]. Rename your '
                "question column (`dataset.rename_column(old, 'prompt')`) or map your rows into that shape."
            )
        bad = _first_bad_row(dataset, "prompt", lambda v: _text_or_messages_problem(v, "prompt"))
    elif "prompt" in columns and "completion" in columns:
        prompt, completion = dataset[0]["prompt"], dataset[0]["completion"]
        bad = (
            _first_bad_row(dataset, "prompt", lambda v: _text_or_messages_problem(v, "prompt"))
            or _first_bad_row(dataset, "completion", lambda v: _text_or_messages_problem(v, "completion", "assistant"))
            or (None if isinstance(prompt, str) == isinstance(completion, str) else (
                0, "prompt and completion must both be message lists or both strings, got a "
                   f"{type(prompt).__name__} and a {type(completion).__name__}"))
        )
    elif "messages" in columns:
        bad = _first_bad_row(dataset, "messages", lambda v: _messages_problem(v, "messages", "assistant", min_len=2))
    elif "input_ids" in columns:  # tokenized by the user: the I2 label guard checks it at run time
        bad = _first_bad_row(dataset, "input_ids", lambda v: None if len(v) else "input_ids is empty")
    else:
        raise InputError(
            f"SFT needs 'prompt' + 'completion' columns or a 'messages' column, but the {split_name!r} split has "
            f"columns {columns}. A row looks like {example}. Rename or map your columns into that shape."
        )
    if bad is not None:
        index, why = bad
        raise InputError(
            f"Row {index} of the {split_name!r} split ({kind.upper()}): {why}. A valid row looks like {example} "
            f"(chat messages with role in {list(ROLES)} and text content). Fix or drop that row."
        )


# ---------------------------------------------------------------------------------------------
# Model directories and checkpoints
# ---------------------------------------------------------------------------------------------

def _safetensors_problem(path: str) -> str | None:
    """Why the safetensors file at ``path`` is truncated or unreadable, or None. Reads the header only."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path} is {size} bytes, too short for a safetensors header"
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return f"{path} is {size} bytes but its header alone claims {8 + n}"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return f"{path} has an unreadable safetensors header"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"{path} is {size} bytes, its header says {8 + n + end} (truncated or still being written)"
    return None


WEIGHT_FILES = {"model": ("model.safetensors", "pytorch_model.bin"),
                "adapter": ("adapter_model.safetensors", "adapter_model.bin")}


def _weights_problem(directory: str, kind: str = "model") -> str | None:
    """Why ``directory`` lacks complete ``kind`` weights (single file or every shard of an index), or None."""
    safetensors, bin_name = WEIGHT_FILES[kind]
    for index_name in (safetensors + ".index.json", bin_name + ".index.json"):
        index_path = os.path.join(directory, index_name)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                shards = sorted(set(json.load(f).get("weight_map", {}).values()))
            if not shards:
                return f"{index_name} has an empty weight_map"
            missing = [s for s in shards if not os.path.isfile(os.path.join(directory, s))]
            if missing:
                return f"{index_name} lists shards that are missing: {missing}"
            for shard in shards:
                if shard.endswith(".safetensors") and (problem := _safetensors_problem(os.path.join(directory, shard))):
                    return problem
            return None
    if os.path.isfile(os.path.join(directory, safetensors)):
        return _safetensors_problem(os.path.join(directory, safetensors))
    if os.path.isfile(os.path.join(directory, bin_name)):
        return None
    return f"no {safetensors}, {bin_name} or sharded index"


def _files(directory: str) -> str:
    names = sorted(os.listdir(directory))
    return ", ".join(names[:12]) + (f", ... ({len(names)} files)" if len(names) > 12 else "") if names else "nothing"


def check_model_dir(path: str | None) -> None:
    """Raise ``InputError`` unless ``path`` is a local, complete checkpoint (or PEFT adapter) dir."""
    if not path:
        raise InputError("No model given. Set `model_name_or_path` in the recipe (or pass --model_name_or_path "
                         "DIR): a local checkpoint directory or the alias 'smollm2-135m-instruct'.")
    directory = os.path.expanduser(path)
    if os.path.isdir(directory):
        if os.path.isfile(os.path.join(directory, "adapter_config.json")):
            problem = _weights_problem(directory, "adapter")
            if problem:
                raise InputError(f"PEFT adapter dir {path!r} has incomplete weights: {problem} (found: "
                                 f"{_files(directory)}). Copy the adapter again or pick another checkpoint.")
            with open(os.path.join(directory, "adapter_config.json")) as f:
                base = json.load(f).get("base_model_name_or_path")
            from .hub import check_model_source
            from .models import resolve_model_path

            try:
                check_model_source(resolve_model_path(base) if base else base)
            except InputError as err:
                raise InputError(f"The base model of PEFT adapter {path!r} is not usable: {err}") from None
            return
        if not os.path.isfile(os.path.join(directory, "config.json")):
            raise InputError(
                f"Model dir {path!r} has no config.json (found: {_files(directory)}). Point "
                "`model_name_or_path` at the directory that holds config.json and the weights (for a training "
                "run, its output_dir or one of its checkpoint-N dirs)."
            )
        problem = _weights_problem(directory, "model")
        if problem:
            raise InputError(
                f"Model dir {path!r} has incomplete weights: {problem} (found: {_files(directory)}). The save or "
                "copy that made it did not finish: save or copy it again, or pick another checkpoint."
            )
        return
    if os.path.exists(directory):
        raise InputError(f"Model path {path!r} is a file; `model_name_or_path` must be a directory holding "
                         "config.json and the weights, or a Hugging Face Hub id.")
    from .models import ALIASES

    aliases = ", ".join(repr(a) for a in ALIASES)
    raise InputError(
        f"Model dir {path!r} does not exist (absolute: {os.path.abspath(directory)}). If it is the output of "
        "an earlier run (the GRPO quickstart starts from the SFT quickstart's output), run that first, from the "
        f"directory the path is relative to; otherwise fix the path. Known aliases: {aliases}; a Hugging Face "
        "Hub id (org/name) is loaded from the Hub."
    )


def _torch_file_problem(path: str) -> str | None:
    """Why the ``torch.save`` file at ``path`` is cut short, or None. ``torch.save`` writes a zip
    whose directory sits at the end, so a file killed mid-write has none; reads the directory only."""
    try:
        with zipfile.ZipFile(path) as z:
            z.namelist()
    except (zipfile.BadZipFile, OSError):
        return f"{os.path.basename(path)} is {os.path.getsize(path)} bytes and not a complete torch.save file " \
               "(cut short while being written)"
    return None


def _file_problem(directory: str, name: str) -> str | None:
    """Why ``directory/name`` is missing or cut short (by its kind: safetensors, torch.save, JSON), or None."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return f"no {name}"
    if name.endswith(".safetensors"):
        return _safetensors_problem(path)
    if name.endswith((".pt", ".pth")):
        return _torch_file_problem(path)
    if name.endswith(".json"):
        try:
            with open(path) as f:
                json.load(f)
        except ValueError:
            return f"{name} is not valid JSON (cut short while being written)"
    return None


def checkpoint_problems(path: str, required: tuple[str, ...] = ()) -> list[str]:
    """What keeps ``path`` from being resumed exactly, as a list of reasons (empty: complete).

    The Trainer saves a checkpoint in this order: weights (+ ``required`` files a trainer writes
    beside them: template fingerprint, GAD discriminator), optimizer and scheduler, RNG state,
    and ``trainer_state.json`` last; TRL writes ``entropy_ctrl_state.json`` after that. A SIGKILL
    during the save leaves a prefix of that list, possibly with the last file cut short. The
    Trainer itself would resume from such a directory with a fresh optimizer or RNG without a
    word, so every file is checked: present, and not truncated (headers / zip directories only).
    A DeepSpeed checkpoint (``latest`` + ``global_stepN/``) keeps weights and optimizer there.
    """
    directory = os.path.expanduser(path)
    problems = [p for p in [_file_problem(directory, "trainer_state.json")] if p]
    if os.path.isfile(os.path.join(directory, "latest")):  # DeepSpeed: weights and optimizer in global_stepN/
        with open(os.path.join(directory, "latest")) as f:
            tag = f.read().strip()
        if not tag or not os.path.isdir(os.path.join(directory, tag)):
            problems.append(f"'latest' names DeepSpeed state {tag!r}, which is not there")
    else:
        is_adapter = os.path.isfile(os.path.join(directory, "adapter_config.json"))
        if weights := _weights_problem(directory, "adapter" if is_adapter else "model"):
            problems.append(weights)
        fsdp_optimizer = any(os.path.isdir(os.path.join(directory, n)) and "optimizer" in n
                             for n in os.listdir(directory))
        if not fsdp_optimizer:
            problems += [p for name in ("optimizer.pt", "scheduler.pt") if (p := _file_problem(directory, name))]
    rng = sorted(n for n in os.listdir(directory) if re.fullmatch(r"rng_state(_\d+)?\.pth", n))
    if not rng:
        problems.append("no rng_state.pth")
    problems += [p for name in rng if (p := _file_problem(directory, name))]
    problems += [p for name in required if (p := _file_problem(directory, name))]
    if {"no trainer_state.json", "no optimizer.pt"} & set(problems) == {"no optimizer.pt"} and not rng:
        # trainer_state.json is written last: a kill cannot leave it without the optimizer
        problems.append("trainer_state.json without optimizer or RNG state is what save_only_model=True writes: "
                        "it cannot resume a run, only start a new one with model_name_or_path")
    return problems


def _checkpoints(directory: str) -> list[str]:
    """``checkpoint-N`` names in ``directory``, by step."""
    if not os.path.isdir(directory):
        return []
    names = [n for n in os.listdir(directory) if re.fullmatch(r"checkpoint-\d+", n)
             and os.path.isdir(os.path.join(directory, n))]
    return sorted(names, key=lambda n: int(n.split("-")[1]))


def _complete_checkpoints(directory: str, required: tuple[str, ...] = ()) -> list[str]:
    return [n for n in _checkpoints(directory) if not checkpoint_problems(os.path.join(directory, n), required)]


def check_resume_checkpoint(path: str, required: tuple[str, ...] = ()) -> None:
    """Raise ``InputError`` unless ``path`` is a complete checkpoint dir (``checkpoint_problems``);
    the message names what is missing and the complete checkpoints beside it. Deletes nothing."""
    directory = os.path.expanduser(path)
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.isdir(directory):
        raise InputError(
            f"resume_from_checkpoint {path!r} is not a directory. Complete checkpoints in {parent}: "
            f"{_complete_checkpoints(parent, required) or 'none'}. Pick one, or drop resume_from_checkpoint to "
            "start fresh."
        )
    problems = checkpoint_problems(directory, required)
    if problems:
        others = [c for c in _complete_checkpoints(parent, required)
                  if os.path.join(parent, c) != os.path.abspath(directory)]
        hint = (f"Resume from the newest complete one (--resume_from_checkpoint {os.path.join(parent, others[-1])})"
                if others else "Drop resume_from_checkpoint to start fresh")
        raise InputError(
            f"Checkpoint {path!r} is incomplete: {'; '.join(problems)} (found: {_files(directory)}). The run that "
            f"wrote it was probably killed while saving, and resuming from it would load part of the state. "
            f"Complete checkpoints beside it: {others or 'none'}. {hint}; the incomplete directory is left as it "
            "is (delete it yourself once you no longer need it)."
        )


def find_last_checkpoint(output_dir: str, required: tuple[str, ...] = ()) -> str:
    """The newest ``checkpoint-N`` in ``output_dir`` (for ``resume_from_checkpoint: true``), checked
    by ``check_resume_checkpoint``: when the newest is incomplete that is an error naming it and the
    newest complete one, never a silent step back to an older checkpoint."""
    names = _checkpoints(output_dir)
    if not names:
        raise InputError(
            f"resume_from_checkpoint is true but output_dir {output_dir!r} holds no checkpoint-N dir "
            f"(found: {_files(output_dir) if os.path.isdir(output_dir) else 'no such directory'}). Set "
            "resume_from_checkpoint to a checkpoint path, or drop it to start fresh."
        )
    last = os.path.join(output_dir, names[-1])
    check_resume_checkpoint(last, required)
    return last


# ---------------------------------------------------------------------------------------------
# Reward functions
# ---------------------------------------------------------------------------------------------

def resolve_reward_funcs(names: list[str] | str) -> list | dict:
    """Map reward names from a recipe to functions: ``["exact_answer", "format"]`` -> a list;
    ``["hallucination:exact_answer", "fairness:even_handed"]`` (``task:name``, every entry) -> a
    mapping task -> functions, for MultiTaskGRPOTrainer (rows carry the task in ``task_column``)."""
    names = [names] if isinstance(names, str) else list(names or [])
    if not names:
        raise InputError(
            f"GRPO needs at least one reward function; set `reward_funcs` to some of {list(REWARD_FUNCS)}."
        )
    tagged = [":" in n for n in names]
    if any(tagged) and not all(tagged):
        raise InputError(f"`reward_funcs` {names} mixes per-task entries (task:name) with plain names: give every "
                         "entry a task (e.g. hallucination:exact_answer), or none.")
    unknown = [n for n in names if n.rpartition(":")[2] not in REWARD_FUNCS]
    if unknown:
        raise InputError(
            f"Unknown reward function(s) {unknown} in `reward_funcs`. Known: {list(REWARD_FUNCS)} (defined in "
            "grpotrl/rewards/rules.py), optionally as task:name. For your own reward, build the trainer in Python "
            "and pass the function in `reward_funcs`."
        )
    if not all(tagged):
        return [REWARD_FUNCS[n] for n in names]
    per_task: dict[str, list] = {}
    for n in names:
        task, _, name = n.rpartition(":")
        per_task.setdefault(task, []).append(REWARD_FUNCS[name])
    return per_task


def check_reward_columns(reward_funcs: list | dict, dataset, split_name: str) -> None:
    """Every required argument of every reward function must be a column of ``dataset``
    (TRL passes the columns as keyword arguments; a missing one fails only after generation)."""
    if isinstance(reward_funcs, dict):  # per task: every task's functions
        reward_funcs = [f for funcs in reward_funcs.values() for f in funcs]
    for func in reward_funcs:
        if not inspect.isfunction(func):  # reward models and callable objects: TRL checks them
            continue
        needed = [
            p.name for p in inspect.signature(func).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in _TRAINER_REWARD_KWARGS
        ]
        missing = [n for n in needed if n not in dataset.column_names]
        if missing:
            raise InputError(
                f"Reward function {func.__name__} needs the dataset column(s) {missing}, but the {split_name!r} "
                f"split has columns {dataset.column_names}. Add them to the dataset or drop that reward."
            )
