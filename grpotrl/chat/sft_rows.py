"""SFT rows as TRL reads them: the first row, the dataset's format, the ``chat_template_kwargs`` and
``tools`` the rows are rendered with, one conversational prompt-completion row tokenized on the RL
template (I2), and the check of a row's loss spans (``loss_spans``, ``span_problems``,
``assistant_mask_problems``: each span right after the generation prompt, ending with a stop token).
Used by the SFT preflight (I2 on the first row, before any weights load) and by ``SFTTrainer``
(``check_sft_labels``, on the collated labels of the guard steps)."""

from __future__ import annotations

import copy
import json
import logging

from datasets import Dataset
from trl.chat_template_utils import get_training_chat_template, has_generation_markers
from trl.data_utils import (get_dataset_column_names, is_conversational, is_conversational_from_value,
                            maybe_convert_to_chatml)

from ..errors import InputError, InvariantError
from . import templates

logger = logging.getLogger(__name__)


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
                            config_kwargs: dict | None = None, messages_row: dict | None = None) -> str | None:
    """The template ``trl.SFTTrainer`` renders rows with under ``assistant_only_loss`` (None: the tokenizer's own,
    which has ``{% generation %}`` markers; else TRL's patched training template), found before any weights load.
    ``i2_row``: the first conversational prompt-completion row trained on its completion, tokenized as
    ``tokenize_i2_row`` will (its RL prompt ids a prefix), whose loss (completion and assistant mask) must end
    with a stop token where the template writes one after an assistant turn (I2). ``messages_row``: the first
    ``messages`` (or ``conversations``) row, tokenized as TRL will (the same template, ``tools`` and
    ``chat_template_kwargs`` over ``config_kwargs``, no truncation), whose assistant mask must pass
    ``assistant_mask_problems`` (I2); not checked on a multimodal processor (TRL renders through it).

    Raises:
        InputError: TRL cannot make the template mark assistant turns, or the I2 row's loss leaves out the
            end-of-turn.
        InvariantError: the I2 row does not start with the RL prompt ids, or the I2 row's or the messages row's
            assistant mask covers more than the assistant replies and their end-of-turn tokens (I2).
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
    if messages_row is not None and tok is tokenizer:
        _check_messages_row(tok, name, stop_ids, messages_row, config_kwargs, training)
    if i2_row is None:
        return training
    row = tokenize_i2_row(i2_row, tok, stop_ids, config_kwargs, training, assistant_masks=True)
    mask = [int(c and a) for c, a in zip(row["completion_mask"], row["assistant_masks"])]
    in_loss = [t for t, m in zip(row["input_ids"], mask) if m]
    if in_loss and in_loss[-1] not in stop_ids and templates.writes_stop_after_turn(tok, stop_ids, training):
        raise InputError(
            f"assistant_only_loss=True on the chat template of {name!r}: its `{{% generation %}}` block ends before "
            f"the end-of-turn token, so the first row's loss ends with {tok.decode(in_loss[-1:])!r}, not a stop "
            f"token {stop_ids}, and SFT would never teach the model to stop (I2). Move `{{% endgeneration %}}` "
            "after the end-of-turn token, or drop assistant_only_loss: on prompt/completion rows "
            "completion_only_loss already trains on the response and its end-of-turn token only."
        )
    kw = {**(config_kwargs or {}), **(i2_row.get("chat_template_kwargs") or {})}
    _check_first_row_mask(tok, name, stop_ids, row["input_ids"], mask, i2_row["completion"], kw, training,
                          "prompt/completion rows", "completion",
                          "drop assistant_only_loss: completion_only_loss then trains the whole completion.")
    return training


def warn_whitespace_in_loss(notes: list[str]) -> None:
    """The one warning for assistant masks that also cover whitespace around the turn (``span_problems``)."""
    logger.warning(
        "assistant_only_loss=True: the chat template's `{%% generation %%}` blocks also mark whitespace the template "
        "writes around the assistant turn, which SFT then trains and RL never generates (TRL's Qwen2.5 and Qwen3 "
        "training templates close the block after the newline that follows the end-of-turn token): %s. No response "
        "token is affected; a template whose blocks close right after the end-of-turn token trains the responses "
        "and their end-of-turn tokens only, as I2 asks.", "; ".join(dict.fromkeys(notes)))


# what a template's `{% generation %}` block must hold, said by every error about it
MARKERS_RULE = ("Under assistant_only_loss TRL trains on what the chat template's `{% generation %}` ... "
                "`{% endgeneration %}` blocks mark: each must open right after the generation prompt (the text "
                "add_generation_prompt writes, where RL's prompt ends) and close right after the assistant's "
                "end-of-turn token, and only assistant messages may be marked.")


def _check_messages_row(tok, name: str, stop_ids: list[int], row: dict, config_kwargs: dict | None,
                        training: str | None) -> None:
    """The first ``messages`` row's assistant mask, as TRL will tokenize it (``assistant_only_template``)."""
    row = maybe_convert_to_chatml(copy.deepcopy(dict(row)))  # TRL's conversion of `conversations` rows
    messages = row["messages"]
    kw = {**(config_kwargs or {}), **(row.get("chat_template_kwargs") or {})}
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                  chat_template=training, tools=_row_tools(row.get("tools")), **kw)
    _check_first_row_mask(tok, name, stop_ids, list(out["input_ids"]), list(out["assistant_masks"]), messages, kw,
                          training, "`messages` rows", "tokens",
                          "pass prompt/completion rows (grpotrl tokenizes those for I2 itself); `guard_steps=0` turns "
                          "this check off (and trains what TRL would).")


def _check_first_row_mask(tok, name: str, stop_ids: list[int], ids: list[int], mask: list[int], messages: list[dict],
                          kw: dict, training: str | None, rows: str, part: str, otherwise: str) -> None:
    """``assistant_mask_problems`` on the first row's mask (``ids`` [L], ``mask`` [L]: 1 where the loss is), its
    generation prompt rendered with the row's ``kw``: an ``InvariantError`` naming ``rows`` and the row's ``part``,
    with the fix and ``otherwise``; whitespace around the turns, one warning."""
    gen = templates.generation_prompt_ids(tok, **kw)  # RL's: the tokenizer's own template, this row's kwargs
    notes: list[str] = []
    problems = assistant_mask_problems(tok, ids, mask, stop_ids, [gen],
                                       templates.writes_stop_after_turn(tok, stop_ids, training), messages,
                                       whitespace=notes)
    if problems:
        which = (f"TRL's training template for {name!r} (trl.chat_template_utils.get_training_chat_template)"
                 if training is not None else f"the chat template of {name!r}")
        raise InvariantError(
            "I2",
            f"assistant_only_loss=True on {rows}: {which} marks the first row's {part} wrongly: "
            + "; ".join(problems) + ".\n"
            f"    in the loss: {_clip(_decode(tok, [t for t, m in zip(ids, mask) if m]))!r}\n"
            f"    stop ids {stop_ids}\n"
            f"{MARKERS_RULE} Fix the template's markers (`chat_template_path`, or `tokenizer.chat_template`), or "
            + otherwise
        )
    if notes:
        warn_whitespace_in_loss(notes)


def loss_spans(mask) -> list[tuple[int, int]]:
    """The maximal runs of true entries of ``mask``, as ``(start, end)`` pairs, ``end`` exclusive.

    >>> loss_spans([0, 1, 1, 0, 1])
    [(1, 3), (4, 5)]
    """
    spans, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans + ([(start, len(mask))] if start is not None else [])


def span_problems(tokenizer, ids: list[int], spans: list[tuple[int, int]], stop_ids: list[int],
                  gen_prompts: list[list[int]] | None = None, ends_with_stop: bool = True,
                  start_cut: bool = False, end_cut: bool = False, whitespace: list[str] | None = None,
                  per_turn: bool = False) -> list[str]:
    """What is wrong with the loss spans ``spans`` (``(start, end)`` in ``ids``, a row's real tokens), claiming
    only what holds: each starts right after one of ``gen_prompts`` (the template's generation prompt, one per set
    of chat_template_kwargs, as ids or, where tokens merged across the turn boundary, as text; None, or a set
    whose template writes none: not checked), and ends with a stop token when ``ends_with_stop`` (the template
    writes one after an assistant turn). ``start_cut``: truncation removed the row's beginning, so a span whose
    generation prompt would reach before ``ids`` is not checked there; ``end_cut``: it removed the row's end, so
    a span reaching the end of ``ids`` is not checked there. ``whitespace`` (a list, given where TRL's own
    tokenization is checked): a span that also covers whitespace the template writes around the turn -- the
    newline after the stop token, the last newline of the generation prompt, as TRL's Qwen2.5 and Qwen3 training
    templates mark -- is no problem but a sentence appended there (text RL never generates, no response token).
    ``per_turn``: each span is one assistant turn (assistant masks), so one that holds a stop token before its
    last token, followed by text, runs past its turn (the next turn's header and text in the loss). Returns one
    sentence per problem, naming the span by its decoded text where there are several."""
    problems = []
    check_start = bool(gen_prompts) and all(gen_prompts)  # a template may write none (Mistral's)
    longest = max((len(g) for g in gen_prompts), default=0) if check_start else 0
    gen_texts = [_decode(tokenizer, g) for g in gen_prompts] if check_start else []
    stops = set(stop_ids)
    for k, (s, e) in enumerate(spans):
        what = ("the loss" if len(spans) == 1 else
                f"loss span {k + 1} of {len(spans)} ({_clip(_decode(tokenizer, ids[s:e]))!r})")
        if check_start and not (start_cut and s < longest) and not _after_generation_prompt(
                tokenizer, ids, s, gen_prompts, gen_texts):
            inside = _inside_generation_prompt(tokenizer, ids, s, gen_prompts) if whitespace is not None else None
            before = _decode(tokenizer, ids[max(0, s - len(gen_prompts[0])):s])
            if inside is not None:
                whitespace.append(f"spans start with {inside!r}, the end of the generation prompt")
            else:
                problems.append(f"{what} starts after {before!r}, not after the generation prompt "
                                f"{_decode(tokenizer, gen_prompts[0])!r}")
        inner = [j for j in range(s, e - 1) if ids[j] in stops]  # stop tokens before the span's last token
        if per_turn and ends_with_stop and inner and _decode(tokenizer, ids[inner[0] + 1:e]).strip():
            problems.append(f"{what} runs past the end of its turn: after the stop token "
                            f"{_decode(tokenizer, ids[inner[0]:inner[0] + 1])!r} it holds "
                            f"{_clip(_decode(tokenizer, ids[inner[0] + 1:e]))!r}, text RL never generates")
        if ends_with_stop and not (end_cut and e == len(ids)) and ids[e - 1] not in stops:
            after = next((j for j in range(e - 1, s - 1, -1) if ids[j] in stops), None)
            trailer = None if after is None else _decode(tokenizer, ids[after + 1:e])
            if whitespace is not None and trailer is not None and not trailer.strip():
                whitespace.append(f"spans end with {trailer!r} after the stop token "
                                  f"{_decode(tokenizer, ids[after:after + 1])!r}")
            else:
                problems.append(
                    f"{what} ends with {_decode(tokenizer, ids[e - 1:e])!r}, not a stop token" + (
                        "" if after is None else f" ({trailer!r} after the stop token "
                        f"{_decode(tokenizer, ids[after:after + 1])!r}: what the template writes after the turn, "
                        "which RL never generates)"))
    return problems


def _after_generation_prompt(tokenizer, ids: list[int], s: int, gen_prompts: list[list[int]],
                             gen_texts: list[str]) -> bool:
    """Whether position ``s`` of ``ids`` follows one of ``gen_prompts``: its ids, or its text where the
    tokenizer merged the prompt's first token with the end of the turn before it (a template whose delimiters
    are not special tokens of this tokenizer)."""
    if any(ids[max(0, s - len(g)):s] == g for g in gen_prompts):
        return True
    return any(_decode(tokenizer, ids[max(0, s - len(g) - 2):s]).endswith(t) for g, t in zip(gen_prompts, gen_texts))


def _inside_generation_prompt(tokenizer, ids: list[int], s: int, gen_prompts: list[list[int]]) -> str | None:
    """The text of the generation prompt's last tokens where position ``s`` of ``ids`` lies inside one of
    ``gen_prompts`` and only whitespace of it follows ``s``; None otherwise."""
    for g in gen_prompts:
        for k in range(1, len(g)):
            rest = _decode(tokenizer, g[k:])
            if ids[max(0, s - k):s] == g[:k] and ids[s:s + len(g) - k] == g[k:] and not rest.strip():
                return rest
    return None


def assistant_mask_problems(tokenizer, ids: list[int], mask: list[int], stop_ids: list[int],
                            gen_prompts: list[list[int]] | None = None, ends_with_stop: bool = True,
                            messages: list[dict] | None = None, start_cut: bool = False,
                            end_cut: bool = False, whitespace: list[str] | None = None) -> list[str]:
    """I2 on one tokenized row's assistant mask (``ids`` its real tokens, ``mask`` 1 where TRL trains): every
    maximal masked span passes ``span_problems`` (right after a generation prompt, ending with a stop token,
    where verifiable). Given the row's ``messages`` (untruncated: ``start_cut`` and ``end_cut`` False), also: no
    more spans than assistant messages, and where there are as many, span k's text ends with the last line of the
    k-th assistant message's content before its stop token, whitespace aside (holds it, where the message also
    has tool calls, which templates write after the content, or the template writes no stop token; a message
    without text content, such as a tool call, is not compared; a template may trim content or drop a reasoning block before it, never its last line).
    ``whitespace``: as ``span_problems``'s. Returns one sentence per problem (none: the mask is what I2 asks)."""
    spans = loss_spans(mask)
    problems = span_problems(tokenizer, ids, spans, stop_ids, gen_prompts, ends_with_stop, start_cut, end_cut,
                             whitespace, per_turn=True)
    if messages is None:
        return problems
    replies = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    if len(spans) > len(replies):
        problems.append(f"the assistant mask has {len(spans)} spans and the row {len(replies)} assistant "
                        f"message{'s' * (len(replies) != 1)}")
    elif len(spans) == len(replies) and not (start_cut or end_cut):
        for k, ((s, e), reply) in enumerate(zip(spans, replies)):
            content = reply.get("content")
            lines = [ln for ln in content.splitlines() if ln.strip()] if isinstance(content, str) else []
            text = _decode(tokenizer, ids[s:e])
            if not lines:
                continue
            last = " ".join(lines[-1].split())
            # without tool calls the turn's text ends with its content: the content's last line is the span's
            # last text before its stop token (a one-character answer found anywhere in the span proves nothing)
            stop = next((j for j in range(e - 1, s - 1, -1) if ids[j] in stop_ids), None) if ends_with_stop else None
            ends = stop is not None and not reply.get("tool_calls")  # else: where the content ends is not known
            held = " ".join(_decode(tokenizer, ids[s:stop]).split()).endswith(last) if ends \
                else last in " ".join(text.split())
            if not held:
                verb = "end with" if ends else "hold"
                problems.append(f"loss span {k + 1} ({_clip(text)!r}) does not {verb} assistant message {k + 1}'s "
                                f"content {_clip(lines[-1])!r}")
    return problems


def _decode(tokenizer, ids: list[int]) -> str:
    return templates._tok(tokenizer).decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + "..."
