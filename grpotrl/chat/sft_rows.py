"""SFT rows as TRL reads them: the first row, the dataset's format, the ``chat_template_kwargs`` and
``tools`` the rows are rendered with, and one conversational prompt-completion row tokenized on the RL
template (I2). Used by the SFT preflight (I2 on the first row, before any weights load) and by ``SFTTrainer``."""

from __future__ import annotations

import json

from datasets import Dataset
from trl.chat_template_utils import get_training_chat_template, has_generation_markers
from trl.data_utils import get_dataset_column_names, is_conversational, is_conversational_from_value

from ..errors import InputError
from . import templates


def first_row(dataset) -> dict | None:
    try:
        return next(iter(dataset))
    except (StopIteration, TypeError):
        return None


def data_format(dataset) -> str | None:
    """TRL's dataset type of ``dataset``: "tokenized", "chat_prompt_completion", "prompt_completion",
    "chat" (messages / conversations), "text", or None (empty, or something TRL will name)."""
    row = first_row(dataset)
    if row is None or not hasattr(dataset, "column_names"):
        return None
    if "input_ids" in row:
        return "tokenized"
    if "prompt" in row and "completion" in row:
        return "chat_prompt_completion" if is_conversational(row) else "prompt_completion"
    if is_conversational(row) or is_conversational_from_value(row):
        return "chat"
    return "text"


def kwargs_variants(dataset, fmt: str | None, config_kwargs: dict | None) -> list[dict] | None:
    """Every distinct set of ``chat_template_kwargs`` the rows are rendered with (the config's,
    updated by each row's column, as TRL does); None when no template renders them or a stream's
    rows cannot be read ahead."""
    base = dict(config_kwargs or {})
    return _column_variants(dataset, fmt, "chat_template_kwargs", base, lambda kw: {**base, **(kw or {})})


def tool_variants(dataset, fmt: str | None) -> list[list[dict] | None] | None:
    """Every distinct set of tool schemas the rows are rendered with (each row's ``tools``, a list or its
    JSON, as TRL reads it; None for a row without); None when no template renders them or a stream's rows
    cannot be read ahead."""
    return _column_variants(dataset, fmt, "tools", None, _row_tools, sort_keys=False)  # key order is rendered


def _row_tools(tools):
    return json.loads(tools) if isinstance(tools, str) else tools


def _column_variants(dataset, fmt: str | None, column: str, absent, value, sort_keys: bool = True) -> list | None:
    """The distinct ``value(row[column])`` over the rows (``[absent]`` without the column), for
    conversational rows of a dataset that can be read ahead; None otherwise. ``sort_keys=False``: dicts
    whose keys come in another order are distinct (a template's ``tojson`` writes them in their order)."""
    if fmt not in ("chat_prompt_completion", "chat"):
        return None
    if column not in get_dataset_column_names(dataset):
        return [absent]
    if not isinstance(dataset, Dataset):
        return None
    seen: dict[str, object] = {}
    for v in dataset[column]:
        v = value(v)
        seen.setdefault(json.dumps(v, sort_keys=sort_keys), v)
    return [seen[k] for k in sorted(seen)]


def tokenize_i2_row(row: dict, tokenizer, stop_ids: list[int], config_kwargs: dict | None,
                    training_template: str | None = None, assistant_masks: bool = False,
                    end_of_turn: int | None = None) -> dict:
    """One conversational prompt-completion row on the RL template, with what TRL renders it with:
    the row's ``tools`` (a list or its JSON) and ``chat_template_kwargs`` over the config's.
    ``end_of_turn``: the template's end-of-turn id, where the sequence ends (computed when not given)."""
    tools = _row_tools(row.get("tools"))
    kw = {**(config_kwargs or {}), **(row.get("chat_template_kwargs") or {})}
    return templates.tokenize_sft_example(tokenizer, row["prompt"], row["completion"], stop_ids,
                                          training_template=training_template, tools=tools,
                                          assistant_masks=assistant_masks, end_of_turn=end_of_turn, **kw)


def assistant_only_template(tokenizer, stop_ids: list[int], i2_row: dict | None = None,
                            config_kwargs: dict | None = None) -> str | None:
    """The template ``trl.SFTTrainer`` renders rows with under ``assistant_only_loss`` (None: the tokenizer's own,
    which has ``{% generation %}`` markers; else TRL's patched training template), found before any weights load.
    ``i2_row``: the first conversational prompt-completion row trained on its completion, tokenized as
    ``tokenize_i2_row`` will (its RL prompt ids a prefix), whose loss (completion and assistant mask) must end
    with a stop token where the template writes one after an assistant turn (I2).

    Raises:
        InputError: TRL cannot make the template mark assistant turns, or the row's loss leaves out the end-of-turn.
        InvariantError: the row does not start with the RL prompt ids (I2).
    """
    tok = templates._tok(tokenizer)
    name = getattr(tok, "name_or_path", type(tok).__name__)
    try:  # what trl.SFTTrainer.__init__ does, on the processing class (a VLM processor's own template)
        training = (None if has_generation_markers(templates.chat_template_of(tokenizer))
                    else get_training_chat_template(tokenizer))
    except ValueError as e:
        raise InputError(
            f"assistant_only_loss=True needs a chat template that marks each assistant turn with `{{% generation %}}` "
            f"... `{{% endgeneration %}}`; the template of {name!r} has no markers and TRL cannot add them ({e}). "
            "Put the markers around each assistant message and its end-of-turn token (a tokenizer whose template "
            "has them, or `chat_template_path`), or drop assistant_only_loss: on prompt/completion rows "
            "completion_only_loss already trains on the response and its end-of-turn token only."
        ) from e
    if i2_row is None:
        return training
    row = tokenize_i2_row(i2_row, tok, stop_ids, config_kwargs, training, assistant_masks=True)
    in_loss = [t for t, c, a in zip(row["input_ids"], row["completion_mask"], row["assistant_masks"]) if c and a]
    if in_loss and in_loss[-1] not in stop_ids and templates.writes_stop_after_turn(tok, stop_ids, training):
        raise InputError(
            f"assistant_only_loss=True on the chat template of {name!r}: its `{{% generation %}}` block ends before "
            f"the end-of-turn token, so the first row's loss ends with {tok.decode(in_loss[-1:])!r}, not a stop "
            f"token {stop_ids}, and SFT would never teach the model to stop (I2). Move `{{% endgeneration %}}` "
            "after the end-of-turn token, or drop assistant_only_loss: on prompt/completion rows "
            "completion_only_loss already trains on the response and its end-of-turn token only."
        )
    return training
