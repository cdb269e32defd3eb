"""DAPO dynamic sampling (Yu et al. 2025, "DAPO", section 3.2; TRL issue #3708).

A group whose rewards are all equal has advantage 0 for every member, so it adds no policy
gradient, but it still counts in the loss's normalisers (the token count ``num_items_in_batch``
of TRL's default ``loss_type='dapo'``, the row count of ``'grpo'``) and still carries the KL
and entropy terms: it dilutes the update. Dynamic sampling removes such groups' rows from the
batch and refills it with groups of fresh prompts, for up to a capped number of extra
generation rounds. ``refill`` runs the rounds for ``grpotrl.GRPOTrainer``, which hands it what
it needs (a callable that scores one round, one that logs metrics, the settings): it reads and
writes no trainer field. The pure functions before it pick and merge rows.

Simplified on purpose: refill prompts are drawn uniformly from ``train_dataset`` (seeded by
step and round, the same on every process), not from the next batches of the epoch; a batch
that stays short after the cap trains on fewer rows; a few zero-variance rows stay when
needed so that every process keeps as many rows and the batch splits evenly into
``steps_per_generation`` microbatches (they have advantage 0, but carry KL and entropy
terms). Text-only batches (no images).

Letters: B rows, G completions per prompt, N groups (N = B / G globally), P, C widths.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import InputError
from ..health import zero_std_groups

PROMPT_KEYS = ("prompt_ids", "prompt_mask")  # [B, P], left-padded
COMPLETION_KEYS = ("completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
                   "sampling_per_token_logps", "importance_sampling_ratio", "tool_mask")  # [B, C], right-padded


def keep_groups(zero_std: list[torch.Tensor], target: int) -> list[torch.Tensor]:
    """Which groups of each round go into the loss: groups with reward variance, first come,
    at most ``target`` in all. ``zero_std[r]`` is [N_r] (True = all rewards equal).

    >>> keep_groups([torch.tensor([True, False, True]), torch.tensor([False, False, True])], 3)
    [tensor([False,  True, False]), tensor([ True,  True, False])]
    >>> keep_groups([torch.tensor([False, False]), torch.tensor([False])], 2)[1]
    tensor([False])
    """
    out, budget = [], target
    for z in zero_std:
        keep = ~z  # [N_r]
        over = keep.nonzero().flatten()[max(budget, 0):]
        keep[over] = False
        budget -= int(keep.sum())
        out.append(keep)
    return out


def local_rows(keep: torch.Tensor, num_generations: int, process_index: int, local_size: int) -> torch.Tensor:
    """Global group flags [N] -> this process's row flags [local_size] (TRL slices rows by process).

    >>> local_rows(torch.tensor([True, False]), 2, process_index=1, local_size=2)
    tensor([False, False])
    """
    rows = keep.repeat_interleave(num_generations)  # [B_global]
    return rows[process_index * local_size:(process_index + 1) * local_size]  # [B_local]


def fill_rows(kept: torch.Tensor, count: int) -> torch.Tensor:
    """Add dropped rows back (first ones first) until ``count`` rows are kept: every process
    must train on as many rows (TRL gathers per-row metrics) and on a multiple of
    ``steps_per_generation`` (TRL splits the batch into that many microbatches).

    >>> fill_rows(torch.tensor([True, False, True, False, True, False]), 4)
    tensor([ True,  True,  True, False,  True, False])
    """
    kept = kept.clone()
    kept[(~kept).nonzero().flatten()[:max(count - int(kept.sum()), 0)]] = True
    return kept


def common_count(counts: list[int], multiple: int) -> int:
    """The row count every process keeps: the largest kept count, rounded up to a positive
    multiple of ``multiple`` (never more than the rows a process has: the caller caps it).

    >>> common_count([3, 6], 4), common_count([0, 0], 2)
    (8, 2)
    """
    return max(-(-max(counts) // multiple), 1) * multiple


def select_rows(batch: dict, rows: torch.Tensor) -> dict:
    """The rows ``rows`` (bool [B]) of every per-row tensor; 0-d tensors are kept as they are."""
    idx = rows.nonzero().flatten().to(next(v.device for v in batch.values() if isinstance(v, torch.Tensor)))
    return {k: (v[idx] if isinstance(v, torch.Tensor) and v.ndim > 0 else v) for k, v in batch.items()}


def concat_rows(batches: list[dict], pad_token_id: int) -> dict:
    """Stack generation batches of different widths: prompt tensors left-padded to the widest P,
    completion tensors right-padded to the widest C (ids with ``pad_token_id``, the rest with 0),
    per-row vectors concatenated. ``num_items_in_batch`` is left to the caller (it is global).

    >>> a = {"prompt_ids": torch.tensor([[5, 6]]), "completion_ids": torch.tensor([[7]]), "advantages": torch.ones(1)}
    >>> b = {"prompt_ids": torch.tensor([[8]]), "completion_ids": torch.tensor([[9, 9]]), "advantages": torch.zeros(1)}
    >>> out = concat_rows([a, b], pad_token_id=0)
    >>> out["prompt_ids"].tolist(), out["completion_ids"].tolist(), out["advantages"].tolist()
    ([[5, 6], [0, 8]], [[7, 0], [9, 9]], [1.0, 0.0])
    """
    out = {}
    for key, first in batches[0].items():
        values = [b[key] for b in batches]
        if key == "num_items_in_batch" or not isinstance(first, torch.Tensor):
            continue
        if key in PROMPT_KEYS or key in COMPLETION_KEYS:
            width = max(v.size(1) for v in values)
            fill = pad_token_id if key.endswith("_ids") else 0
            padded = []
            for v in values:
                pad = v.new_full((v.size(0), width - v.size(1)), fill)  # [B_r, width - W_r]
                padded.append(torch.cat([pad, v] if key in PROMPT_KEYS else [v, pad], dim=1))
            out[key] = torch.cat(padded)  # [B, width]
        elif first.ndim == 1:
            out[key] = torch.cat(values)  # [B]
        else:
            raise InputError(f"dynamic_sampling cannot merge the batch field {key!r} (shape {tuple(first.shape)}): "
                             "it supports text-only GRPO batches. Turn dynamic_sampling off for this run.")
    return out


# ---------------------------------------------------------------- the rounds, for a GRPOTrainer


def refill(output: dict, rewards: torch.Tensor, record: dict | None, *,
           score_round: Callable[[list[dict]], tuple[dict, torch.Tensor, dict | None]],
           log: Callable[[dict[str, float]], None], accelerator, train_dataset, seed: int, step: int,
           num_generations: int, max_rounds: int, steps_per_generation: int, pad_token_id: int,
           row_key: str) -> tuple[dict, dict | None]:
    """Drop zero-variance groups of ``output`` (one scored generation batch, rows tagged ``row_key``,
    ``rewards`` [B_global], guard ``record`` or None) from the loss and refill with fresh prompts from
    ``train_dataset``, for up to ``max_rounds`` extra rounds. ``score_round(rows)`` generates and scores
    this process's ``rows`` and returns the round's batch, its rewards [B_global] and its guard record;
    ``log(metrics)`` logs ``dynamic_sampling/*``. Decisions use the gathered rewards, so every process
    takes the same rounds. Returns the merged batch and the guard record of every round's rows (row
    tags offset to match)."""
    acc, G = accelerator, num_generations
    target = rewards.numel() // G  # groups per generation batch, all processes
    batches, zero_std = [output], [zero_std_groups(rewards, G)]
    rounds = 0
    while rounds < max_rounds:
        missing = target - int(sum((~z).sum() for z in zero_std))
        if missing <= 0:
            break
        rounds += 1
        while (missing * G) % acc.num_processes:  # rows must split evenly over the processes
            missing += 1
        rows = refill_prompts(train_dataset, missing, G, seed=seed, step=step, round_=rounds,
                              process_index=acc.process_index, num_processes=acc.num_processes)
        out, r, new_record = score_round(rows)
        out[row_key] = out[row_key] + sum(b[row_key].numel() for b in batches)
        if record is not None and new_record is not None:
            record = {k: record[k] + new_record[k] for k in record}
        batches.append(out)
        zero_std.append(zero_std_groups(r, G))
    keeps = keep_groups(zero_std, target)
    kept = sum(int(k.sum()) for k in keeps)
    generated = sum(z.numel() for z in zero_std)
    log({"dynamic_sampling/dropped_share": 1 - kept / generated if kept else 0.0,
         "dynamic_sampling/rounds": rounds,
         "dynamic_sampling/filled_share": kept / target})
    if kept == 0:  # nothing has a gradient: train on the first batch as plain GRPO would
        return output, record
    rows = torch.cat([local_rows(k, G, acc.process_index, b[row_key].numel())
                      for k, b in zip(keeps, batches)])  # [B_local_all_rounds]
    counts = acc.gather(rows.sum().reshape(1).to(acc.device)).tolist()
    rows = fill_rows(rows, min(common_count(counts, steps_per_generation), rows.numel()))
    merged = select_rows(concat_rows(batches, pad_token_id), rows)
    loss_mask = merged["completion_mask"] * merged.get("tool_mask", 1)  # [B, C]
    merged["num_items_in_batch"] = acc.gather(loss_mask.sum()).sum()
    return merged, record


def refill_prompts(train_dataset, groups: int, num_generations: int, *, seed: int, step: int, round_: int,
                   process_index: int, num_processes: int) -> list[dict]:
    """This process's share of ``groups`` fresh prompts x ``num_generations``, drawn from
    ``train_dataset`` with a generator seeded by (seed, step, round): the same draw on every process.

    >>> data = [{"prompt": i} for i in range(10)]
    >>> mine = refill_prompts(data, 2, 3, seed=0, step=5, round_=1, process_index=1, num_processes=2)
    >>> len(mine), mine == refill_prompts(data, 2, 3, seed=0, step=5, round_=1, process_index=1, num_processes=2)
    (3, True)
    """
    gen = torch.Generator().manual_seed(hash((seed, step, round_)) % 2**63)
    idx = torch.randint(len(train_dataset), (groups,), generator=gen).tolist()
    rows = [train_dataset[i] for i in idx for _ in range(num_generations)]
    local = len(rows) // num_processes
    start = process_index * local
    return rows[start:start + local]
