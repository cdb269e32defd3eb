"""Run-time checks of INVARIANTS.md I1, I3 and I4 on the tensors a trainer really uses, and the
one namespace the trainers call every guard through.

Each check compares what the trainer did against an independent recomputation and raises
``InvariantError`` naming the invariant, showing the offending sample (decoded text around
the prompt/completion boundary, special tokens visible) and saying what to do. The trainers
call them on the first ``guard_steps`` steps (``due``); the functions are plain and testable alone.

Here: I1 (one prompt for generation and loss), I3 (the completion is ``sequence[:, P:]``), I4
(the completion mask), and ``check_generation`` / ``check_loss_inputs``, which run them on a
generation batch and on the loss's microbatch. The tool loop's turns are checked in
``tool_loop``, the logprobs (I5) and the entropy bonus (I7) in ``logprobs``; both
are imported here, so ``guards.check_*`` names every check.

Letters: B rows, P padded prompt width, C padded completion width.
"""

from __future__ import annotations

import logging

import torch

from ..chat.boundary import boundary_snippet, starts_with_header
from ..errors import InvariantError
from .tool_loop import check_loss_mask, check_tool_loop, require_rows
from ..ops.masking import completion_mask, expected_lengths, unpad

# The trainers (multitask.py too) call every check as ``guards.<name>``, and tests/dist_worker.py counts
# the calls here: I5/I7 are re-exported.
from .logprobs import (  # noqa: F401
    check_entropy_sign, check_entropy_values, check_logprobs, check_logprobs_in_precision, check_slope, entropy_slopes,
    Recomputed, recompute_logprobs, skipped_for_dropout)

logger = logging.getLogger(__name__)


def due(guard_steps: int, global_step: int) -> bool:
    """Whether the guards run at ``global_step``: the first ``guard_steps`` steps, every step with -1,
    never with 0.

    >>> due(2, 1), due(2, 2), due(-1, 10**6), due(0, 0)
    (True, False, True, False)
    """
    return guard_steps < 0 or global_step < guard_steps


# ---------------------------------------------------------------- I1: one prompt for all


def check_prompts_templated(tokenizer, prompt_ids: list[list[int]], expected: list[list[int]]) -> None:
    """I1: the ids generation saw are the chat template with the generation prompt, no doubled BOS."""
    require_rows("I1", "the prompts generation saw and their chat templates", used=prompt_ids, template=expected)
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
    require_rows("I1", "the prompts of generation and of the loss", rows=list(rows), generation=generation_prompts,
                 loss=loss_prompts)
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
    start with the chat header (``headers``: token ids, ``boundary.chat_headers``; matched as those
    ids or their exact text, so ``assistants can help`` is not the ChatML header ``assistant\\n``)."""
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
        check_same_prompt(tokenizer, unpad(gen_in, attn), prompt_ids, range(len(prompt_ids)))
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
    check_same_prompt(tokenizer, generated_prompts, unpad(inputs["prompt_ids"], inputs["prompt_mask"]), rows)
    check_same_completions(tokenizer, generated_prompts, [record["completion_ids"][r] for r in rows],
                           completion_ids, rows)
    if "loss_mask" in record:  # a tool loop: the loss covers each generated turn, no tool result
        check_loss_mask(tokenizer, completion_ids, cmask * inputs["tool_mask"], [record["loss_mask"][r] for r in rows],
                        stop_ids, rows, truncated_masked=truncated_masked)
    elif "tool_mask" not in inputs:  # (a rollout_func's env_mask: turns not observed, I4 not checked)
        lengths = torch.tensor([len(record["completion_ids"][r]) for r in rows], device=completion_ids.device)
        check_completion_mask(tokenizer, completion_ids, cmask, stop_ids, rows, cap, lengths=lengths,
                              truncated_masked=truncated_masked)

