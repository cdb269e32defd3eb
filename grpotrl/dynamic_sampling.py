"""DAPO dynamic sampling (Yu et al. 2025, "DAPO", section 3.2; TRL issue #3708): pure parts.

A group whose rewards are all equal has advantage 0 for every member, so it adds no policy
gradient, but it still counts in the loss's normalisers (the token count ``num_items_in_batch``
of TRL's default ``loss_type='dapo'``, the row count of ``'grpo'``) and still carries the KL
and entropy terms: it dilutes the update. Dynamic sampling removes such groups' rows from the
batch and refills it with groups of fresh prompts, for up to a capped number of extra
generation rounds. ``grpotrl.GRPOTrainer`` runs the rounds; this module picks and merges rows.

Simplified on purpose: refill prompts are drawn uniformly from ``train_dataset`` (seeded by
step and round, the same on every process), not from the next batches of the epoch; a batch
that stays short after the cap trains on fewer rows; a few zero-variance rows stay when
needed so that every process keeps as many rows and the batch splits evenly into
``steps_per_generation`` microbatches (they have advantage 0, but carry KL and entropy
terms). Text-only batches (no images).

Letters: B rows, G completions per prompt, N groups (N = B / G globally), P, C widths.
"""

from __future__ import annotations

import torch

from .errors import InputError

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
