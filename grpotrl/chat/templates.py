"""Chat templates shared by SFT and RL (INVARIANT I2), and the stop tokens they imply.

* ``stop_token_ids``: the tokenizer's eos, the template's end-of-turn token and every id of
  ``generation_config.eos_token_id``.
* ``template_fingerprint``: a hash of what decides prompt tokenization, stored beside every
  checkpoint (``grpotrl_template.json``, ``save_fingerprint``) and compared when RL starts from it
  (``check_fingerprint``), together with the ``chat_template_kwargs`` and the ``tools`` the prompts were
  rendered with (``grpo_tool_sets``: the tools TRL's GRPOTrainer renders) and the template SFT rendered its
  rows with where the tokenizer does not carry it (TRL's ``{% generation %}`` variant under ``assistant_only_loss``).
* ``tokenize_sft_example``: SFT tokenization of a conversational prompt-completion row whose prefix
  is exactly the RL prompt ids and whose loss covers the response up to its end-of-turn token,
  nothing after.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import types
from collections.abc import Mapping
from typing import Any

from transformers.utils import get_json_schema
from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving
from trl.data_utils import maybe_convert_to_chatml

from ..errors import InputError, InvariantError

logger = logging.getLogger(__name__)

FINGERPRINT_FILE = "grpotrl_template.json"
_PROBE = "grpotrl-probe-7f3a"
# Conversations whose generation-prompt rendering shows what chat_template_kwargs change (the first
# one the template accepts: some templates refuse a system message)
_KWARGS_PROBES = ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                  [{"role": "user", "content": "u"}])


def _tok(processing_class):
    return getattr(processing_class, "tokenizer", processing_class)


def chat_template_of(processing_class, chat_template: str | None = None) -> str | None:
    """The template prompts are rendered with: ``chat_template`` when given, else the processing
    class's own (a VLM processor may carry it instead of its tokenizer), else its tokenizer's."""
    return (chat_template or getattr(processing_class, "chat_template", None)
            or getattr(_tok(processing_class), "chat_template", None))


def require_chat_template(tokenizer, chat_template: str | None = None) -> None:
    if chat_template_of(tokenizer, chat_template) is None:
        raise InputError(
            f"The tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat template, "
            "and the data is conversational. grpotrl trains SFT and RL on the same chat template (INVARIANT I2). "
            "Use an instruct/chat checkpoint, or give SFT one: `chat_template_path` in the SFT recipe or SFTConfig "
            "(a .jinja file, or a tokenizer directory / Hub id whose template is cloned, as trl does); GRPO then "
            "starts from the SFT checkpoint, whose tokenizer carries it. In Python, `tokenizer.chat_template = ...` "
            "before building the trainer works for both."
        )


def end_of_turn_token_id(tokenizer, chat_template: str | None = None) -> int | None:
    """The special token the template writes right after an assistant message, if any."""
    tok = _tok(tokenizer)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    text = tok.apply_chat_template(msgs, tokenize=False, chat_template=chat_template)
    tail = text.split(_PROBE, 1)[-1] if _PROBE in text else ""
    ids = tok(tail, add_special_tokens=False)["input_ids"]
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    for i in ids:
        if i in special:
            return i
    return None


def stop_token_ids(tokenizer, generation_config=None, chat_template: str | None = None) -> list[int]:
    """Every id that ends a response: eos, the template's end-of-turn, generation_config's eos ids."""
    tok = _tok(tokenizer)
    ids: list[int] = []
    if tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    if (chat_template or tok.chat_template) is not None:
        eot = end_of_turn_token_id(tok, chat_template)
        if eot is not None:
            ids.append(eot)
    gen_eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(gen_eos, int):
        gen_eos = [gen_eos]
    ids.extend(gen_eos or [])
    ids = list(dict.fromkeys(int(i) for i in ids))
    if not ids:
        raise InputError(
            f"Cannot determine the stop tokens of {getattr(tok, 'name_or_path', '?')!r}: the tokenizer has no "
            "eos_token, the chat template writes no special end-of-turn token and generation_config has no "
            "eos_token_id. Set `tokenizer.eos_token` or `generation_config.eos_token_id`."
        )
    return ids


def prompt_ids(tokenizer, messages: list[dict], chat_template: str | None = None, **template_kwargs) -> list[int]:
    """The RL prompt: the chat template with the generation prompt appended (I1)."""
    out = _tok(tokenizer).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True,
        chat_template=chat_template, **template_kwargs,
    )
    return list(out["input_ids"])


def generation_prompt_ids(tokenizer, chat_template: str | None = None, **template_kwargs) -> list[int]:
    """The ids the template appends for ``add_generation_prompt`` (e.g. ``<|im_start|>assistant\n``):
    every RL prompt ends with them, so every SFT loss span must start right after them. They follow
    what both renderings share: a template may end a conversation without the generation prompt
    with more than the last turn (Phi-3's eos)."""
    probe = [{"role": "user", "content": "x"}]
    with_gen = prompt_ids(tokenizer, probe, chat_template, **template_kwargs)
    without = _tok(tokenizer).apply_chat_template(
        probe, tokenize=True, return_dict=True, chat_template=chat_template, **template_kwargs
    )["input_ids"]
    return list(with_gen[_common_prefix(with_gen, without):])


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tokenize_sft_example(
    tokenizer, prompt: list[dict], completion: list[dict], stop_ids: list[int], chat_template: str | None = None,
    *, training_template: str | None = None, tools: list | None = None, assistant_masks: bool = False,
    end_of_turn: int | None = None, **template_kwargs,
) -> dict[str, list[int]]:
    """I2 tokenization of one conversational prompt-completion row.

    What ``trl.SFTTrainer`` (1.16) does for such a row -- the prompt with the generation prompt,
    prompt + completion rendered whole, the same ``tools`` and ``template_kwargs`` -- with two
    differences: the RL prompt ids (``chat_template``, the template RL renders prompts with) must be
    a prefix of the sequence (TRL warns and trains on the divergent rendering), and the sequence ends
    at the last end-of-turn token of the completion (TRL also trains on what the template writes after
    it, e.g. ChatML's newline, or Phi-3's newline and eos at the end of a conversation, none of which
    RL generates: it stops at the end-of-turn). ``end_of_turn`` is that token's id
    (``end_of_turn_token_id``; computed from the template when not given); where the template writes
    none that is in ``stop_ids``, the sequence ends at its last stop token. ``training_template``
    renders prompt + completion when it differs from ``chat_template`` (TRL's ``{% generation %}``
    variant for ``assistant_masks``). Returns ``input_ids`` and ``completion_mask`` (and
    ``assistant_masks``).
    """
    tok = _tok(tokenizer)
    kw = {"tools": tools, **template_kwargs}
    p_ids = list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         chat_template=chat_template, **kw)["input_ids"])
    out = tok.apply_chat_template(prompt + completion, tokenize=True, return_dict=True,
                                  chat_template=training_template or chat_template,
                                  return_assistant_tokens_mask=assistant_masks, **kw)
    full = list(out["input_ids"])
    if full[: len(p_ids)] != p_ids:
        p_text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False,
                                         chat_template=chat_template, **kw)
        f_text = tok.apply_chat_template(prompt + completion, tokenize=False,
                                         chat_template=training_template or chat_template, **kw)
        merged = f_text.startswith(p_text)  # same text: tokens merge across the prompt/response boundary
        if merged and not assistant_masks:  # RL's prompt ids, then the response as RL would generate it
            full = p_ids + list(tok(f_text[len(p_text):], add_special_tokens=False)["input_ids"])
        else:
            n = _common_prefix(p_ids, full)
            raise InvariantError(
                "I2",
                "SFT tokenization of (prompt, response) does not start with the RL prompt ids, so SFT would "
                "train on a context RL never shows the model.\n"
                f"  RL prompt from token {n}:  {tok.decode(p_ids[n:n + 12])!r}\n"
                f"  SFT sequence from token {n}: {tok.decode(full[n:n + 12])!r}\n"
                + ("The text is the same but the tokenizer merges tokens across the prompt/response boundary, "
                   "which grpotrl re-tokenizes only without assistant_only_loss." if merged else
                   "Use a chat template that renders the prompt identically with and without the assistant turn."),
            )
    if end_of_turn is None:
        end_of_turn = end_of_turn_token_id(tok, training_template or chat_template)
    ends = [i + 1 for i in range(len(p_ids), len(full)) if full[i] == end_of_turn and end_of_turn in stop_ids]
    if not ends:  # no end-of-turn among the stop tokens, or none in this completion
        ends = [i + 1 for i in range(len(p_ids), len(full)) if full[i] in set(stop_ids)]
    end = ends[-1] if ends else len(full)  # after the last end-of-turn: the template's trailer is cut
    row = {"input_ids": full[:end], "completion_mask": [0] * len(p_ids) + [1] * (end - len(p_ids))}
    if assistant_masks:
        mask = list(out["assistant_masks"])
        if 1 not in mask:  # trl's own check, same words
            raise RuntimeError(
                "You're using `assistant_only_loss=True`, but at least one example has no assistant tokens. This "
                "usually means the tokenizer's chat template doesn't generate assistant masks — it may be missing "
                "the `{% generation %}` keyword. Please check the template and ensure it's correctly configured to "
                "support assistant masking."
            )
        row["assistant_masks"] = mask[:end]
    return row


def writes_stop_after_turn(tokenizer, stop_ids: list[int], chat_template: str | None = None) -> bool:
    """Whether the template ends an assistant message with one of ``stop_ids`` (a template that writes
    no end-of-turn token cannot teach the model to stop, and I2's last loss token cannot be one)."""
    tok = _tok(tokenizer)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    text = tok.apply_chat_template(msgs, tokenize=False, chat_template=chat_template)
    tail = text.split(_PROBE, 1)[-1] if _PROBE in text else ""
    return any(i in set(stop_ids) for i in tok(tail, add_special_tokens=False)["input_ids"])


def template_fingerprint(tokenizer, chat_template: str | None = None) -> dict[str, Any]:
    """What decides how prompts are tokenized, hashed: ``sha256`` of the template and the special tokens (what
    renders the prompt text), and ``vocab_sha256`` / ``vocab_size`` of the vocabulary, added tokens included,
    with ``added_tokens`` to name a difference (what turns that text into ids: one template over a vocabulary
    with other or fewer tokens renders the same text into other ids). Equal fingerprints mean equal RL prompts."""
    tok = _tok(tokenizer)
    vocab = tok.get_vocab()
    return {"sha256": _template_sha256(tok, chat_template), "specials": _specials(tok),
            "vocab_sha256": _vocab_sha256(vocab), "vocab_size": len(vocab), "added_tokens": _added_tokens(tok)}


def _specials(tok) -> dict[str, str | None]:
    return {k: getattr(tok, k, None) for k in ("bos_token", "eos_token", "pad_token")}


def _template_sha256(tok, chat_template: str | None = None) -> str:
    """The template's and the special tokens' part of the fingerprint (``sha256``)."""
    blob = json.dumps({"template": chat_template or tok.chat_template or "", "specials": _specials(tok)},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _vocab_sha256(vocab: dict[str, int], below: int | None = None) -> str:
    """The vocabulary's (token, id) pairs, by id, hashed; those with an id below ``below`` only, when given (a
    vocabulary grown by tokens appended after ``below`` ids hashes as it did before it grew)."""
    pairs = [kv for kv in vocab.items() if below is None or kv[1] < below]
    blob = json.dumps(sorted(pairs, key=lambda kv: (kv[1], kv[0])), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def _added_tokens(tok) -> dict[str, str]:
    """The tokenizer's added tokens, ``{id: content}`` (ids as JSON keys)."""
    return {str(i): t.content for i, t in sorted(tok.added_tokens_decoder.items())}


def _vocab_difference(saved: dict, tok) -> str:
    """What the checkpoint's recorded vocabulary and ``tok``'s differ in, as far as the record tells: the sizes
    and the added tokens either side lacks (the usual cause: tokens added in SFT, then the base tokenizer loaded)."""
    said = f"the checkpoint's tokenizer has {saved.get('vocab_size', '?')} tokens, this run's {len(tok.get_vocab())}"
    theirs, mine = saved.get("added_tokens"), _added_tokens(tok)
    if not isinstance(theirs, dict):
        return said

    for whose, these, others in (("the checkpoint's", theirs, mine), ("this run's", mine, theirs)):
        only = sorted((i for i, t in these.items() if others.get(i) != t), key=int)
        if only:
            said += (f"; added tokens only {whose} has: " + ", ".join(f"{i} {these[i]!r}" for i in only[:5])
                     + (f" and {len(only) - 5} more" if len(only) > 5 else ""))
    return said


def save_fingerprint(output_dir: str, tokenizer, *, chat_template_kwargs: list[dict] | None = None,
                     trained_on_template: bool = True, tools: list[list[dict] | None] | None = None, trained_template: str | None = None) -> None:
    """Write ``grpotrl_template.json`` for ``tokenizer``, the one saved beside the weights (what a run from the
    checkpoint loads): its template's ``sha256``, ``specials`` and ``template``, plus keys older files lack, which
    readers then treat as "not recorded": ``vocab_sha256``, ``vocab_size`` and ``added_tokens`` (the vocabulary,
    ``template_fingerprint``), ``chat_template_kwargs`` (every distinct set of kwargs the prompts were rendered with;
    written only when known), ``tools`` (every distinct set of tool schemas the prompts were rendered with, null for
    none; written only when known), ``trained_on_template`` (False when SFT trained on plain text or pre-tokenized
    rows, which no template rendered) and ``trained_template`` with its ``trained_sha256`` (``_template_sha256``):
    the template that rendered the data where it is not the tokenizer's (written only then: SFT's TRL
    ``{% generation %}`` variant under ``assistant_only_loss``, GRPO's ``self.chat_template``, TRL's prefix-preserving
    variant for tools); TRL never writes it into the tokenizer, so the record's own template stays the tokenizer's."""
    os.makedirs(output_dir, exist_ok=True)
    tmp = os.path.join(output_dir, FINGERPRINT_FILE + ".tmp")
    record = {**template_fingerprint(tokenizer), "template": _tok(tokenizer).chat_template or "",
              "trained_on_template": trained_on_template}
    if chat_template_kwargs is not None:
        record["chat_template_kwargs"] = chat_template_kwargs
    if tools is not None:
        record["tools"] = tools
    trained_sha = _template_sha256(_tok(tokenizer), trained_template) if trained_template else None
    if trained_sha not in (None, record["sha256"]):
        record.update(trained_template=trained_template, trained_sha256=trained_sha)
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, os.path.join(output_dir, FINGERPRINT_FILE))


def tool_schema_sets(tool_sets: list[list | None]) -> list[list[dict] | None]:
    """The distinct sets of ``tool_sets`` as JSON schemas, the way a chat template renders them (a dict as
    it is, a function or method by transformers' ``get_json_schema``, as ``apply_chat_template`` does;
    None stays None): what ``save_fingerprint`` records."""
    schemas = [None if tools is None else [t if isinstance(t, dict) else get_json_schema(t) for t in tools]
               for tools in tool_sets]
    return list({json.dumps(s): s for s in schemas}.values())  # key order kept: a template's tojson writes it


def grpo_tool_sets(tools: list | None, environment_factory=None) -> list[list | None] | None:
    """The tools ``trl.GRPOTrainer`` renders its prompts with, one list per way (None: no tools, as TRL
    passes an empty list): ``tools``; with an ``environment_factory`` (or a dict of them), per environment,
    ``tools`` plus the environment's public methods but ``reset`` and ``get_reward`` (TRL lists them on the
    class of one instance it creates). Known before any environment exists only where each factory is a
    class; None otherwise."""
    tools = list(tools or [])
    if environment_factory is None:
        return [tools or None]
    factories = environment_factory.values() if isinstance(environment_factory, Mapping) else [environment_factory]
    sets = []
    for cls in factories:
        if not inspect.isclass(cls):
            return None
        methods = [fn if isinstance(inspect.getattr_static(cls, name), staticmethod) else types.MethodType(fn, cls)
                   for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
                   if name not in ("reset", "get_reward") and not name.startswith("_")]  # bound: no ``self``
        sets.append(tools + methods or None)
    return sets


def grpo_prompt_template(processing_class, tool_sets: list[list | None] | None) -> str | None:
    """The template ``trl.GRPOTrainer`` renders prompts with, as its ``__init__`` decides: TRL's prefix-preserving
    training template where tools are given and the processing class's own template is not prefix-preserving
    (``trl.chat_template_utils``); None, its own template, otherwise. ``tool_sets``: ``grpo_tool_sets`` (None:
    known only once TRL builds the environments; None is returned).

    Raises:
        InputError: tools are given and TRL has no prefix-preserving variant of the template (it raises once the
            model is loaded).
    """
    if not tool_sets or not any(tool_sets) or chat_template_of(processing_class) is None:
        return None
    if is_chat_template_prefix_preserving(processing_class):
        return None
    try:
        return get_training_chat_template(processing_class)
    except ValueError as e:
        raise InputError(
            f"Tools are given and the chat template of {getattr(_tok(processing_class), 'name_or_path', '?')!r} "
            f"does not render earlier turns alike whatever follows (not prefix-preserving), which the tool loop "
            f"needs; TRL has no prefix-preserving variant of it ({e}). Give a prefix-preserving template "
            "(`tokenizer.chat_template = ...`, the same for SFT and GRPO), or train without tools."
        ) from e


PROMPTS_RENDERED = 4096  # the prompts (SFT: rows) the render-alike checks render (a warning names those past it)
# where the template a checkpoint was trained on is not its tokenizer's (the fingerprint's ``trained_template``)
TRAINED_VARIANT = ("TRL's training template (grpotrl.SFTTrainer renders its rows with it under `assistant_only_loss` "
                   "on a chat template without `{% generation %}` markers, trl.GRPOTrainer its prompts with tools on "
                   "one that is not prefix-preserving; the checkpoint's tokenizer keeps the original)")


def _rows_ahead(dataset, columns: tuple[str, ...], what: str, why: str) -> dict | None:
    """The first ``PROMPTS_RENDERED`` rows of ``dataset``, those of its ``columns`` it has (``dataset[:n]``), a warning
    (``why``) naming the rows past them; None, with a warning, where the rows cannot be read ahead (a stream, none
    of ``columns``)."""
    present = [c for c in columns if c in (getattr(dataset, "column_names", None) or [])]
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "select_columns") or not present:
        logger.warning(why + "; the %s cannot be read ahead, so I2 does not compare how the two render them.", what)
        return None
    if len(dataset) > PROMPTS_RENDERED:
        logger.warning(why + ": I2 compares how the two render the first %d %s of %d only.",
                       PROMPTS_RENDERED, what, len(dataset))
    return dataset.select_columns(present)[:PROMPTS_RENDERED]


def _rendering_difference(tok, conversation: list[dict], first: str | None, second: str | None, kwargs: dict,
                          add_generation_prompt: bool) -> tuple[str, str] | None:
    """``conversation`` rendered under the templates ``first`` and ``second`` (None: the tokenizer's own): None when
    the texts are equal, else each one's differing part (from 40 characters before the first difference to the common
    end, cut to 300)."""
    a, b = (tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False,
                                    chat_template=t, **kwargs) for t in (first, second))
    if a == b:
        return None
    n = _common_prefix(list(a), list(b))
    m = _common_prefix(list(a[n:])[::-1], list(b[n:])[::-1])
    return a[max(0, n - 40):len(a) - m][:300], b[max(0, n - 40):len(b) - m][:300]


def check_prompts_render_alike(tokenizer, rl_template: str | None, dataset, tool_sets: list[list | None],
                               kwargs: dict, model_dir: str | None = None, sft_template: str | None = None) -> None:
    """I2 where GRPO renders its prompts with another template than the one the checkpoint was trained on: TRL's
    prefix-preserving training template for tools (``rl_template``, ``grpo_prompt_template``; None: the tokenizer's
    own), or the checkpoint was trained on ``TRAINED_VARIANT`` (``sft_template``, the fingerprint's
    ``trained_template``; None: the tokenizer's own). Every conversational prompt of ``dataset`` (its ``prompt``
    column, the first ``PROMPTS_RENDERED`` rows; a stream's: none, a warning says so), with each tool set and
    ``kwargs``, must render to the same text under both (TRL's variants differ in earlier turns: Qwen3's keeps an
    earlier assistant turn's reasoning, which the original drops).

    Raises:
        InvariantError: a prompt the checkpoint was trained on otherwise (I2).
    """
    tok = _tok(tokenizer)
    if sft_template is None:  # GRPO swaps in TRL's variant for the tools
        why = ("TRL renders this run's prompts with its prefix-preserving training template, not the one the model "
               "was fine-tuned on")
        fix = ("Fine-tune on the template GRPO renders with (`tokenizer.chat_template = trl.chat_template_utils."
               "get_training_chat_template(tokenizer)` before SFT; GRPO then takes the tokenizer with its original "
               "template, which TRL swaps for that one)")
    else:  # the checkpoint was trained on TRL's variant, the tokenizer saved beside the weights keeps the original
        why = ("The model was trained on conversations rendered with TRL's training template (SFT's under "
               "assistant_only_loss, GRPO's for tools), not with the template this run renders its prompts with")
        fix = ("Render GRPO's prompts with the template the checkpoint was trained on: `tokenizer.chat_template = trl."
               "chat_template_utils.get_training_chat_template(tokenizer)` on the checkpoint's tokenizer, passed as "
               "`processing_class` (the fingerprint's `trained_template`; set it before SFT too and the checkpoint's "
               "tokenizer carries it); or fine-tune on prompt/completion rows without assistant_only_loss (grpotrl "
               "renders their prompts with the tokenizer's own template, as GRPO does)")
    rows = _rows_ahead(dataset, ("prompt",), "prompts", why)
    for i, prompt in enumerate((rows or {}).get("prompt", [])):
        if not isinstance(prompt, list):
            continue
        for tools in tool_sets:
            diff = _rendering_difference(tok, prompt, sft_template, rl_template, {**kwargs, "tools": tools or None},
                                         add_generation_prompt=True)
            if diff is None:
                continue
            model = model_dir or "the model"
            if sft_template is None:
                head = (f"trl.GRPOTrainer renders prompts with its prefix-preserving training template (tools are "
                        f"given and the chat template of {getattr(tok, 'name_or_path', '?')!r} is not prefix-"
                        f"preserving), and it renders prompt {i} otherwise than the template {model!r} was fine-tuned "
                        "on:\n")
            else:
                head = (f"grpotrl rendered the rows {model!r} was trained on with {TRAINED_VARIANT}, and this run "
                        f"renders prompt {i} otherwise:\n")
            raise InvariantError(
                "I2",
                head + f"  checkpoint's template: ...{diff[0]!r}\n  GRPO's template:       ...{diff[1]!r}\n"
                f"RL would train on a context the model was never trained on. {fix}, or set `check_template=False` if "
                "the difference is deliberate.",
            )


def _sft_conversation(row: dict) -> tuple[list | None, dict]:
    """What ``trl.SFTTrainer`` renders of an SFT row: its conversation (``messages``, ``conversations`` in
    ChatML after TRL's conversion, or ``prompt`` + ``completion``; None for text rows) and its ``tools`` (a list or
    its JSON) as template kwargs."""
    row = maybe_convert_to_chatml(dict(row))
    messages = row.get("messages")
    if messages is None and isinstance(row.get("prompt"), list) and isinstance(row.get("completion"), list):
        messages = row["prompt"] + row["completion"]
    tools = row.get("tools")
    return (messages if isinstance(messages, list) else None), {"tools": json.loads(tools) if isinstance(tools, str)
                                                                else tools}


def check_rows_render_alike(tokenizer, row_template: str | None, dataset, config_kwargs: dict | None,
                            model_dir: str | None, trained_template: str | None) -> None:
    """I2 for SFT from a grpotrl checkpoint: each conversational row of ``dataset`` (the first ``PROMPTS_RENDERED``;
    a stream's: none, a warning says so), whole, with its ``tools`` and ``chat_template_kwargs`` over
    ``config_kwargs`` (what TRL renders it with), must render to the same text under ``row_template`` (the template
    this SFT renders its rows with: TRL's ``{% generation %}`` variant under ``assistant_only_loss``; None: the
    tokenizer's own) as under ``trained_template`` (the one the checkpoint was trained on: the fingerprint's
    ``trained_template``, else its ``template``; None: the tokenizer's own). A second SFT on rows rendered otherwise
    would train the model on other contexts than it was trained on, and its own fingerprint would record only them,
    so GRPO after it could not tell.

    Raises:
        InvariantError: a row the checkpoint would have been trained on otherwise (I2).
    """
    tok = _tok(tokenizer)
    model = model_dir or "the model"
    if row_template is None:  # the checkpoint was trained on TRL's variant, this run renders the tokenizer's own
        why = f"{model} was trained on conversations rendered with TRL's training template, this SFT renders its rows "\
              "with the tokenizer's own"
        theirs = f"grpotrl rendered the rows {model!r} was trained on with {TRAINED_VARIANT}"
        fix = ("Train on the template the checkpoint was trained on: `assistant_only_loss=True` (TRL then renders the "
               "rows with the same training template), or `tokenizer.chat_template = trl.chat_template_utils."
               "get_training_chat_template(tokenizer)` on the checkpoint's tokenizer, passed as `processing_class`")
    else:  # this run renders with TRL's variant, the checkpoint was trained on the tokenizer's own
        why = f"This SFT renders its rows with TRL's training template (assistant_only_loss), {model} was trained " \
              "on the tokenizer's own"
        theirs = (f"This run renders its rows with TRL's training template (`assistant_only_loss` on a chat template "
                  f"without `{{% generation %}}` markers) and {model!r} was trained on the template its tokenizer "
                  "carries")
        fix = ("Train on the template the checkpoint was trained on: drop assistant_only_loss (on prompt/completion "
               "rows completion_only_loss trains the response and its end-of-turn token only), or give the "
               "checkpoint's template `{% generation %}` markers around each assistant turn (`chat_template_path`, "
               "for both stages)")
    rows = _rows_ahead(dataset, ("messages", "conversations", "prompt", "completion", "tools", "chat_template_kwargs"),
                       "rows", why)
    if rows is None:
        return
    for i, row in enumerate(dict(zip(rows, values)) for values in zip(*rows.values())):
        conversation, kw = _sft_conversation(row)
        if conversation is None:
            continue
        kw.update({**(config_kwargs or {}), **(row.get("chat_template_kwargs") or {})})
        diff = _rendering_difference(tok, conversation, trained_template, row_template, kw,
                                     add_generation_prompt=False)
        if diff is not None:
            raise InvariantError(
                "I2",
                f"{theirs}, and row {i} renders otherwise under the two:\n  checkpoint's template: ...{diff[0]!r}\n"
                f"  this run's template:   ...{diff[1]!r}\nThis SFT would train the model on contexts it was not "
                f"trained on, and GRPO after it could not tell. {fix}; or set `check_template=False` if the change is "
                "deliberate.",
            )


def _kwargs_rendering(tokenizer, chat_template: str | None, kwargs: dict) -> list[int] | None:
    """The probe prompt's ids under ``kwargs``, or None when the template accepts no probe."""
    for probe in _KWARGS_PROBES:
        try:
            return prompt_ids(tokenizer, probe, chat_template, **kwargs)
        except Exception:  # noqa: BLE001 -- a template may raise on any message it does not support
            continue
    return None


def check_fingerprint(model_dir: str | None, tokenizer, chat_template: str | None = None,
                      revision: str | None = None, chat_template_kwargs: dict | None = None,
                      tool_sets: list[list | None] | None = None, vocabulary_may_grow: bool = False,
                      rl_template: str | None = None, prompts=None, tools_unknown: bool = False,
                      rows=None, row_template: str | None = None, row_kwargs: dict | None = None) -> bool:
    """I2 when a run starts from a checkpoint (a local directory or a Hub repo): one trained with another template is
    an error, and so are ``chat_template_kwargs`` (given: this run's; None: not compared) that render
    prompts differently from every set the checkpoint recorded, and ``tool_sets`` (given: this run's
    tools, one list or None per way its prompts are rendered, ``grpo_tool_sets``; None: not compared) of which
    one renders prompts (with this run's kwargs) differently from every set of tools the checkpoint
    recorded. A tokenizer whose vocabulary differs from the checkpoint's (where it recorded one) is an error
    too, whatever SFT trained on; with ``vocabulary_may_grow`` (SFT, which trains the tokens it adds) one that
    keeps every token of the checkpoint's at its id and appends others passes. Where this run renders with another
    template than the tokenizer's (GRPO's prompts: ``rl_template``, ``grpo_prompt_template``; SFT's rows:
    ``row_template``, TRL's ``{% generation %}`` variant under ``assistant_only_loss``), a checkpoint trained on that
    template passes. Where the checkpoint was trained on another template than its tokenizer's (the fingerprint's
    ``trained_template``: ``TRAINED_VARIANT``), this run's tokenizer may carry either, and rendering with the trained
    one passes. Otherwise, where this run renders with another template than the checkpoint was trained on, what it
    renders must render alike under both: GRPO's ``prompts`` (the dataset whose prompts it renders), each with each
    of ``tool_sets`` (None: with no tools; ``check_prompts_render_alike``); SFT's ``rows`` (its train dataset), each
    with its tools and ``chat_template_kwargs`` over ``row_kwargs`` (``check_rows_render_alike``).
    ``tools_unknown``: GRPO's tools are known only once TRL calls an ``environment_factory`` that is not a class;
    neither they nor the prompts' rendering are compared, and one warning says so. Returns whether a fingerprint was
    found (a base model without one passes). A checkpoint whose SFT trained on no template (plain text, pre-tokenized
    rows) has no template to compare: a warning says so.

    Raises:
        InvariantError: another template, vocabulary, kwargs rendering, tools rendering, prompt or row rendering than
            the checkpoint's (I2).
    """
    from ..models.sources import model_file

    path = model_file(model_dir, FINGERPRINT_FILE, revision)
    if path is None:
        return False
    with open(path) as f:
        saved = json.load(f)
    now = template_fingerprint(tokenizer, chat_template)
    size = saved.get("vocab_size")
    grown = (vocabulary_may_grow and isinstance(size, int) and now["vocab_size"] > size
             and _vocab_sha256(_tok(tokenizer).get_vocab(), below=size) == saved.get("vocab_sha256"))
    if saved.get("vocab_sha256") not in (None, now["vocab_sha256"]) and not grown:  # older files record none
        raise InvariantError(
            "I2",
            f"The checkpoint {model_dir!r} was trained with another vocabulary than this run's tokenizer "
            f"({_vocab_difference(saved, _tok(tokenizer))}): the same chat template would tokenize the prompts into "
            "ids the model never saw in SFT. Load the tokenizer saved with the checkpoint (the same path as the "
            "model), or set `check_template=False` if the change is deliberate.",
        )
    if saved.get("trained_on_template") is False:
        logger.warning("%s was fine-tuned on plain text or pre-tokenized rows, not on a chat template: I2 cannot "
                       "tell whether this run's chat template is the one the model learned.", model_dir)
        return True
    # what the checkpoint was trained on: the recorded template, or TRL's variant where its trainer rendered with that
    # (trained_sha256; older files record none); what this run renders with: TRL's variant for GRPO's tools
    # (rl_template) or SFT's assistant_only_loss (row_template), else the tokenizer's own. Either may be one of the
    # checkpoint's: where the two differ, each prompt (GRPO) or row (SFT) must render alike under both (checked below)
    trained = saved.get("trained_sha256") or saved.get("sha256")
    this = rl_template if rl_template is not None else row_template
    renders = _template_sha256(_tok(tokenizer), this) if this is not None else now["sha256"]
    if not {now["sha256"], renders} & {saved.get("sha256"), trained}:
        old, new = saved.get("template", ""), chat_template or _tok(tokenizer).chat_template or ""
        n = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        where = (f"templates differ from character {n}: checkpoint {old[max(0, n - 20):n + 40]!r} vs now "
                 f"{new[max(0, n - 20):n + 40]!r}" if old != new else
                 f"special tokens differ: checkpoint {saved.get('specials')} vs now {now['specials']}")
        raise InvariantError(
            "I2",
            f"The checkpoint {model_dir!r} was trained with another chat template than the one this run "
            f"would use ({where}). Training on it would show the model contexts rendered otherwise than the ones it "
            "was trained on. Load the "
            "tokenizer saved with the checkpoint, or set `check_template=False` if the change is deliberate.",
        )
    recorded = saved.get("chat_template_kwargs")
    if chat_template_kwargs is not None and recorded:
        mine = _kwargs_rendering(tokenizer, chat_template, chat_template_kwargs)
        theirs = [_kwargs_rendering(tokenizer, chat_template, kw) for kw in recorded]
        if mine is not None and mine not in theirs:
            tok = _tok(tokenizer)
            raise InvariantError(
                "I2",
                f"The checkpoint {model_dir!r} was trained on prompts rendered with chat_template_kwargs "
                f"{' or '.join(json.dumps(k) for k in recorded)}; this run's {json.dumps(chat_template_kwargs)} "
                f"renders them differently:\n  checkpoint: {tok.decode(theirs[0] or [])!r}\n  now:        "
                f"{tok.decode(mine)!r}\nSet `chat_template_kwargs` to what SFT used (e.g. Qwen3's enable_thinking), "
                "or `check_template=False` if the change is deliberate.",
            )
    recorded_tools = saved.get("tools")
    if tool_sets is not None and recorded_tools:
        _check_tools(model_dir, tokenizer, chat_template, chat_template_kwargs or {}, recorded_tools, tool_sets)
    if tools_unknown:  # GRPO with an environment_factory that is not a class
        logger.warning(
            "environment_factory is not a class, so the tools its environments expose are known only once TRL calls "
            "it: I2 does not compare them with the tools %s's prompts were rendered with%s. Pass the environment "
            "class itself to have them compared.", model_dir,
            "" if renders == trained else "; and, as the model was trained on conversations rendered with TRL's "
            "training template, which this run renders its prompts with only where the environments expose tools "
            "(else with the tokenizer's own), it does not compare how the two render them either")
    elif renders != trained and (rl_template is not None or prompts is not None):  # GRPO, which renders ``prompts``
        check_prompts_render_alike(tokenizer, rl_template, prompts, tool_sets or [None], chat_template_kwargs or {},
                                   model_dir, sft_template=saved.get("trained_template"))
    elif renders != trained and rows is not None:  # SFT, which renders ``rows``
        check_rows_render_alike(tokenizer, row_template, rows, row_kwargs, model_dir,
                                saved.get("trained_template") or saved.get("template") or None)
    return True


def _check_tools(model_dir, tokenizer, chat_template, kwargs: dict, recorded: list, tool_sets: list) -> None:
    """Each of this run's tool sets renders the probe prompt as one of the recorded sets does (I2)."""
    theirs = [_kwargs_rendering(tokenizer, chat_template, {**kwargs, "tools": t}) for t in recorded]
    for tools in tool_sets:
        mine = _kwargs_rendering(tokenizer, chat_template, {**kwargs, "tools": tools or None})
        if mine is None or mine in theirs:
            continue
        closest = max((t for t in theirs if t is not None), key=lambda t: _common_prefix(t, mine), default=[])
        old, new = _differing_part(_tok(tokenizer), closest, mine)
        raise InvariantError(
            "I2",
            f"The checkpoint {model_dir!r} was trained on prompts rendered with "
            f"{' or '.join(_tool_names(t) for t in recorded)}; this run renders them with {_tool_names(tools)}, "
            f"differently:\n  checkpoint: {old!r}\n  now:        {new!r}\nPass the tools SFT rendered its rows "
            "with (GRPOTrainer's `tools=`, or an `environment_factory` whose methods are those tools), or "
            "`check_template=False` if the change is deliberate.",
        )


def _differing_part(tok, a: list[int], b: list[int], limit: int = 300) -> tuple[str, str]:
    """The text of ``a`` and ``b`` between their common prefix and their common suffix (each cut to ``limit``)."""
    n = _common_prefix(a, b)
    m = _common_prefix(a[n:][::-1], b[n:][::-1])
    return tok.decode(a[n:len(a) - m])[:limit], tok.decode(b[n:len(b) - m])[:limit]


def _tool_names(tools: list | None) -> str:
    """``tools [name, ...]``: the functions in ``tools`` (schemas or callables), or ``no tools``."""
    if not tools:
        return "no tools"
    names = [(t.get("function") or t).get("name", "?") if isinstance(t, dict) else getattr(t, "__name__", repr(t))
             for t in tools]
    return "tools [" + ", ".join(map(str, names)) + "]"
