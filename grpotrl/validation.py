"""Checks on user input that run before any model is loaded; each raises ``InputError``
saying what was wrong, with the value, and what to do.

* ``check_dataset``: GRPO needs a ``prompt`` column; SFT takes what ``trl.SFTTrainer`` takes
  (``check_sft_dataset``); the first bad row is named by its index.
* ``check_model_dir``: a local checkpoint with ``config.json`` and complete weights (every
  shard of a sharded one; safetensors files not truncated), or a PEFT adapter dir whose base
  model passes the same check (Hub ids: ``grpotrl.hub.check_model_source``).
* ``check_resume_checkpoint`` / ``find_last_checkpoint``: a ``checkpoint-N`` dir that a SIGKILL
  during the save did not cut short: trainer state, weights, optimizer, scheduler, RNG and the
  files the trainer adds (``checkpoint_problems``), each present and not truncated.
* ``check_output_dir`` (the CLI: any non-empty dir needs overwrite or a resume) and
  ``check_finished_run`` (the Python API: only a finished run is refused); ``check_tokenizer_files``.
* ``resolve_reward_funcs`` / ``check_reward_columns``: reward names from a recipe (the recipe's
  judges, ``grpotrl.rewards.rules``, the names ``trl grpo`` knows, dotted import paths) to
  functions, and the dataset columns those functions and judges need.
"""

from __future__ import annotations

import inspect
import itertools
import json
import math
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


def check_dataset(dataset, split_name: str, kind: str = "grpo", prompt_optional: bool = False,
                  **sft_options) -> None:
    """Raise ``InputError`` unless ``dataset`` has the columns and row shapes ``kind`` needs.

    GRPO: ``prompt``, each row a non-empty list of chat messages (or a non-empty string); with
    ``prompt_optional`` (an ``environment_factory`` supplies prompts) rows may have none. An
    ``IterableDataset`` (streaming) is checked on its first ``ITERABLE_ROWS_CHECKED`` rows.
    SFT: see ``check_sft_dataset`` (``sft_options`` go there).
    """
    if kind not in ("grpo", "sft"):
        raise ValueError(f"kind must be 'grpo' or 'sft', got {kind!r}")
    if kind == "sft":
        return check_sft_dataset(dataset, split_name, **sft_options)
    dataset, columns = _rows_to_check(dataset, split_name)
    if len(dataset) == 0:
        raise InputError(
            f"The {split_name!r} split is empty (columns {columns}). Point the recipe at a split with rows."
        )
    if "prompt" not in columns and prompt_optional:
        return
    if "prompt" not in columns:
        raise InputError(
            f"GRPO needs a 'prompt' column, but the {split_name!r} split has columns {columns}. Each prompt "
            'is a list of chat messages such as [{"role": "user", "content": "What is 7 + 5?"}]. Rename your '
            "question column (`dataset.rename_column(old, 'prompt')`) or map your rows into that shape."
        )
    bad = _first_bad_row(dataset, "prompt", lambda v: _text_or_messages_problem(v, "prompt"))
    if bad is not None:
        index, why = bad
        example = ('{"prompt": [{"role": "user", "content": "What is 7 + 5?"}], '
                   '"completion": [{"role": "assistant", "content": "12"}]}')
        raise InputError(
            f"Row {index} of the {split_name!r} split (GRPO): {why}. A valid row looks like {example} "
            f"(chat messages with role in {list(ROLES)} and text content). Fix or drop that row."
        )
    from .preflight_data import check_prompt_kinds

    check_prompt_kinds(dataset, split_name)  # TRL formats a batch by its first row: a mix fails at step 1


def _sft_messages_problem(value, what: str) -> str | None:
    """Why ``value`` cannot be rendered by a chat template, or None: a list of dicts with a role
    (any role and content the template takes: tool calls with content None, multimodal parts)."""
    if not isinstance(value, list):
        return f"{what} is a {type(value).__name__}, not a list of messages"
    for j, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role", message.get("from")), str):
            return f"{what}[{j}] is {message!r}, not a dict with a 'role'"
    return None


def _sft_column(dataset, first: dict, column: str) -> list:
    """A map-style dataset's whole column; a stream's first value (a stream is read lazily)."""
    return dataset[column] if hasattr(dataset, "__len__") else [first[column]]


def check_sft_dataset(dataset, split_name: str, text_field: str = "text", formatting_func=None,
                      skip_prepare: bool = False) -> None:
    """Raise ``InputError`` where ``trl.SFTTrainer`` would fail later and less clearly; accept what it accepts.

    A ``Dataset`` or ``IterableDataset`` (streams: their first row), not empty, in one of TRL's layouts:
    ``text_field`` (language modelling), ``messages`` or ``conversations`` (conversational language
    modelling), ``prompt`` + ``completion`` (both strings or both message lists), or ``input_ids``
    (pre-tokenized). With a ``formatting_func`` or ``skip_prepare`` (``dataset_kwargs``), the columns
    are the function's or the collator's business and only emptiness is checked.
    """
    if not hasattr(dataset, "column_names") or getattr(dataset, "format", {}).get("type") == "custom":
        return  # not a datasets object, or a with_transform one: trl.SFTTrainer says what it needs
    try:
        first = next(iter(dataset))
    except StopIteration:
        raise InputError(
            f"The {split_name!r} split is empty (columns {dataset.column_names}). Point the recipe at a split "
            "with rows."
        ) from None
    columns = dataset.column_names or list(first)
    if formatting_func is not None or skip_prepare or "input_ids" in columns:
        return
    example = ('{"prompt": [{"role": "user", "content": "What is 7 + 5?"}], '
               '"completion": [{"role": "assistant", "content": "12"}]}')
    bad = None
    if "prompt" in columns and "completion" in columns:
        pairs = zip(_sft_column(dataset, first, "prompt"), _sft_column(dataset, first, "completion"))
        for i, (prompt, completion) in enumerate(pairs):
            if isinstance(prompt, str) != isinstance(completion, str):
                bad = (i, "prompt and completion must both be message lists or both strings, got a "
                          f"{type(prompt).__name__} and a {type(completion).__name__}")
            elif not isinstance(prompt, str):
                why = _sft_messages_problem(prompt, "prompt") or _sft_messages_problem(completion, "completion")
                bad = (i, why) if why else None
            if bad:
                break
    elif "messages" in columns or "conversations" in columns:
        column = "messages" if "messages" in columns else "conversations"
        values = _sft_column(dataset, first, column)
        bad = next(((i, why) for i, v in enumerate(values) if (why := _sft_messages_problem(v, column))), None)
    elif text_field in columns:
        if not isinstance(first[text_field], str):
            bad = (0, f"{text_field!r} is a {type(first[text_field]).__name__}, not a string")
    else:
        raise InputError(
            f"SFT takes a {text_field!r} column (plain text; `dataset_text_field` names another), 'messages', "
            f"'prompt' + 'completion', or tokenized 'input_ids', but the {split_name!r} split has columns "
            f"{columns}. For SFT followed by RL, a row looks like {example}. Rename or map your columns, or pass "
            "a `formatting_func`."
        )
    if bad is not None:
        index, why = bad
        raise InputError(
            f"Row {index} of the {split_name!r} split (SFT): {why}. A conversational row looks like {example}. "
            "Fix or drop that row."
        )


# ---------------------------------------------------------------------------------------------
# Numeric settings
# ---------------------------------------------------------------------------------------------

def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# field -> (test of a value that is set, what it must be); None always passes (TRL's "not set")
RANGES = {
    "learning_rate": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    "beta": (lambda v: _real(v) and v >= 0, "a finite number >= 0 (a negative KL coefficient rewards leaving the "
             "reference)"),
    "epsilon": (lambda v: _real(v) and v > 0, "a finite number > 0 (the lower clip of the ratio)"),
    "epsilon_high": (lambda v: _real(v) and v > 0, "a finite number > 0 (the upper clip of the ratio)"),
    "temperature": (lambda v: _real(v) and v > 0, "a finite number > 0: the logprobs are log_softmax(logits / T), "
                    "and greedy decoding (T = 0) would give every completion of a group the same text, hence zero "
                    "advantages; for nearly greedy sampling use a small T such as 0.1"),
    "top_p": (lambda v: _real(v) and 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: _real(v) and 0 <= v <= 1, "in [0, 1]"),
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0 (0: off)"),
    "repetition_penalty": (lambda v: _real(v) and v > 0, "a finite number > 0 (1.0: off)"),
    "presence_penalty": (_real, "a finite number"),
    "frequency_penalty": (_real, "a finite number"),
    "entropy_coef": (lambda v: _real(v) and v >= 0, "a finite number >= 0: the loss is policy + beta*KL - c*H with "
                     "c >= 0 encouraging exploration (INVARIANT I7); 0 for no bonus"),
    "weight_decay": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    "max_grad_norm": (lambda v: _real(v) and v >= 0, "a finite number >= 0 (0: no clipping)"),
    "warmup_ratio": (lambda v: _real(v) and 0 <= v <= 1, "in [0, 1]"),
    "num_train_epochs": (lambda v: _real(v) and v > 0, "a finite number > 0"),
    "num_generations": (lambda v: _int(v) and v >= 2, "an integer >= 2 (GRPO normalises rewards within a group)"),
    "num_iterations": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "steps_per_generation": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "per_device_train_batch_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "per_device_eval_batch_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "gradient_accumulation_steps": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "max_steps": (lambda v: _int(v) and (v > 0 or v == -1), "an integer > 0 (or -1: by num_train_epochs)"),
    "max_completion_length": (lambda v: _int(v) and v >= 1, "an integer >= 1 (new tokens per completion)"),
    "max_prompt_length": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "max_length": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "min_new_tokens": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "guard_steps": (lambda v: _int(v) and v >= -1, "an integer: -1 every step, 0 off, N the first N steps"),
    "guard_logprob_atol": (lambda v: _real(v) and v > 0, "a finite number > 0"),
    "discriminator_learning_rate": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    "kl_in_reward_coef": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_ranges(args) -> None:
    """Raise ``InputError`` for the first numeric setting of ``args`` (any TRL or grpotrl config) that is
    set to something its field cannot mean: a wrong sign, a zero, a NaN, a list. Runs on the config,
    before any weights load, and before TRL's own __post_init__ divides by any of them."""
    for name, (ok, what) in RANGES.items():
        value = getattr(args, name, None)
        if value is not None and not ok(value):
            raise InputError(f"{name}={value!r} ({type(value).__name__}): it must be {what}. Fix it in the recipe, "
                             "on the command line or in the config.")


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


def check_discriminator_source(path: str) -> None:
    """GAD's ``discriminator_model_name_or_path``: a model dir, alias or Hub id (cached when offline)."""
    from .hub import check_model_source
    from .models import resolve_model_path

    try:
        check_model_source(resolve_model_path(path), what="Discriminator model")
    except InputError as err:
        raise InputError(f"discriminator_model_name_or_path {path!r}: {err}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken")


def check_tokenizer_files(path: str) -> None:
    """Raise ``InputError`` when the local model dir ``path`` holds no tokenizer vocabulary (a
    checkpoint saved without its tokenizer); transformers would say to install sentencepiece or
    tiktoken instead. Hub ids and PEFT adapter dirs pass (their files come from elsewhere)."""
    directory = os.path.expanduser(path)
    if not os.path.isdir(directory) or os.path.isfile(os.path.join(directory, "adapter_config.json")):
        return
    names = os.listdir(directory)
    if any(n in TOKENIZER_FILES or n.endswith((".tiktoken", ".model")) for n in names):
        return
    raise InputError(
        f"Model dir {path!r} has no tokenizer files (none of {list(TOKENIZER_FILES)}; found: {_files(directory)}): "
        "it was saved without its tokenizer. Save the tokenizer of the model it was trained from into it "
        "(`AutoTokenizer.from_pretrained(base).save_pretrained(dir)`), or from Python pass processing_class=."
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
        problems.append(WEIGHTS_ONLY)
    return problems


WEIGHTS_ONLY = ("trainer_state.json without optimizer or RNG state is what save_only_model=True writes: it cannot "
                "resume a run, only start a new one with model_name_or_path")


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
        inside = _complete_checkpoints(directory, required)  # a finished run's output_dir holds its checkpoints
        if WEIGHTS_ONLY in problems:  # saved so on purpose, not cut short: say only that
            raise InputError(
                f"Checkpoint {path!r} holds weights and trainer_state.json but no optimizer, scheduler or RNG state "
                f"(found: {_files(directory)}): it is a weights-only save (save_only_model=True, or a finished run's "
                "final output), which cannot resume a run. Start a new run from it with model_name_or_path "
                f"{path!r}, or resume from a full checkpoint"
                + (f": {os.path.join(path, inside[-1])}" if inside else f" (beside it: {others or 'none'})") + "."
            )
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


def check_output_dir(path: str, resume: bool = False, overwrite: bool = False) -> None:
    """Raise ``InputError`` when a run into ``path`` would replace what is there: a finished run
    (weights, ``trainer_state.json``), ``checkpoint-N`` dirs, or any other file (the Trainer writes
    README.md, config.json, ... by name). Resuming from it (``resume``) or ``overwrite`` is the user
    saying so. A file where a directory should be is always an error. Reads names only."""
    directory = os.path.expanduser(path)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise InputError(f"output_dir {path!r} is a file, not a directory. Point output_dir at a new directory.")
    if resume or overwrite or not os.path.isdir(directory) or not os.listdir(directory):
        return
    names = set(os.listdir(directory))
    checkpoints = _checkpoints(directory)
    finished = [n for n in ("trainer_state.json", *WEIGHT_FILES["model"], *WEIGHT_FILES["adapter"]) if n in names]
    if finished or checkpoints:
        steps = ""
        if "trainer_state.json" in names:
            try:
                with open(os.path.join(directory, "trainer_state.json")) as f:
                    steps = f" of {json.load(f).get('global_step')} steps"
            except (OSError, ValueError):
                pass
        what = (f"a finished run{steps} ({', '.join(finished)})" if finished else "no final model") + \
            (f" and checkpoints {checkpoints}" if checkpoints else "")
    else:
        what = f"files grpotrl did not write ({_files(directory)})"
    raise InputError(
        f"output_dir {path!r} already holds {what}; this run would overwrite them. Choose a new output_dir, resume "
        "that run with resume_from_checkpoint: true, or set overwrite_output_dir: true to replace it."
    )


def check_finished_run(path: str) -> None:
    """The Python API's output_dir rule: raise ``InputError`` when ``path`` holds a finished run
    (final weights and ``trainer_state.json`` at its root, what ``save_model`` + ``save_state``
    write); anything else is written into as TRL and transformers do (fresh temp dirs, checkpoints)."""
    directory = os.path.expanduser(path)
    if not os.path.isfile(os.path.join(directory, "trainer_state.json")):
        return
    names = set(os.listdir(directory))
    weights = [n for n in (*WEIGHT_FILES["model"], *WEIGHT_FILES["adapter"])
               if n in names or n + ".index.json" in names]
    if not weights:
        return
    try:
        with open(os.path.join(directory, "trainer_state.json")) as f:
            steps = f" of {json.load(f).get('global_step')} steps"
    except (OSError, ValueError, AttributeError):
        steps = ""
    raise InputError(
        f"output_dir {path!r} holds a finished run{steps} ({', '.join(weights)}, trainer_state.json); training into it "
        "would replace its model and log history. Use a new output_dir, resume it with "
        "train(resume_from_checkpoint=True), or pass train(overwrite_output_dir=True) to replace it."
    )


# ---------------------------------------------------------------------------------------------
# Reward functions
# ---------------------------------------------------------------------------------------------

def trl_reward_funcs() -> dict:
    """The built-in names of TRL's ``trl grpo`` script (``trl/scripts/grpo.py``), with its settings."""
    from trl.rewards import (accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward,
                             think_format_reward)

    return {"accuracy_reward": accuracy_reward, "reasoning_accuracy_reward": reasoning_accuracy_reward,
            "think_format_reward": think_format_reward,
            "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)}


def _import_reward(path: str):
    """``my_lib.rewards.custom_reward`` -> that function, as ``trl grpo`` imports it (the working
    directory is put first on ``sys.path``)."""
    import importlib
    import sys

    module_path, _, attr = path.rpartition(".")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as err:
        raise InputError(f"Reward {path!r}: cannot import module {module_path!r} ({err}). Put the directory that "
                         f"holds it on PYTHONPATH (the working directory {os.getcwd()} is searched), or fix the "
                         "dotted path.") from None
    func = getattr(module, attr, None)
    if not callable(func):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise InputError(f"Reward {path!r}: module {module_path!r} ({getattr(module, '__file__', '?')}) has no "
                         f"callable {attr!r}; its callables: {names}.")
    return func


def resolve_reward_funcs(names: list[str] | str | None, judges: dict | None = None,
                         reward_model: str | None = None) -> list | dict:
    """Map a recipe's ``reward_funcs`` to functions, looking each name up in this order: the
    recipe's ``judges`` (``grpotrl.rewards.recipe.parse_judges``), grpotrl's ``REWARD_FUNCS``,
    the names ``trl grpo`` knows (``trl_reward_funcs``), then a dotted import path
    (``my_lib.rewards.custom_reward``). ``["exact_answer", "format"]`` -> a list;
    ``["hallucination:exact_answer", "fairness:even_handed"]`` (``task:name``, every entry) -> a
    mapping task -> functions, for MultiTaskGRPOTrainer (rows carry the task in ``task_column``).
    ``reward_model`` (``reward_model_name_or_path``) goes first in the list, as ``trl grpo`` puts it;
    with per-task rewards it is an error (a reward model scores every row)."""
    names = [names] if isinstance(names, str) else list(names or [])
    judges = judges or {}
    trl_funcs = trl_reward_funcs()
    known = [*judges, *REWARD_FUNCS, *trl_funcs]
    if not names and not reward_model:
        raise InputError(f"GRPO needs at least one reward: set `reward_funcs` to some of {known} (or a dotted path "
                         "such as my_lib.rewards.custom_reward), or `reward_model_name_or_path`.")
    shadowed = [n for n in judges if n in REWARD_FUNCS or n in trl_funcs]
    if shadowed:
        raise InputError(f"Judge name(s) {shadowed} in `judges` are also built-in reward names; rename the judge(s).")
    tagged = [":" in n for n in names]
    if any(tagged) and not all(tagged):
        raise InputError(f"`reward_funcs` {names} mixes per-task entries (task:name) with plain names: give every "
                         "entry a task (e.g. hallucination:exact_answer), or none.")
    unknown = [n for n in names if n.rpartition(":")[2] not in known and "." not in n.rpartition(":")[2]]
    if unknown:
        raise InputError(
            f"Unknown reward function(s) {unknown} in `reward_funcs`. Known: {known} (the recipe's judges, "
            "grpotrl/rewards/rules.py, trl.rewards), or a dotted import path to your own function such as "
            "my_lib.rewards.custom_reward; any of them as task:name for rewards per task."
        )

    def lookup(name):
        for table in (judges, REWARD_FUNCS, trl_funcs):
            if name in table:
                return table[name]
        return _import_reward(name)

    if not names or not all(tagged):
        return ([reward_model] if reward_model else []) + [lookup(n) for n in names]
    if reward_model:
        raise InputError(f"reward_model_name_or_path {reward_model!r} scores every row, but `reward_funcs` gives "
                         "rewards per task (task:name). Drop one of them, or wrap the reward model in a function "
                         "and name it per task.")
    per_task: dict[str, list] = {}
    for n in names:
        task, _, name = n.rpartition(":")
        per_task.setdefault(task, []).append(lookup(name))
    return per_task


def check_reward_columns(reward_funcs: list | dict, dataset, split_name: str) -> None:
    """Every required argument of every reward function must be a column of ``dataset``
    (TRL passes the columns as keyword arguments; a missing one fails only after generation)."""
    if isinstance(reward_funcs, dict):  # per task: every task's functions
        reward_funcs = [f for funcs in reward_funcs.values() for f in funcs]
    for func in reward_funcs:
        rubric = getattr(func, "rubric", None)  # a judge reads its rubric's columns
        if rubric is not None and (missing := [c for c in rubric.columns.values() if c not in dataset.column_names]):
            raise InputError(
                f"Judge {func.name!r} (rubric {rubric.name!r}) reads the dataset column(s) {missing}, but the "
                f"{split_name!r} split has columns {dataset.column_names}. Map the rubric's fields to your columns "
                "with the judge's rubric_columns (e.g. {reference: answer}) or add the column."
            )
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
