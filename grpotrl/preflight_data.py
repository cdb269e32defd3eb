"""Data that loads but cannot train, or does not load for a reason ``datasets`` buries: found
before any weights are read, each an ``InputError`` (or a warning) naming the file, line or rows.

* ``check_data_file`` / ``load_error_cause``: a local json/jsonl/csv file that is empty or not
  UTF-8 (``datasets`` raised ``StopIteration``, or loaded it and failed at the first row read),
  and the real cause of a ``DatasetGenerationError`` (the first bad JSON line, pandas' CSV line).
* ``check_prompt_kinds``: every GRPO prompt a chat (a list of messages) or every one plain text;
  TRL decides per batch from its first row and fails at the first step on a mix.
* ``check_reward_signal``: a column a reward function reads that is empty or None on every row
  (the reward is constant: zero signal) is refused; on some rows, a warning naming them.
* ``check_prompt_lengths``: prompts, as the chat template renders them, longer than the model's
  context (``max_position_embeddings`` from its config, no weights) are refused, naming rows.
"""

from __future__ import annotations

import codecs
import inspect
import json
import logging
import os
from collections.abc import Mapping

from .errors import InputError

logger = logging.getLogger(__name__)

TEXT_FORMATS = (".json", ".jsonl", ".csv", ".tsv", ".txt")
ROWS_SHOWN = 8  # row indices named in a message, at most
EXACT_ROWS = 2_000  # prompts tokenized one by one (~1 ms each); above, only those that could reach half the context


def _rows(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:ROWS_SHOWN]))
    return f"row{'s' if len(indices) > 1 else ''} {shown}" + (f", ... ({len(indices)} rows)"
                                                              if len(indices) > ROWS_SHOWN else "")


# ---------------------------------------------------------------------------------------------
# Local data files
# ---------------------------------------------------------------------------------------------

def _line_col(data: bytes, offset: int) -> tuple[int, int]:
    line_start = data.rfind(b"\n", 0, offset) + 1
    return data.count(b"\n", 0, offset) + 1, offset - line_start + 1


def check_data_file(path: str) -> None:
    """Raise ``InputError`` when the local text data file at ``path`` is empty or not UTF-8 (read
    in 1 MiB chunks; parquet and other binary formats pass)."""
    if not path.lower().endswith(TEXT_FORMATS):
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    blank, offset = True, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            try:
                text = decoder.decode(chunk)
            except UnicodeDecodeError as err:
                raise InputError(
                    f"Data file {path} is not UTF-8: byte {chunk[err.start:err.start + 1]!r} at byte offset "
                    f"{offset + err.start} ({_line_hint(path, offset + err.start)}: {err.reason}). Save it as "
                    "UTF-8 (e.g. `iconv -f latin1 -t utf-8 in > out`)."
                ) from None
            blank = blank and not text.strip()
            offset += len(chunk)
    if blank:
        raise InputError(f"Data file {path} is empty ({os.path.getsize(path)} bytes, no rows). Point dataset_name "
                         "at a file with rows.")


def _line_hint(path: str, offset: int) -> str:
    with open(path, "rb") as f:
        head = f.read(offset + 1)
    line, col = _line_col(head, offset)
    return f"line {line}, column {col}"


def load_error_cause(path: str, err: BaseException) -> str:
    """The reason a local data file did not load, as one line: the first line of a JSON/JSONL file
    that does not parse (with its number), else the innermost exception ``datasets`` wrapped."""
    lower = path.lower()
    if os.path.isfile(path) and lower.endswith((".json", ".jsonl")):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        try:
            json.loads(text)
            whole = None
        except json.JSONDecodeError as whole_err:
            whole = whole_err
        if whole is not None and (lower.endswith(".jsonl") or whole.msg == "Extra data"):  # JSON Lines
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as line_err:
                    return f"line {number}, column {line_err.colno}: {line_err.msg} (in {line.strip()[:80]!r})"
                if not isinstance(row, dict):
                    return f"line {number} is a JSON {type(row).__name__}, not an object {{\"column\": value, ...}}"
        elif whole is not None:
            return f"line {whole.lineno}, column {whole.colno}: {whole.msg}"
    if "corresponds to no data" in str(err):  # datasets' words for a file with a header or blank lines only
        return "it holds no rows (a header line at most)"
    root = err
    while (root.__cause__ or root.__context__) is not None and root is not (root.__cause__ or root.__context__):
        root = root.__cause__ or root.__context__
    text = (str(root).strip().splitlines() or [""])[0]
    return f"{type(root).__name__}: {text}"[:400].rstrip(".")


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------

def check_prompt_kinds(dataset, split_name: str, column: str = "prompt") -> None:
    """Raise ``InputError`` when ``column`` mixes chat prompts (lists of messages) with plain text:
    TRL formats a batch by its first row, so a mix fails at the first step
    (``TypeError: string indices must be integers``). Map-style datasets only."""
    if not hasattr(dataset, "column_names") or column not in (dataset.column_names or []) or \
            not hasattr(dataset, "__len__"):
        return
    chat, plain = [], []
    for i, value in enumerate(dataset[column]):
        (plain if isinstance(value, str) else chat).append(i)
    if chat and plain:
        raise InputError(
            f"The {split_name!r} split mixes chat prompts (lists of messages: {_rows(chat)}) with plain-text prompts "
            f"({_rows(plain)}); TRL formats a whole batch one way and fails at the first step. Make every prompt "
            'one kind, e.g. map plain text to [{"role": "user", "content": text}].'
        )


def _useless(value) -> bool:
    return value is None or (isinstance(value, (str, list, dict)) and not (value.strip() if isinstance(value, str)
                                                                             else value))


def check_reward_signal(reward_funcs, dataset, split_name: str, task_column: str = "task") -> None:
    """A dataset column a reward function reads (a required argument named after it) that is
    None or empty on every row it scores gives that reward nothing to compare with: an
    ``InputError`` naming the column and the function. Empty on some rows: a warning naming them.
    Per-task rewards (a mapping task -> functions) are checked on their task's rows."""
    if not hasattr(dataset, "column_names") or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return
    everyone = list(range(len(dataset)))
    def listed(funcs) -> list:  # one function, or a list of them, as TRL takes them
        return list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]

    if isinstance(reward_funcs, Mapping):
        labels = [str(t) for t in dataset[task_column]] if task_column in dataset.column_names else []
        scored = [(f, [i for i, t in enumerate(labels) if t == str(task)], f" (task {task!r})")
                  for task, fs in reward_funcs.items() for f in listed(fs)]
    else:
        scored = [(f, everyone, "") for f in listed(reward_funcs)]
    for func, rows, task in scored:
        if not inspect.isfunction(func) or not rows:
            continue
        for name, p in inspect.signature(func).parameters.items():
            if p.default is not p.empty or name not in dataset.column_names or name in ("prompt", "completion"):
                continue
            values = dataset[name]
            empty = [i for i in rows if _useless(values[i])]
            if len(empty) == len(rows):
                raise InputError(
                    f"Column {name!r} of the {split_name!r} split, which reward {func.__name__}{task} reads, is empty "
                    f"or None on every row it scores ({len(rows)} rows): that reward would be the same for every "
                    "completion and train nothing. Fill the column, or drop that reward."
                )
            if empty:
                logger.warning("Column %r of the %r split, which reward %s%s reads, is empty or None on %d of %d rows "
                               "(%s): those rows get no signal from it.", name, split_name, func.__name__, task,
                               len(empty), len(rows), _rows(empty))


def _utf8_bytes(value) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    return sum(len(str(m.get("content") or "").encode("utf-8")) for m in value if isinstance(m, dict))


def check_prompt_lengths(dataset, split_name: str, tokenizer, model_path: str | None, revision: str | None = None,
                         max_completion_length: int | None = None, **template_kwargs) -> None:
    """Raise ``InputError`` naming the rows whose prompt, rendered by the chat template with the
    generation prompt, has more tokens than the model's context (``max_position_embeddings`` or
    ``n_positions`` of its config.json; no weights are read); a warning for the rows where prompt +
    ``max_completion_length`` does not fit. Map-style datasets with a ``prompt`` column only; above
    ``EXACT_ROWS`` rows, only prompts whose text has at least half the context in bytes are tokenized."""
    if model_path is None or not hasattr(dataset, "__len__") or "prompt" not in (dataset.column_names or []):
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, revision=revision)
    except (OSError, ValueError):
        return
    config = getattr(config, "get_text_config", lambda: config)()
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not context:
        return
    try:
        lengths = _prompt_lengths(dataset["prompt"], len(dataset), context, tokenizer, template_kwargs)
    except Exception as err:  # noqa: BLE001  multimodal parts, a template that needs more: TRL's own checks apply
        logger.info("Prompt lengths not checked (%s: %s).", type(err).__name__, err)
        return
    too_long = [i for i, n in enumerate(lengths) if n > context]
    if too_long:
        raise InputError(
            f"The {split_name!r} split has prompts longer than the model's context of {context} tokens "
            f"(max_position_embeddings in the config of {model_path}): {_rows(too_long)}, with "
            f"{', '.join(str(lengths[i]) for i in too_long[:ROWS_SHOWN])} tokens as the chat template renders them. "
            "Shorten or drop those rows."
        )
    if max_completion_length:
        tight = [i for i, n in enumerate(lengths) if n + max_completion_length > context]
        if tight:
            logger.warning("%s of the %r split leave fewer than max_completion_length=%d tokens of the %d-token "
                           "context for the completion.", _rows(tight).capitalize(), split_name,
                           max_completion_length, context)


def _prompt_lengths(prompts, n_rows: int, context: int, tokenizer, template_kwargs: dict) -> list[int]:
    """Token count of each prompt as TRL renders it (chat template with the generation prompt)."""
    lengths = []
    for value in prompts:
        if n_rows > EXACT_ROWS and _utf8_bytes(value) < context // 2:
            lengths.append(0)  # <= half the context in bytes, and a byte-level token is >= 1 byte: it fits
        elif isinstance(value, str):
            lengths.append(len(tokenizer(value, add_special_tokens=False)["input_ids"]))
        else:
            ids = tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=True, **template_kwargs)
            lengths.append(len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return lengths
