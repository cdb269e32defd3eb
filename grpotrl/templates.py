"""Chat templates shared by SFT and RL (INVARIANT I2), and the stop tokens they imply.

* ``stop_token_ids``: the tokenizer's eos, the template's end-of-turn token and every id of
  ``generation_config.eos_token_id``.
* ``template_fingerprint``: a hash of what decides prompt tokenization, stored beside every
  checkpoint (``grpotrl_template.json``) and compared when RL starts from it.
* ``tokenize_sft_example``: SFT tokenization whose prefix is exactly the RL prompt ids and
  whose loss covers the response plus its end-of-turn token, nothing after.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from .errors import InputError, InvariantError

FINGERPRINT_FILE = "grpotrl_template.json"
_PROBE = "grpotrl-probe-7f3a"


def _tok(processing_class):
    return getattr(processing_class, "tokenizer", processing_class)


def require_chat_template(tokenizer, chat_template: str | None = None) -> None:
    if (chat_template or getattr(_tok(tokenizer), "chat_template", None)) is None:
        raise InputError(
            f"The tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat template. "
            "grpotrl trains SFT and RL on the same chat template (INVARIANT I2). Use an instruct/chat "
            "checkpoint, or set `tokenizer.chat_template` (or `chat_template_path` in the recipe)."
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
    every RL prompt ends with them, so every SFT loss span must start right after them."""
    probe = [{"role": "user", "content": "x"}]
    with_gen = prompt_ids(tokenizer, probe, chat_template, **template_kwargs)
    without = _tok(tokenizer).apply_chat_template(
        probe, tokenize=True, return_dict=True, chat_template=chat_template, **template_kwargs
    )["input_ids"]
    n = len(without) if list(with_gen[: len(without)]) == list(without) else 0
    return list(with_gen[n:])


def tokenize_sft_example(
    tokenizer, prompt: list[dict], completion: list[dict], stop_ids: list[int], chat_template: str | None = None
) -> dict[str, list[int]]:
    """I2: ``input_ids`` start with exactly the RL prompt ids; the loss covers the response and
    its first stop token, and the sequence ends there (the template's trailing newline is cut)."""
    tok = _tok(tokenizer)
    p_ids = prompt_ids(tok, prompt, chat_template)
    full = tok.apply_chat_template(
        prompt + completion, tokenize=True, return_dict=True, chat_template=chat_template
    )["input_ids"]
    full = list(full)
    if full[: len(p_ids)] != p_ids:
        n = next(i for i, (a, b) in enumerate(zip(p_ids, full)) if a != b) if any(
            a != b for a, b in zip(p_ids, full)) else min(len(p_ids), len(full))
        raise InvariantError(
            "I2",
            "SFT tokenization of (prompt, response) does not start with the RL prompt ids, so SFT would "
            "train on a context RL never shows the model.\n"
            f"  RL prompt from token {n}:  {tok.decode(p_ids[n:n + 12])!r}\n"
            f"  SFT sequence from token {n}: {tok.decode(full[n:n + 12])!r}\n"
            "Use a chat template that renders the prompt identically with and without the assistant turn.",
        )
    response = full[len(p_ids):]
    stops = [i for i, t in enumerate(response) if t in set(stop_ids)]
    if stops:
        response = response[: stops[0] + 1]
    return {"input_ids": p_ids + response, "completion_mask": [0] * len(p_ids) + [1] * len(response)}


def template_fingerprint(tokenizer, chat_template: str | None = None) -> dict[str, Any]:
    """What decides how prompts are tokenized, hashed. Equal fingerprints mean equal RL prompts."""
    tok = _tok(tokenizer)
    template = chat_template or tok.chat_template or ""
    specials = {k: getattr(tok, k, None) for k in ("bos_token", "eos_token", "pad_token")}
    blob = json.dumps({"template": template, "specials": specials}, sort_keys=True)
    return {"sha256": hashlib.sha256(blob.encode()).hexdigest(), "specials": specials}


def save_fingerprint(output_dir: str, tokenizer, chat_template: str | None = None) -> None:
    os.makedirs(output_dir, exist_ok=True)
    tmp = os.path.join(output_dir, FINGERPRINT_FILE + ".tmp")
    record = {**template_fingerprint(tokenizer, chat_template),
              "template": chat_template or _tok(tokenizer).chat_template or ""}
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, os.path.join(output_dir, FINGERPRINT_FILE))


def check_fingerprint(model_dir: str | None, tokenizer, chat_template: str | None = None,
                      revision: str | None = None) -> bool:
    """I2 at RL start: a checkpoint (a local directory or a Hub repo) trained with another template is
    an error. Returns whether a fingerprint was found (a base model without one passes)."""
    from .hub import model_file

    path = model_file(model_dir, FINGERPRINT_FILE, revision)
    if path is None:
        return False
    with open(path) as f:
        saved = json.load(f)
    now = template_fingerprint(tokenizer, chat_template)
    if saved.get("sha256") != now["sha256"]:
        old, new = saved.get("template", ""), chat_template or _tok(tokenizer).chat_template or ""
        n = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        where = (f"templates differ from character {n}: checkpoint {old[max(0, n - 20):n + 40]!r} vs now "
                 f"{new[max(0, n - 20):n + 40]!r}" if old != new else
                 f"special tokens differ: checkpoint {saved.get('specials')} vs now {now['specials']}")
        raise InvariantError(
            "I2",
            f"The checkpoint {model_dir!r} was trained with another chat template than the one this run "
            f"would use ({where}). RL on it would train on prompts the model never saw in SFT. Load the "
            "tokenizer saved with the checkpoint, or set `check_template=False` if the change is deliberate.",
        )
    return True
