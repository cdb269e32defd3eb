"""Run-time checks of INVARIANTS.md I1, I3 and I4 on TRL's multi-turn tool loop.

``check_tool_loop`` replays every turn from the ``generate`` calls recorded while the loop ran
(what each turn's ``generate`` saw and returned) and returns the loss mask each row must have;
``check_loss_mask`` compares the loss's ``completion_mask * tool_mask`` against it.
``grpotrl.guards.check_generation`` and ``check_loss_inputs`` call them on a tool-loop batch.
"""

from __future__ import annotations

import torch

from ..chat.boundary import boundary_snippet
from ..errors import InvariantError
from ..ops.masking import completion_mask, unpad


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


def require_rows(invariant: str, what: str, **lists) -> None:
    """An ``InvariantError`` of ``invariant`` unless every list in ``lists`` (name -> rows) has as many rows:
    a check that pairs rows by position would otherwise compare the shorter list's rows and pass the rest.

    >>> require_rows("I1", "the prompts", used=[[1]], template=[[1]])
    >>> require_rows("I1", "the prompts", used=[[1], [2]], template=[[1]])
    Traceback (most recent call last):
    ...
    grpotrl.errors.InvariantError: [I1] the prompts: 2 rows of used against 1 of template: rows cannot be paired, so none is checked.
    """
    counts = {name: len(rows) for name, rows in lists.items()}
    if len(set(counts.values())) > 1:
        (a, n), *rest = counts.items()
        others = ", ".join(f"{m} of {b}" for b, m in rest)
        raise InvariantError(invariant, f"{what}: {n} rows of {a} against {others}: rows cannot be paired, so none "
                             "is checked.")


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
        inputs = unpad(ids, attn)
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
    require_rows("I3", "the tool loop's rows", prompts=prompt_ids, completions=completion_ids, tool_mask=tool_mask)
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
    require_rows("I4", "the loss microbatch of a tool loop", rows=list(rows), expected_masks=expected,
                 completions=completion_ids, loss_mask=loss_mask)
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
