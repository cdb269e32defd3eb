"""The prompt/completion boundary as text, to read by eye where a run's first steps are checked by hand.

``boundary_snippet`` shows a prompt's tail and its completion's head, ids and decoded text with
special tokens visible; ``batch_boundary_report`` does so for the first rows of a generation
batch with their stop-token counts (``GRPOTrainer.boundary_report``). ``chat_headers`` finds the
chat header a completion must not start with (``<|im_start|>assistant\\n``), ``reward_headers``
the ones I3 checks in the reward text (``guards.check_reward_text``), and ``starts_with_header``
tests completions against them (the ``completions/header_share`` signal, ``health.stop_rows``).
Nothing here runs a model.

Letters: B rows, P padded prompt width, C padded completion width.
"""

from __future__ import annotations

from . import templates


def boundary_snippet(tokenizer, prompt_ids: list[int], completion_ids: list[int], width: int = 8) -> str:
    """The boundary as a person checks it: prompt tail | completion head, ids and text."""
    tail, head = list(prompt_ids[-width:]), list(completion_ids[:width])
    return (
        f"    prompt tail: {tokenizer.decode(tail, skip_special_tokens=False)!r}  ids {tail}\n"
        f"    completion head: {tokenizer.decode(head, skip_special_tokens=False)!r}  ids {head}"
    )


# ---------------------------------------------------------------- the chat header a completion must not start with


def starts_with_header(tokenizer, completions: list[list[int]], headers: list[list[int]]) -> list[bool]:
    """Whether each completion (token ids) starts with one of the chat ``headers`` (token ids,
    from ``chat_headers``): as those very ids, or as their exact text with special tokens shown
    and every character of the header included, its closing newline too (a header the model
    spelled with other tokens counts; a word that merely begins like the role name does not:
    ``assistants can help`` and ``assistantship`` are no ChatML header, ``assistant\\n4`` is)."""
    headers = [list(h) for h in headers if h]
    if not headers:
        return [False] * len(completions)
    texts = [tokenizer.decode(h, skip_special_tokens=False) for h in headers]
    width = 2 * max(len(h) for h in headers) + 8  # a header spelled with shorter tokens still fits
    out = []
    for ids in completions:
        ids = list(ids)
        head = tokenizer.decode(ids[:width], skip_special_tokens=False).lstrip()
        out.append(any(ids[:len(h)] == h or head.startswith(t) for h, t in zip(headers, texts)))
    return out


def chat_headers(tokenizer, chat_template: str | None = None, new_turn: bool = True,
                 **template_kwargs) -> list[list[int]]:
    """The chat header a response must not start with, as token ids (for ``starts_with_header``).

    The assistant header is what the template writes before an assistant message: the
    generation prompt when the template supports ``add_generation_prompt``, else the text
    between the user turn and the assistant's content. Returned: its ids
    (``<|im_start|>assistant\\n``); its leading special token alone when ``new_turn`` (a new turn
    of any role: ``<|im_start|>``, Llama-3's ``<|start_header_id|>``); and its text without
    special tokens up to and including the first line break (``assistant\\n``; Llama-3's
    ``assistant\\n``, Qwen3's ``assistant\\n`` also when ``enable_thinking=False`` appends an
    empty think block), tokenized. None without a chat template (plain-text prompts)."""
    tok = templates._tok(tokenizer)
    if templates.chat_template_of(tokenizer, chat_template) is None:
        return []
    ids = templates.generation_prompt_ids(tok, chat_template, **template_kwargs)
    if not ids:  # the template ignores add_generation_prompt: read the header off an assistant turn
        probe = "grpotrl-header-probe"
        user = [{"role": "user", "content": "x"}]
        without = tok.apply_chat_template(user, tokenize=False, chat_template=chat_template, **template_kwargs)
        turn = tok.apply_chat_template(user + [{"role": "assistant", "content": probe}], tokenize=False,
                                       chat_template=chat_template, **template_kwargs)
        text = turn[len(without):].split(probe, 1)[0] if turn.startswith(without) and probe in turn else ""
        ids = tok(text, add_special_tokens=False)["input_ids"] if text else []
    if not ids:
        return []
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    out = [list(ids)]
    if new_turn and ids[0] in special:
        out.append(list(ids[:1]))
    bare = tok.decode(ids, skip_special_tokens=True).lstrip()
    line = bare[: bare.index("\n") + 1] if "\n" in bare else bare
    if line.strip():
        out.append(list(tok(line, add_special_tokens=False)["input_ids"]))
    unique = []
    for h in out:
        if h not in unique:
            unique.append(h)
    return unique


def reward_headers(tokenizer, chat_template: str | None, **template_kwargs) -> list[list[int]]:
    """I3's headers (``guards.check_reward_text``): the generation prompt the prompt ends with, when
    the template writes one ([] otherwise: a new turn, or a header the model writes itself after a
    template without one, is the chat_header rule's business)."""
    if chat_template is None or not templates.generation_prompt_ids(tokenizer, chat_template, **template_kwargs):
        return []
    return chat_headers(tokenizer, chat_template, new_turn=False, **template_kwargs)


# ---------------------------------------------------------------- the boundary report (read by eye)


def batch_boundary_report(tokenizer, batch: dict, stop_ids: list[int], headers: list[str] = (), n: int = 4,
                    width: int = 8) -> str:
    """For the first ``n`` rows of a generation batch: the decoded prompt tail and completion
    head with special tokens shown, the ids on both sides of the boundary, and the stop-token
    counts (prompt without its left padding, completion as the loss sees it).

    ``batch`` holds ``prompt_ids``/``prompt_mask`` [B, P] (left-padded), ``completion_ids`` [B, C]
    and ``lengths`` [B] (tokens generated per row), optionally ``rewards`` [B], ``stop_mask``
    [B, C] (``stop_count_mask``: where completion stops count; a tool loop's turn ends do not) and
    ``generated_stops`` [B] (``generated_stop_counts``: stops the model wrote, past the cut too)."""
    pad = tokenizer.pad_token_id
    stops = set(stop_ids)
    B = batch["prompt_ids"].size(0)
    lines = [f"grpotrl boundary report: {min(n, B)} of {B} rows; stop ids {sorted(stops)}, pad id {pad}"
             + (" (a stop id: left padding is not counted as stop tokens)" if pad in stops else "")]
    for i in range(min(n, B)):
        prompt_mask = batch["prompt_mask"][i].bool()  # [P]
        prompt = batch["prompt_ids"][i][prompt_mask].tolist()
        counted = batch.get("stop_mask")
        completion = batch["completion_ids"][i][: int(batch["lengths"][i])].tolist()
        n_pad = int((~prompt_mask).sum())
        prompt_stops = sum(t in stops for t in prompt)
        completion_stops = sum(t in stops for t, m in zip(completion, counted[i].tolist() if counted is not None
                                                           else [1] * len(completion)) if m)
        if batch.get("generated_stops") is not None:  # what the model generated, past the cut completion too
            completion_stops = int(batch["generated_stops"][i])
        reward = batch.get("rewards")
        title = f"  row {i}" + (f" (reward {float(reward[i]):.3f})" if reward is not None else "")
        lines.append(f"{title}: prompt {len(prompt)} tokens + {n_pad} left padding, completion {len(completion)} "
                     f"tokens; stop tokens: {prompt_stops} in the prompt, {completion_stops} in the completion")
        lines.append(boundary_snippet(tokenizer, prompt, completion, width))
        if headers and starts_with_header(tokenizer, [completion], list(headers))[0]:
            lines.append("    !! the completion starts with the chat header: the model writes the header itself "
                         "(template without a generation prompt, or SFT on another template)")
        if completion_stops > 1:
            lines.append(f"    !! {completion_stops} stop tokens generated in one completion: generation does not stop "
                         "on every stop id (the model went on past its end of turn)")
    return "\n".join(lines)
