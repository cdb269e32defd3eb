"""Datasets that load but cannot train, or do not load for a reason ``datasets`` buries: checked
once, before any weights are read, each an ``InputError`` (or a warning) naming the file, line or rows.

* ``check_dataset``: GRPO needs a ``prompt`` column, each row a non-empty list of chat messages
  whose last user message (or, without one, some message) has content, or a non-blank string, all
  one kind (``check_prompt_kinds``, a stream on its first rows: TRL
  formats a batch by its first row and fails at the first step on a mix), chat messages with an
  ``environment_factory``; SFT takes what ``trl.SFTTrainer`` takes, except rows whose answer is empty
  (``check_sft_dataset``); the first bad row is named by its index. A
  dataset object that passed is not read again with the same settings.
* ``check_data_file`` / ``load_error_cause``: a local json/jsonl/csv file that is empty or not
  UTF-8 (``datasets`` raised ``StopIteration``, or loaded it and failed at the first row read),
  and the real cause of a ``DatasetGenerationError`` (the first bad JSON line, pandas' CSV line).
* ``check_prompt_lengths``: prompts, as the chat template renders them, longer than the model's
  context (``max_position_embeddings`` from its config, no weights) are refused, naming rows.
"""

from __future__ import annotations

import codecs
import itertools
import json
import logging
import os
import weakref

from ..errors import InputError

logger = logging.getLogger(__name__)

TEXT_FORMATS = (".json", ".jsonl", ".csv", ".tsv", ".txt")
ROWS_SHOWN = 8  # row indices named in a message, at most
EXACT_ROWS = 2_000  # prompts tokenized one by one (~1 ms each); above, only those that could reach half the context


def row_list(indices: list[int]) -> str:
    """Row indices for an error message: "rows 3, 7, ..." (the first ``ROWS_SHOWN``, and how many)."""
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
# Datasets
# ---------------------------------------------------------------------------------------------

ROLES = ("system", "developer", "user", "assistant", "tool")

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


def _blank(content) -> bool:
    """Whether a message's ``content`` has nothing in it: a blank string, None, or parts that are all blank text
    (an image part is content)."""
    if isinstance(content, str):
        return not content.strip()
    if isinstance(content, list):
        return all(isinstance(p, dict) and p.get("type") == "text" and not str(p.get("text") or "").strip()
                   for p in content)
    return content is None


def _empty_chat_problem(messages: list[dict], what: str) -> str | None:
    """Why the chat prompt ``messages`` (well-formed: ``_messages_problem`` passed) asks nothing, or None: every
    message is empty (no content, no tool calls), or its last user message is (the rendered prompt then holds no
    question). An empty system message before a real user turn, or an empty earlier user turn, is fine."""
    if all(_blank(m.get("content")) and not m.get("tool_calls") for m in messages):
        return f"{what} is {len(messages)} message{'s' if len(messages) > 1 else ''} with empty content"
    last_user = next((j for j in range(len(messages) - 1, -1, -1) if messages[j]["role"] == "user"), None)
    if last_user is not None and _blank(messages[last_user].get("content")):
        return (f"{what}[{last_user}], its last user message, has empty content "
                f"{messages[last_user].get('content')!r}: the rendered prompt holds no question")
    return None


def _text_or_messages_problem(value, what: str, last_role: str | None = None,
                              filled_by_environment: bool = False) -> str | None:
    """Why the prompt ``value`` (text, or chat messages) cannot be trained on, or None. A blank one is refused,
    text or chat alike, unless ``filled_by_environment``: TRL appends an environment's ``reset()`` text to the
    last message of a chat prompt (its own placeholder is one user message with content "")."""
    if isinstance(value, str):
        return f"{what} is an empty string" if not value.strip() else None
    return _messages_problem(value, what, last_role) or (
        None if filled_by_environment else _empty_chat_problem(value, what))


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


_PASSED = weakref.WeakKeyDictionary()  # dataset -> the check settings it passed with: not read twice


def check_dataset(dataset, split_name: str, kind: str = "grpo", prompt_optional: bool = False,
                  **sft_options) -> None:
    """Raise ``InputError`` unless ``dataset`` has the columns and row shapes ``kind`` needs.

    GRPO: ``prompt``, each row a non-empty list of chat messages whose last user message has content (with no
    user message, some message must), or a non-blank string; with ``prompt_optional`` (an
    ``environment_factory`` supplies prompts) rows may have none, a chat prompt may be empty (TRL appends
    the environment's ``reset()`` text to its last message), and a plain-text prompt is refused. An
    ``IterableDataset`` (streaming) is checked on its first ``ITERABLE_ROWS_CHECKED`` rows.
    SFT: see ``check_sft_dataset`` (``sft_options`` go there). A dataset object that passed with
    the same settings returns at once (``datasets`` objects do not change in place).
    """
    if kind not in ("grpo", "sft"):
        raise ValueError(f"kind must be 'grpo' or 'sft', got {kind!r}")
    settings = (kind, prompt_optional, tuple(sorted(sft_options.items(), key=lambda kv: kv[0])))
    try:
        if settings in _PASSED.get(dataset, ()):
            return
    except TypeError:  # a list of rows, which cannot be weakly referenced: checked every time
        pass
    if kind == "sft":
        check_sft_dataset(dataset, split_name, **sft_options)
    else:
        _check_grpo_dataset(dataset, split_name, prompt_optional)
    try:
        _PASSED.setdefault(dataset, set()).add(settings)
    except TypeError:
        pass


def check_chat_prompts_for_tools(dataset, split_name: str) -> None:
    """GRPO with ``tools`` on plain-text prompts: TRL 1.16 decodes the completions of plain-text prompts as strings
    and its tool loop reads each as chat messages (``completion[0].get("tool_calls")``), so the first step fails
    after the model loaded. Refused on the split's first row (a mix of kinds is ``check_prompt_kinds``')."""
    rows, columns = _rows_to_check(dataset, split_name)
    if len(rows) and "prompt" in columns and isinstance(rows[0]["prompt"], str):
        raise InputError(
            f"The {split_name!r} split has plain-text prompts (row 0: {rows[0]['prompt'][:60]!r}), but with tools TRL "
            "reads each completion as chat messages for its tool calls: a plain-text prompt's completion is text, "
            "and the first step fails after the model loaded (AttributeError: 'str' object has no attribute "
            "'get'). Make every prompt a list of chat messages, e.g. "
            '`dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})`.'
        )


def _check_grpo_dataset(dataset, split_name: str, prompt_optional: bool) -> None:
    rows, columns = _rows_to_check(dataset, split_name)
    if len(rows) == 0:
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
    if prompt_optional and isinstance(rows[0]["prompt"], str):  # a mix of kinds is check_prompt_kinds' to name
        raise InputError(
            f"The {split_name!r} split has plain-text prompts (row 0: {rows[0]['prompt'][:60]!r}), but with an "
            "environment_factory TRL appends each environment's reset() text to the prompt's last chat message "
            "(`prompt[-1]['content']`) and reads the completions as chat messages for tool calls: a plain-text prompt "
            "fails at the first step, after the model loaded (TypeError: string indices must be integers). Make "
            "every prompt a list of chat messages, e.g. "
            '`dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})`.'
        )
    bad = _first_bad_row(rows, "prompt",
                         lambda v: _text_or_messages_problem(v, "prompt", filled_by_environment=prompt_optional))
    if bad is not None:
        index, why = bad
        raise InputError(
            f"Row {index} of the {split_name!r} split (GRPO): {why}. A valid row looks like {_EXAMPLE} "
            f"(chat messages with role in {list(ROLES)} and text content). Fix or drop that row."
        )
    check_prompt_kinds(rows, split_name)  # TRL formats a batch by its first row: a mix fails at step 1


_EXAMPLE = ('{"prompt": [{"role": "user", "content": "What is 7 + 5?"}], '
            '"completion": [{"role": "assistant", "content": "12"}]}')


def _sft_messages_problem(value, what: str) -> str | None:
    """Why ``value`` cannot be rendered by a chat template, or None: a list of dicts with a role
    (any role and content the template takes: tool calls with content None, multimodal parts)."""
    if not isinstance(value, list):
        return f"{what} is a {type(value).__name__}, not a list of messages"
    if not value:  # TRL fails on it after the model loads, or (a completion) trains on nothing
        return f"{what} is an empty list of messages"
    for j, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role", message.get("from")), str):
            return f"{what}[{j}] is {message!r}, not a dict with a 'role'"
    return None


MODEL_ROLES = ("assistant", "gpt")  # the model's turn: chat messages' role, ShareGPT's "from"
ANSWER_FIELDS = ("tool_calls", "reasoning_content", "thinking", "reasoning")  # what a turn holds besides content


def _empty_answer(value, what: str) -> str | None:
    """Why the SFT target ``value`` holds no answer, or None: a blank string, or (messages that passed
    ``_sft_messages_problem``) a model turn whose content is blank with no tool calls or reasoning. Its whole
    trained completion is then the end-of-turn token (or nothing, for a text row): the model learns to stop at once."""
    if isinstance(value, str):
        return f"{what!r} is {value!r}" if not value.strip() else None
    for j, message in enumerate(value):
        role, content = message.get("role", message.get("from")), message.get("content", message.get("value"))
        if role in MODEL_ROLES and _blank(content) and not any(message.get(k) for k in ANSWER_FIELDS):
            return f"{what}[{j}] (role {role!r}) has content {content!r} and no tool_calls"
    return None


def _keep_answered(columns: tuple[str, ...], chat: bool) -> str:
    """The ``dataset.filter`` function, as text, that keeps the rows whose trained ``columns`` (one, or a chat
    row's prompt and completion) have an answer in every model turn. A turn's content is a string, or a list of
    parts (multimodal messages), of which an image or any non-blank text is an answer (``_blank``): decided per
    message, since a prompt and its completion may hold their content either way."""
    if not chat:
        return f'lambda row: row[{columns[0]!r}].strip() != ""'
    role, content = ("from", "value") if columns == ("conversations",) else ("role", "content")
    turns = " + ".join(f"row[{column!r}]" for column in columns)
    answered = ('(c.strip() if isinstance(c, str) else any(p.get("type") != "text" or (p.get("text") or "").strip() '
                'for p in c or []))')
    return (f'lambda row: all({answered} or any(m.get(k) for k in {ANSWER_FIELDS}) '
            f'for m in {turns} if m["{role}"] in {MODEL_ROLES} for c in [m["{content}"]])')


def _sft_column(rows, column: str) -> list:
    """A map-style dataset's whole column, or the column of the rows read from a stream (``_rows_to_check``)."""
    return [row.get(column) for row in rows] if isinstance(rows, list) else rows[column]


def check_sft_dataset(dataset, split_name: str, text_field: str = "text", formatting_func=None,
                      skip_prepare: bool = False, completion_only_loss: bool | None = None) -> None:
    """Raise ``InputError`` where ``trl.SFTTrainer`` would fail later and less clearly, or would train rows with no
    answer; accept everything else it accepts.

    A ``Dataset`` or ``IterableDataset`` (streams: their first ``ITERABLE_ROWS_CHECKED`` rows), not empty, in one of
    TRL's layouts: ``text_field`` (language modelling, a string in every row), ``messages`` or ``conversations``
    (conversational language modelling), ``prompt`` + ``completion`` (both strings or both non-empty
    message lists), or ``input_ids`` (pre-tokenized). A row whose answer is empty (``_empty_answer``: a blank
    text or completion, an assistant turn with blank content and no tool calls) is refused, naming the rows: TRL
    trains its end-of-turn token alone, the one-token completion. With ``completion_only_loss=False`` (SFTConfig's;
    TRL then labels the whole prompt + completion) a chat prompt's assistant turns are trained too, and one with blank
    content and no tool calls is refused the same way; None (TRL's default, True for prompt-completion rows) and
    True mask the prompt, which is then not checked for answers. With a ``formatting_func`` or ``skip_prepare``
    (``dataset_kwargs``), the columns are the function's or the collator's business and only emptiness is checked.
    """
    if not hasattr(dataset, "column_names") or getattr(dataset, "format", {}).get("type") == "custom":
        return  # not a datasets object, or a with_transform one: trl.SFTTrainer says what it needs
    rows, columns = _rows_to_check(dataset, split_name)
    if len(rows) == 0:
        raise InputError(
            f"The {split_name!r} split is empty (columns {columns}). Point the recipe at a split with rows."
        )
    if formatting_func is not None or skip_prepare or "input_ids" in columns:
        return
    example = _EXAMPLE
    bad = None
    if "prompt" in columns and "completion" in columns:
        column, answers = "completion", _sft_column(rows, "completion")
        for i, (prompt, completion) in enumerate(zip(_sft_column(rows, "prompt"), answers)):
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
        answers = _sft_column(rows, column)
        bad = next(((i, why) for i, v in enumerate(answers) if (why := _sft_messages_problem(v, column))), None)
    elif text_field in columns:
        column, answers = text_field, _sft_column(rows, text_field)
        example = json.dumps({text_field: "The number after 7 is 8."})
        bad = next(((i, f"{text_field!r} is a {type(v).__name__}, not a string") for i, v in enumerate(answers)
                    if not isinstance(v, str)), None)
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
            f"Row {index} of the {split_name!r} split (SFT): {why}. A valid row looks like {example}. "
            "Fix or drop that row."
        )
    trained = {column: answers}  # the columns TRL puts in the loss: their model turns must hold an answer
    if column == "completion" and completion_only_loss is False:  # TRL labels prompt + completion: chat prompts too
        trained = {"prompt": _sft_column(rows, "prompt"), **trained}
    empty = []
    for i, values in enumerate(zip(*trained.values())):  # a text prompt is the context, never an answer
        why = next((w for c, v in zip(trained, values)
                    if (c != "prompt" or isinstance(v, list)) and (w := _empty_answer(v, c))), None)
        if why:
            empty.append((i, why))
    if empty:
        chat = not isinstance(answers[empty[0][0]], str)
        in_prompt = any(why.startswith("prompt[") for _, why in empty)
        raise InputError(
            f"The {split_name!r} split (SFT) has rows with an empty answer ({row_list([i for i, _ in empty])}); "
            f"row {empty[0][0]}: {empty[0][1]}. "
            + ("With completion_only_loss=False TRL trains the prompt's tokens too, its assistant turns included "
               "(None, TRL's default, or true masks the prompt): an empty one teaches the model to answer with its "
               "end-of-turn token alone (a one-token completion)." if in_prompt else
               "TRL trains such a row on its end-of-turn (for text, end-of-text) token alone, which teaches the model "
               "to stop at once (a one-token completion).")
            + " Drop or fill those rows, e.g. "
            f"`dataset.filter({_keep_answered(tuple(trained) if chat else (column,), chat)})`"
            + (", or leave completion_only_loss at its default." if in_prompt else ".")
        )


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------

def check_prompt_kinds(dataset, split_name: str, column: str = "prompt") -> None:
    """Raise ``InputError`` when ``column`` mixes chat prompts (lists of messages) with plain text:
    TRL formats a batch by its first row, so a mix fails at the first step
    (``TypeError: string indices must be integers``). A map-style dataset, or the rows read from a stream
    (a list of dicts: ``_rows_to_check``)."""
    if isinstance(dataset, list):  # a stream's first rows
        values = [row.get(column) for row in dataset]
    elif hasattr(dataset, "column_names") and column in (dataset.column_names or []) and hasattr(dataset, "__len__"):
        values = dataset[column]
    else:
        return
    chat, plain = [], []
    for i, value in enumerate(values):
        if value is not None:
            (plain if isinstance(value, str) else chat).append(i)
    if chat and plain:
        raise InputError(
            f"The {split_name!r} split mixes chat prompts (lists of messages: {row_list(chat)}) with plain-text prompts "
            f"({row_list(plain)}); TRL formats a whole batch one way and fails at the first step. Make every prompt "
            'one kind, e.g. map plain text to [{"role": "user", "content": text}].'
        )


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
            f"(max_position_embeddings in the config of {model_path}): {row_list(too_long)}, with "
            f"{', '.join(str(lengths[i]) for i in too_long[:ROWS_SHOWN])} tokens as the chat template renders them. "
            "Shorten or drop those rows."
        )
    if max_completion_length:
        tight = [i for i, n in enumerate(lengths) if n + max_completion_length > context]
        if tight:
            logger.warning("%s of the %r split leave fewer than max_completion_length=%d tokens of the %d-token "
                           "context for the completion.", row_list(tight).capitalize(), split_name,
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
