"""Run-time checks of INVARIANTS.md I1-I5 and I7 on the tensors a trainer really uses.

Each check compares what the trainer did against an independent recomputation and raises
``InvariantError`` naming the invariant, showing the offending sample (decoded text around
the prompt/completion boundary, special tokens visible) and saying what to do. The trainers
call them on the first ``guard_steps`` steps; the functions are plain and testable alone.

Letters: B rows, P padded prompt width, C padded completion width, V vocabulary.
"""

from __future__ import annotations

import logging

import torch

from .errors import InvariantError
from .logprobs import completion_logits, token_logprobs
from .masking import completion_mask, expected_lengths, position_ids_from_mask

logger = logging.getLogger(__name__)


def due(guard_steps: int, global_step: int) -> bool:
    """Whether the guards run at ``global_step``: the first ``guard_steps`` steps, every step with -1,
    never with 0.

    >>> due(2, 1), due(2, 2), due(-1, 10**6), due(0, 0)
    (True, False, True, False)
    """
    return guard_steps < 0 or global_step < guard_steps


def dropout_active(model) -> bool:
    """Whether a training forward of ``model`` samples dropout masks: an ``nn.Dropout`` with p > 0,
    or an attention module with a float ``attention_dropout`` > 0 (TRL's ``disable_dropout``
    zeroes the former only)."""
    return model.training and any(
        (isinstance(m, torch.nn.Dropout) and m.p > 0)
        or (isinstance(getattr(m, "attention_dropout", None), float) and m.attention_dropout > 0)
        for m in model.modules())


def skipped_for_dropout(model, checks: str, said: set) -> bool:
    """True when ``model``'s training forward samples dropout masks, so no deterministic reference
    exists for ``checks`` (which compare two forwards): said once per ``checks``, never an error."""
    if not dropout_active(model):
        return False
    if checks not in said:
        said.add(checks)
        logger.warning("grpotrl guard: %s not checked while dropout is active in the training forward "
                       "(disable_dropout=False, TRL's default): the loss then scores another function than the one "
                       "that sampled. Set disable_dropout=True to check them.", checks)
    return True


def masked_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``|a - b|`` in fp32 where ``mask`` is on, 0 elsewhere (a masked -inf cannot poison it): [B, C].

    >>> a, b = torch.tensor([[0.0, -1.0, float("-inf")]]), torch.tensor([[0.5, -1.0, 0.0]])
    >>> masked_gap(a, b, torch.tensor([[1, 1, 0]]))
    tensor([[0.5000, 0.0000, 0.0000]])
    """
    return torch.where(mask.bool(), (a.detach().float() - b.detach().float()).abs(), 0.0)


def worst_token(gap: torch.Tensor) -> tuple[int, int]:
    """(row, token) of the largest entry of a [B, C] gap (NaN counts as largest)."""
    return divmod(int(gap.argmax()), gap.size(1)) if gap.numel() else (0, 0)


def boundary_snippet(tokenizer, prompt_ids: list[int], completion_ids: list[int], width: int = 8) -> str:
    """The view seed 000 asked people to read by eye: prompt tail | completion head, ids and text."""
    tail, head = list(prompt_ids[-width:]), list(completion_ids[:width])
    return (
        f"    prompt tail: {tokenizer.decode(tail, skip_special_tokens=False)!r}  ids {tail}\n"
        f"    completion head: {tokenizer.decode(head, skip_special_tokens=False)!r}  ids {head}"
    )


def _unpad(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]


# ---------------------------------------------------------------- I1: one prompt for all


def check_prompts_templated(tokenizer, prompt_ids: list[list[int]], expected: list[list[int]]) -> None:
    """I1: the ids generation saw are the chat template with the generation prompt, no doubled BOS."""
    bos = tokenizer.bos_token_id
    for i, (got, want) in enumerate(zip(prompt_ids, expected)):
        got, want = list(got), list(want)
        if bos is not None and len(got) > 1 and got[0] == bos and got[1] == bos:
            raise InvariantError(
                "I1",
                f"row {i}: the prompt starts with two BOS tokens ({bos}): "
                f"{tokenizer.decode(got[:6], skip_special_tokens=False)!r}. The template already writes BOS; "
                "do not add special tokens again when tokenizing templated text.",
            )
        if got != want:
            n = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise InvariantError(
                "I1",
                f"row {i}: the prompt ids given to generation are not the chat template of the prompt with the "
                f"generation prompt appended; they differ from token {n} on.\n"
                f"    used:     {tokenizer.decode(got[max(0, n - 8):n + 24], skip_special_tokens=False)!r}\n"
                f"    template: {tokenizer.decode(want[max(0, n - 8):n + 24], skip_special_tokens=False)!r}\n"
                "Pass conversational prompts and let the trainer apply the template; do not pre-format them.",
            )


def check_same_prompt(tokenizer, generation_prompts: list[list[int]], loss_prompts: list[list[int]], rows) -> None:
    """I1: the prompt ids the loss/KL forward uses are, bit for bit, those generation saw."""
    for r, gen, used in zip(rows, generation_prompts, loss_prompts):
        if list(gen) != list(used):
            raise InvariantError(
                "I1",
                f"row {r}: the loss is computed on other prompt ids than generation saw.\n"
                f"    generation: {tokenizer.decode(list(gen)[-40:], skip_special_tokens=False)!r}\n"
                f"    loss:       {tokenizer.decode(list(used)[-40:], skip_special_tokens=False)!r}\n"
                "Keep the prompt_ids returned by generation; never re-tokenize the raw prompt for the loss.",
            )


# ---------------------------------------------------------------- I3: completion = sequence[:, P:]


def check_extraction(
    tokenizer,
    generate_input_ids: torch.Tensor,
    generate_output: torch.Tensor,
    completion_ids: list[list[int]],
    stop_ids: list[int],
) -> None:
    """I3 (and I4's cut): each completion equals ``output[i, P:]`` up to and including its first stop."""
    P = generate_input_ids.size(1)
    raw = generate_output[:, P:]  # [B, C]
    keep = completion_mask(raw, stop_ids)  # [B, C]
    for i, got in enumerate(completion_ids):
        want = raw[i][keep[i].bool()].tolist()
        if list(got) == want[:-1] and want[-1:] and want[-1] in stop_ids:
            check_stops(tokenizer, [got], stop_ids, len(want))  # I4: generate wrote it, the completion lost it
        if list(got) != want:
            prompt = generate_input_ids[i].tolist()
            raise InvariantError(
                "I3",
                f"row {i}: the completion is not the generated tokens after the padded prompt width P={P} "
                "(cut after the first stop token).\n"
                f"    extracted: {tokenizer.decode(list(got)[:24], skip_special_tokens=False)!r}\n"
                f"    generated: {tokenizer.decode(want[:24], skip_special_tokens=False)!r}\n"
                + boundary_snippet(tokenizer, prompt, list(got))
                + "\nExtract with `sequences[:, P:]` where P is the padded prompt width, never the count of "
                "non-pad tokens (left padding puts the prompt at the end of the first P columns).",
            )


def check_same_completions(tokenizer, prompt_ids: list[list[int]], generated: list[list[int]],
                           loss_completion_ids: torch.Tensor, rows) -> None:
    """I3: the completion ids the loss scores start with exactly the ids generation returned."""
    for j, (r, want) in enumerate(zip(rows, generated)):
        got = loss_completion_ids[j].tolist()
        if got[: len(want)] != list(want):
            raise InvariantError(
                "I3",
                f"row {r}: the loss scores other completion ids than generation returned.\n"
                + boundary_snippet(tokenizer, prompt_ids[j], got)
                + f"\n    generated head: {tokenizer.decode(list(want)[:8], skip_special_tokens=False)!r}",
            )


def check_reward_text(tokenizer, completion_ids: list[list[int]], completions: list,
                      headers: list[list[int]]) -> None:
    """I3: the text reward functions see is the decoded completion, and the completion does not
    start with the chat header (``headers``: token ids, ``health.chat_headers``; matched as those
    ids or their exact text, so ``assistants can help`` is not the ChatML header ``assistant\\n``)."""
    from .health import starts_with_header

    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    for i, (text, seen) in enumerate(zip(texts, completions)):
        seen_text = seen[-1]["content"] if isinstance(seen, list) else seen
        if seen_text != text:
            raise InvariantError(
                "I3",
                f"row {i}: reward functions see {seen_text[:80]!r} but the completion decodes to {text[:80]!r}.",
            )
    for i, starts in enumerate(starts_with_header(tokenizer, completion_ids, headers)):
        if starts:
            shown = [tokenizer.decode(h, skip_special_tokens=False) for h in headers]
            raise InvariantError(
                "I3",
                f"row {i}: the completion given to reward functions starts with the chat header (one of {shown}): "
                f"{tokenizer.decode(list(completion_ids[i])[:24], skip_special_tokens=False)!r}. The extraction "
                "boundary includes prompt tokens.\n"
                + boundary_snippet(tokenizer, [], completion_ids[i]),
            )


# ---------------------------------------------------------------- I1, I3, I4 on TRL's tool loop


def _turn_error(tokenizer, row: int, turn: int, got: list[int], want: list[int] | None, what: str) -> InvariantError:
    """I1 on a tool loop's turn ``turn`` (0 = the first): what generate saw against what it should have."""
    if want is None:
        shown = f"    generate saw (end): {tokenizer.decode(got[-32:], skip_special_tokens=False)!r}\n"
    else:
        n = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        shown = (f"    generate saw: {tokenizer.decode(got[max(0, n - 12):n + 24], skip_special_tokens=False)!r}\n"
                 f"    expected:     {tokenizer.decode(want[max(0, n - 12):n + 24], skip_special_tokens=False)!r}\n"
                 f"    (they differ from token {n} on)\n")
    return InvariantError(
        "I1",
        f"row {row}, turn {turn + 1}: {what}.\n{shown}"
        "On a tool loop the first turn's prompt is the chat template's, and each next turn's prompt is the previous "
        "prompt, the model's completion up to and including its stop token, then the tool result ending with the "
        "generation prompt, as tokens (never a re-tokenization of decoded text).",
    )


def check_tool_loop(tokenizer, calls: list[dict], prompt_ids: list[list[int]], completion_ids: list[list[int]],
                    tool_mask: list[list[int]], stop_ids: list[int], generation_prompt: list[int],
                    max_completion_length: int) -> list[list[int]]:
    """I1, I3 and I4 on a multi-turn tool loop, from what ``generate`` really saw and returned in each turn.

    ``calls`` are the recorded ``generate`` calls in order: the first holds every row's prompt; each
    later one the rows that called a tool, in row order. Checks that the first turn's inputs are
    ``prompt_ids`` (I1); that each later turn's input of a row is its previous input + its completion
    of that turn (cut after the first stop, I4) + a tool result ending with ``generation_prompt``
    (I1); that each row's completion is everything after its prompt (I3), the last turn cut to the
    ``max_completion_length`` budget as TRL does; and that ``tool_mask`` is 1 exactly on the tokens
    the model generated and 0 on tool results. Returns those expected loss masks, one per row."""
    seq = [list(p) for p in prompt_ids]  # each row's sequence so far: prompt, turns, tool results
    mask: list[list[int]] = [[] for _ in prompt_ids]  # per completion token: 1 generated, 0 tool result
    turns = [0] * len(prompt_ids)
    active = list(range(len(prompt_ids)))
    for k, call in enumerate(calls):
        ids = call["input_ids"].cpu()
        attn = call["attention_mask"].cpu() if call["attention_mask"] is not None else torch.ones_like(ids)
        inputs = _unpad(ids, attn)
        raw = call["output"].cpu()[:, ids.size(1):]  # [B_k, C_k]
        keep = completion_mask(raw, stop_ids).bool()  # [B_k, C_k]
        if k == 0 and len(inputs) != len(seq):
            raise InvariantError("I1", f"the first generate call of the tool loop got {len(inputs)} rows for "
                                 f"{len(seq)} prompts.")
        j, rows = 0, []  # j: the next candidate in ``active`` (TRL keeps the tool rows in row order)
        for r, got in enumerate(inputs):
            if k == 0:
                i = r
                if got != seq[i]:
                    raise _turn_error(tokenizer, i, 0, got, seq[i], "the prompt ids given to generation are not "
                                      "the prompt ids the loss uses")
            else:
                start = j
                while j < len(active) and got[:len(seq[active[j]])] != seq[active[j]]:
                    j += 1
                if j == len(active):
                    i = active[min(start, len(active) - 1)]
                    raise _turn_error(tokenizer, i, k, got, seq[i], "the prompt ids given to generation do not "
                                      "continue any row's previous prompt + completion")
                i, j = active[j], j + 1
                suffix = got[len(seq[i]):]
                if not suffix or (generation_prompt and suffix[-len(generation_prompt):] != generation_prompt):
                    raise _turn_error(tokenizer, i, k, got, None, "the prompt ids given to generation continue the "
                                      "previous turn with no tool result, or one that does not end with the "
                                      f"generation prompt {tokenizer.decode(generation_prompt)!r}")
                seq[i] += suffix
                mask[i] += [0] * len(suffix)
            turn = raw[r][keep[r]].tolist()
            seq[i] += turn
            mask[i] += [1] * len(turn)
            turns[i] += 1
            rows.append(i)
        active = rows
    for i, (prompt, got, tools) in enumerate(zip(prompt_ids, completion_ids, tool_mask)):
        want = seq[i][len(prompt):]
        if turns[i] > 1:  # TRL cuts the last turn to the completion budget
            want, mask[i] = want[:max_completion_length], mask[i][:max_completion_length]
        if list(got) != want:
            raise InvariantError(
                "I3",
                f"row {i}: the completion is not what generate produced after the prompt over {turns[i]} turn(s) "
                "(each turn cut after its first stop token, with the tool results between).\n"
                f"    extracted: {tokenizer.decode(list(got)[:32], skip_special_tokens=False)!r}\n"
                f"    generated: {tokenizer.decode(want[:32], skip_special_tokens=False)!r}\n"
                + boundary_snippet(tokenizer, list(prompt), list(got)),
            )
        if list(tools) != mask[i]:
            t = next((t for t, (a, b) in enumerate(zip(tools, mask[i])) if a != b), min(len(tools), len(mask[i])))
            raise InvariantError(
                "I4",
                f"row {i}: tool_mask is wrong at completion position {t}: the loss must cover exactly the tokens the "
                "model generated (each turn up to and including its stop token) and none of the tool results.\n"
                f"    tool_mask: {list(tools)[max(0, t - 4):t + 8]}\n    expected:  {mask[i][max(0, t - 4):t + 8]}\n"
                f"    around:    {tokenizer.decode(list(got)[max(0, t - 4):t + 8], skip_special_tokens=False)!r}",
            )
    return mask


def check_loss_mask(tokenizer, completion_ids: torch.Tensor, loss_mask: torch.Tensor, expected: list[list[int]],
                    stop_ids: list[int], rows, truncated_masked: bool = False) -> None:
    """I4 on the loss's microbatch of a tool loop: ``completion_mask * tool_mask`` is 1 exactly on
    the tokens the model generated (``expected``, from ``check_tool_loop``), 0 on tool results and
    padding; with ``mask_truncated_completions`` a row that did not end on a stop token is all 0."""
    for j, (r, want) in enumerate(zip(rows, expected)):
        ids = completion_ids[j].tolist()
        full = list(want) + [0] * (len(ids) - len(want))
        if truncated_masked and want and ids[len(want) - 1] not in set(stop_ids) | {tokenizer.pad_token_id}:
            full = [0] * len(ids)
        got = loss_mask[j].long().tolist()
        if got != full:
            t = next(t for t, (a, b) in enumerate(zip(got, full)) if a != b)
            raise InvariantError(
                "I4",
                f"row {r}: the loss mask (completion_mask * tool_mask) is wrong at completion position {t} "
                f"(token {ids[t]} {tokenizer.decode([ids[t]], skip_special_tokens=False)!r}).\n"
                f"    mask used: {got[max(0, t - 4):t + 8]}\n    expected:  {full[max(0, t - 4):t + 8]}\n"
                "The loss covers each turn the model generated, up to and including its stop token, and no tool "
                "result.",
            )


# ---------------------------------------------------------------- I4: the completion mask


def check_stops(tokenizer, completion_ids: list[list[int]], stop_ids: list[int], max_length: int | None) -> None:
    """I4 on the completions generation returned (any sampler: transformers, continuous batching,
    vLLM), from their tokens and the stop set alone: each ends right after its first stop token
    (kept), or holds none and is ``max_length`` long (cut by generation's cap). ``max_length``
    None (stop strings may end a completion): only the first half is checked."""
    stops = set(stop_ids)
    for i, ids in enumerate(completion_ids):
        ids = list(ids)
        first = next((t for t, x in enumerate(ids) if x in stops), None)
        if first is not None and len(ids) > first + 1:
            problem = (f"it goes on for {len(ids) - first - 1} tokens after its first stop token (position {first}, "
                       f"{tokenizer.decode([ids[first]], skip_special_tokens=False)!r}), which the loss would train on")
        elif first is None and max_length is not None and len(ids) != max_length:
            problem = (f"it holds no stop token but is {len(ids)} tokens long, not max_completion_length={max_length}: "
                       "generation ended it without a stop token in it, or its stop token was dropped, so the model "
                       "would never learn to stop")
        else:
            continue
        raise InvariantError(
            "I4",
            f"row {i}: the completion is not 'everything up to and including the first stop token': {problem}.\n"
            f"    completion end: {tokenizer.decode(ids[-12:], skip_special_tokens=False)!r}  ids {ids[-12:]}\n"
            f"    stop ids {sorted(stops)}, pad id {tokenizer.pad_token_id}\n"
            "Keep the first stop token in the completion and cut everything after it.",
        )


def check_completion_mask(
    tokenizer,
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    stop_ids: list[int],
    rows,
    max_length: int | None,
    lengths: torch.Tensor | None = None,
    truncated_masked: bool = False,
) -> None:
    """I4: mask is 1 up to and including the first stop token, 0 after, for every row, derived
    from the token ids and the stop set alone (``masking.expected_lengths``): a row with no stop
    token must be ``max_length`` long. ``lengths`` [B] (what generation reported) are read only
    where that cannot be derived: rows without a stop token when ``max_length`` is None (stop
    strings, a user's ``rollout_func``)."""
    B, C = completion_ids.shape
    t = torch.arange(C, device=completion_ids.device).expand(B, C)  # [B, C]
    if max_length is None:
        want = completion_mask(completion_ids, stop_ids, lengths=lengths)  # [B, C]
    else:
        ends = expected_lengths(completion_ids, stop_ids, max_length)  # [B]
        if (ends > C).any():
            i = int((ends > C).nonzero()[0])
            ids = completion_ids[i].tolist()
            n = int(mask[i].sum())
            raise InvariantError(
                "I4",
                f"row {rows[i]}: the completion holds no stop token in its {C} columns, yet max_completion_length is "
                f"{max_length}: generation ends a completion on a stop token or at the cap, so its stop token was "
                f"dropped (the loss covers {n} tokens and never the stop).\n"
                f"    completion end: {tokenizer.decode(ids[max(0, n - 12):n], skip_special_tokens=False)!r}\n"
                f"    stop ids {stop_ids}, pad id {tokenizer.pad_token_id}\n"
                "Keep the first stop token in the completion and the mask.",
            )
        want = (t < ends.unsqueeze(1)).long()  # [B, C]
    if truncated_masked:  # mask_truncated_completions zeroes rows that never stopped (TRL: last token not eos/pad)
        last = completion_ids.gather(1, (want.sum(1, keepdim=True) - 1).clamp(min=0))  # [B, 1]
        ended = [*stop_ids, tokenizer.pad_token_id] if tokenizer.pad_token_id is not None else list(stop_ids)
        want = want * torch.isin(last, torch.as_tensor(ended, device=completion_ids.device))
    bad = (want != mask.long()).any(dim=1)
    if bad.any():
        i = int(bad.nonzero()[0])
        ids, got, exp = completion_ids[i].tolist(), mask[i].long().tolist(), want[i].tolist()
        where = next(t for t in range(len(got)) if got[t] != exp[t])
        raise InvariantError(
            "I4",
            f"row {rows[i]}: completion_mask is wrong at completion position {where} "
            f"(token {ids[where]} {tokenizer.decode([ids[where]], skip_special_tokens=False)!r}).\n"
            f"    mask used: {got[: where + 4]}\n    expected:  {exp[: where + 4]}\n"
            f"    stop ids {stop_ids}, pad id {tokenizer.pad_token_id}\n"
            "The first stop token stays in the loss so the model learns to stop; everything after it is 0. "
            "Never build the mask from `token != pad_token_id` (wrong when pad == eos).",
        )


# ---------------------------------------------------------------- I1, I3, I4 on a trainer's batch


def check_generation(tokenizer, prompt_ids: list, completion_ids: list, completions: list, calls: list[dict],
                     stop_ids: list[int], *, templated: list[list[int]] | None = None, tool_loop: dict | None = None,
                     cap: int | None = None, stops: bool = True, reward_headers: list[list[int]] | None = None,
                     observable: bool = True) -> dict:
    """I1, I3 and I4 on one generation batch: what TRL's ``_generate`` returned (``prompt_ids``,
    ``completion_ids``, ``completions``) against the ``generate`` calls recorded while it ran
    (``trainers._intercept.record_generate``) and the stop set. ``templated``: each prompt through
    the chat template (I1's reference, when the prompts are chat messages); ``tool_loop``: the
    ``tool_mask``, ``generation_prompt`` and ``max_completion_length`` of TRL's tool loop (every turn
    checked, ``check_tool_loop``); ``cap``: generation's length cap (``check_stops``, when ``stops``);
    ``reward_headers``: the chat headers the reward text must not start with (None: not checked);
    ``observable``: whether ``generate`` should have been seen (warned when it was not).
    Returns the record the loss's checks compare against (``check_loss_inputs``)."""
    record = {"prompt_ids": [list(p) for p in prompt_ids], "completion_ids": [list(c) for c in completion_ids]}
    if templated is not None:
        check_prompts_templated(tokenizer, prompt_ids, templated)
    if calls and tool_loop is not None:  # one generate call per turn
        record["loss_mask"] = check_tool_loop(tokenizer, calls, prompt_ids, completion_ids, tool_loop["tool_mask"],
                                              stop_ids, tool_loop["generation_prompt"],
                                              tool_loop["max_completion_length"])
    elif calls:  # the transformers path: compare against what generate really returned
        gen_in = calls[-1]["input_ids"].cpu()
        attn = calls[-1]["attention_mask"] if calls[-1]["attention_mask"] is not None else torch.ones_like(gen_in)
        check_same_prompt(tokenizer, _unpad(gen_in, attn), prompt_ids, range(len(prompt_ids)))
        check_extraction(tokenizer, gen_in, calls[-1]["output"].cpu(), completion_ids, stop_ids)
    elif observable:
        logger.warning("grpotrl guard: could not observe `generate`; I3 is checked on the text only.")
    if stops:  # I4 from the tokens and the stop set, on every sampler
        check_stops(tokenizer, completion_ids, stop_ids, cap)
    if reward_headers is not None:
        check_reward_text(tokenizer, completion_ids, completions, reward_headers)
    return record


def check_loss_inputs(tokenizer, record: dict, inputs: dict, rows: list[int], stop_ids: list[int],
                      cap: int | None, truncated_masked: bool) -> None:
    """I1, I3, I4 on the microbatch the loss uses (``inputs``, rows ``rows`` of the generation batch):
    the prompt and completion ids generation produced (``record``, from ``check_generation``), and the
    loss mask: ``completion_mask * tool_mask`` on each generated turn of a tool loop, else the
    completion mask up to and including the first stop."""
    completion_ids, cmask = inputs["completion_ids"], inputs["completion_mask"]  # [B, C]
    generated_prompts = [record["prompt_ids"][r] for r in rows]
    check_same_prompt(tokenizer, generated_prompts, _unpad(inputs["prompt_ids"], inputs["prompt_mask"]), rows)
    check_same_completions(tokenizer, generated_prompts, [record["completion_ids"][r] for r in rows],
                           completion_ids, rows)
    if "loss_mask" in record:  # a tool loop: the loss covers each generated turn, no tool result
        check_loss_mask(tokenizer, completion_ids, cmask * inputs["tool_mask"], [record["loss_mask"][r] for r in rows],
                        stop_ids, rows, truncated_masked=truncated_masked)
    elif "tool_mask" not in inputs:  # (a rollout_func's env_mask: turns not observed, I4 not checked)
        lengths = torch.tensor([len(record["completion_ids"][r]) for r in rows], device=completion_ids.device)
        check_completion_mask(tokenizer, completion_ids, cmask, stop_ids, rows, cap, lengths=lengths,
                              truncated_masked=truncated_masked)


# ---------------------------------------------------------------- I5: logprobs at temperature T


@torch.no_grad()
def recompute_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int,
                       temperature: float, return_logits: bool = False) -> tuple[torch.Tensor, ...]:
    """Independent I5 reference: a plain forward with generate's position ids, dropout off,
    ``log_softmax(logits / T)`` at the logit of input position ``P + t - 1``.

    Returns the logprobs [B, C] and the logit scale ``max |logits / T|`` per token [B, C]:
    fp32 rounding of a logprob grows with it, and the I5 tolerance is relative to it. With
    ``return_logits`` also the completion logits [B, C, V] (the health signals read them)."""
    was_training = model.training
    model.eval()
    try:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
            logits_to_keep=completion_width + 1,
        )
    finally:
        model.train(was_training)
    logits = completion_logits(out.logits, completion_width)  # [B, C, V]
    scale = logits.float().abs().amax(-1) / temperature  # [B, C]
    logprobs = token_logprobs(logits, input_ids[:, -completion_width:], temperature)  # [B, C]
    return (logprobs, scale, logits) if return_logits else (logprobs, scale)


def check_logprobs(tokenizer, used: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor,
                   completion_ids: torch.Tensor, temperature: float, atol: float, rows,
                   scale: torch.Tensor | None = None) -> float:
    """I5: the logprobs the loss used agree with the reference on every masked-in token, to
    ``atol`` times the logit scale ``max |logits / T|`` where that exceeds 1 (fp32 rounding of
    a log-softmax over a 49k vocabulary grows with the logits: on SmolLM2 the fused head and a
    plain log_softmax differ by up to 1.6e-5 nats). Returns the largest scaled gap."""
    used = used.detach()
    on = mask.bool()  # [B, C]
    _require_finite("I5", tokenizer, completion_ids, on, rows, ("the loss's logprob", used),
                    ("the independent log_softmax(logits / T)", reference),
                    *((("the logit scale max|logits / T|", scale),) if scale is not None else ()))
    gap = masked_gap(used, reference, on)  # [B, C]
    scaled = gap / (scale.float().clamp(min=1.0) if scale is not None else 1.0)  # [B, C]
    worst = float(scaled.max()) if scaled.numel() else 0.0
    if not worst <= atol:  # NaN fails too
        i, t = worst_token(scaled)
        raise InvariantError(
            "I5",
            f"row {rows[i]}, completion token {t} ({tokenizer.decode([int(completion_ids[i, t])])!r}): the "
            f"loss used logprob {float(used[i, t]):.6f}, but log_softmax(logits / T={temperature})[token] "
            f"with generate's position ids is {float(reference[i, t]):.6f} (gap {float(gap[i, t]):.2e}, "
            f"{worst:.1e} relative to the logit scale > {atol:.0e}).\n"
            "The loss must score tokens with the distribution that sampled them: divide the logits by the "
            "sampling temperature, take the logit at position P + t - 1, use the attention mask's position ids "
            "(cumsum - 1) as generate does, and turn dropout off (`disable_dropout=True`).",
        )
    return worst


def _require_finite(invariant: str, tokenizer, completion_ids, on: torch.Tensor, rows, *named) -> None:
    """A guard cannot verify a comparison with NaN or inf in it: any non-finite value at a
    masked-in position of the named [B, C] tensors fails, naming the tensor, row and token
    (masked-out positions are never compared, so they may hold anything)."""
    for what, values in named:
        bad = on & ~torch.isfinite(values.detach().float())  # [B, C]
        if bad.any():
            i, t = (int(x) for x in bad.nonzero()[0])
            token = repr(tokenizer.decode([int(completion_ids[i, t])])) if tokenizer is not None else "?"
            raise InvariantError(
                invariant, f"row {rows[i] if rows is not None else i}, completion token {t} ({token}): {what} is "
                f"{float(values[i, t])} ({int(bad.sum())} such values on tokens in the loss). A guard cannot compare "
                "a non-finite value, and the loss would train on it: look for a NaN/inf in the logits (overflow in "
                "half precision, a division by a zero temperature, a -inf from a logits processor on a sampled token).")


# ---------------------------------------------------------------- I7: the entropy bonus's sign


def entropy_slope(loss: torch.Tensor, entropies: torch.Tensor, accumulation: float = 1.0) -> float:
    """``d loss / d H`` on the graph that will be backpropagated, for ``H`` the mean entropy of
    the tokens the loss reads: the derivative along "every token's entropy rises by one"
    (``sum_t d loss / d H_t``), times the gradient-accumulation factor the loss was divided by.
    Only the path from ``loss`` back to the entropy node is walked (a few elementwise ops),
    never the model. 0 when the loss does not depend on the entropies.

    >>> H = torch.tensor([[0.5, 1.0]], requires_grad=True)  # [B=1, C=2]
    >>> round(entropy_slope(1.0 - 0.1 * H.mean(), H), 6)  # policy - c H with c = 0.1
    -0.1
    """
    if not entropies.requires_grad:
        return 0.0
    (g,) = torch.autograd.grad(loss, entropies, retain_graph=True, allow_unused=True)
    return 0.0 if g is None else float(g.sum()) * accumulation


def check_entropy_sign(loss: torch.Tensor, entropies: torch.Tensor | None, coef: float, accumulation: float,
                       where: str) -> float:
    """I7: ``loss = policy + beta * KL - c * H``, so ``d loss / d H`` must be ``-c`` (to 1e-4 of
    max(c, 1)). Returns the measured slope; raises naming ``where`` otherwise."""
    if entropies is None:
        if coef:
            raise InvariantError("I7", f"{where}: an entropy bonus c={coef:g} is configured but the loss received "
                                 "no entropies (compute_entropy=False?), so the bonus cannot act.")
        return 0.0
    if not coef >= 0:  # NaN fails too
        raise InvariantError("I7", f"{where}: the entropy bonus coefficient in force is c = {coef:g}. The loss is "
                             "policy + beta * KL - c * H with c >= 0: a negative c minimises entropy (seed 004). Keep "
                             "entropy_coef (and entropy_coef_min with use_adaptive_entropy) >= 0.")
    slope = entropy_slope(loss, entropies, accumulation)
    if not abs(slope + coef) <= 1e-4 * max(abs(coef), 1.0):  # NaN fails too
        if slope != slope or abs(slope) == float("inf"):
            problem = "the slope is not finite (a NaN/inf in the loss or the entropies), so it cannot be verified"
        elif coef and slope == 0.0:
            problem = "the bonus is missing from it (the entropies carry no gradient into the loss)"
        elif coef and slope * coef > 0:
            problem = ("the entropy term enters with a FLIPPED sign, so every step lowers entropy "
                       "(seed 004: entropy collapsed from ~1 to 0.005)")
        else:
            problem = "the entropy term enters with the wrong weight"
        raise InvariantError(
            "I7",
            f"{where}: on the graph being backpropagated d loss / d H = {slope:+.6g}, but the entropy bonus "
            f"coefficient is c = {coef:g}, so it must be {-coef:+.6g}: {problem}.\n"
            "The loss must be policy + beta * KL - c * H with c >= 0 encouraging exploration. Fix the sign where "
            "the entropy term is built; do not switch modes to hide it.",
        )
    return slope


def check_entropy_values(used: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor, atol: float) -> None:
    """I7: the entropy node the sign check differentiates is the policy's entropy: equal, on
    every masked-in token, to the entropy of ``softmax(logits / T)`` recomputed independently
    (so a negated or rescaled "entropy" cannot pass the sign check)."""
    on = mask.bool()  # [B, C]
    _require_finite("I7", None, None, on, None, ("the entropy the loss used", used),
                    ("the entropy of softmax(logits / T)", reference))
    gap = masked_gap(used, reference, on)  # [B, C]
    worst = float(gap.max()) if gap.numel() else 0.0
    if not worst <= atol:
        i, t = worst_token(gap)
        raise InvariantError(
            "I7", f"row {i}, completion token {t}: the entropy the loss used is {float(used[i, t]):.6f} but the "
            f"entropy of softmax(logits / T) there is {float(reference[i, t]):.6f} (gap {worst:.2e} > {atol:.0e}). "
            "The entropy bonus must act on the policy's own entropy at the sampling temperature.",
        )


# multitask.py reaches these through guards; they live in trainers/_intercept.py (record_calls, replace_attr)
from .trainers._intercept import record_calls  # noqa: E402,F401
from .trainers._intercept import replace_attr as _instance_attr  # noqa: E402,F401
