"""DAPO dynamic sampling (Yu et al. 2025, "DAPO", section 3.2; TRL issue #3708).

A group whose advantages are all 0 adds no policy gradient, but it still counts in the loss's
normalisers (the token count ``num_items_in_batch`` of TRL's default ``loss_type='dapo'``, the row
count of ``'grpo'``) and still carries the KL and entropy terms: it dilutes the update. Dynamic
sampling removes such groups' rows from the batch and refills it with groups of fresh prompts, for
up to a capped number of extra generation rounds. Which groups have no gradient is read from the
advantages TRL computed (``flat_groups``), not from the rewards: under
``multi_objective_aggregation='normalize_then_sum'`` TRL normalises each reward function within the
group before the weighted sum, so a group whose weighted reward sums are equal can still have
advantages of both signs. ``refill`` runs the rounds for ``grpotrl.GRPOTrainer``, which hands it
what it needs (a callable that scores one round, one that logs metrics, the settings): it reads and
writes no trainer field. The pure functions before it pick and merge rows. Where TRL's advantages use batch
statistics (``scale_rewards='batch'``, ``multi_objective_aggregation='normalize_then_sum'``), the merged batch's
advantages are recomputed over its own rows (``advantage_parts``, ``merged_advantages``): each round was divided
by its own batch's std, dropped groups included, so the rounds' rows would weigh differently.

Simplified on purpose: refill prompts are drawn uniformly from ``train_dataset`` (seeded by
step and round, the same on every process), not from the next batches of the epoch; a batch
that stays short after the cap trains on fewer rows; a few rows without a gradient stay when
needed so that every process keeps as many rows and the batch splits evenly into
``steps_per_generation`` microbatches (they have advantage 0, but carry KL and entropy
terms), and where the rows a process holds do not split evenly, its last kept rows are
dropped instead (TRL would leave the remainder untrained). Text-only batches (no images).

Letters: B rows, G completions per prompt, N groups (N = B / G globally), P, C widths.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from trl.trainer.utils import nanstd

from ..errors import InputError

PROMPT_KEYS = ("prompt_ids", "prompt_mask")  # [B, P], left-padded
COMPLETION_KEYS = ("completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
                   "sampling_per_token_logps", "importance_sampling_ratio", "tool_mask")  # [B, C], right-padded


def flat_groups(advantages: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[N] True for each group of ``num_generations`` consecutive rows whose advantages (TRL's, over every
    process: [B_global], or [B_global, C]) are all equal: the group carries no policy gradient. Whatever TRL's
    ``multi_objective_aggregation``: under 'sum_then_normalize' a group's advantages are equal exactly when its
    weighted reward sums are; under 'normalize_then_sum' each reward function is normalised within the group
    first, so the group's normalised sums add up to 0 and are equal only when all are 0 (TRL's batch
    normalisation after it moves them by rounding only). Equal: within 1e-6 of the batch's largest
    ``|advantage|`` (at least 1), fp32 rounding of TRL's arithmetic.

    >>> flat_groups(torch.tensor([0.0, 0.0, -0.7, 0.7, 1e-8, -2e-8]), 2)  # the last: rounding of 0
    tensor([ True, False,  True])
    """
    groups = advantages.reshape(-1, num_generations, *advantages.shape[1:]).flatten(1).float()  # [N, G (x C)]
    spread = groups.amax(-1) - groups.amin(-1)  # [N]; NaN: not flat
    scale = float(groups.abs().max()) if groups.numel() else 0.0
    return spread <= 1e-6 * max(scale, 1.0)


def keep_groups(flat: list[torch.Tensor], target: int) -> list[torch.Tensor]:
    """Which groups of each round go into the loss: groups with a gradient, first come,
    at most ``target`` in all. ``flat[r]`` is [N_r] (True = no gradient, ``flat_groups``).

    >>> keep_groups([torch.tensor([True, False, True]), torch.tensor([False, False, True])], 3)
    [tensor([False,  True, False]), tensor([ True,  True, False])]
    >>> keep_groups([torch.tensor([False, False]), torch.tensor([False])], 2)[1]
    tensor([False])
    """
    out, budget = [], target
    for z in flat:
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
    """Exactly ``count`` rows: dropped rows added back (first ones first) while fewer are kept, the
    last kept rows dropped while more are: every process must train on as many rows (TRL gathers
    per-row metrics) and on a multiple of ``steps_per_generation`` (TRL splits the batch into that
    many equal microbatches and never trains the remainder).

    >>> fill_rows(torch.tensor([True, False, True, False, True, False]), 4)
    tensor([ True,  True,  True, False,  True, False])
    >>> fill_rows(torch.tensor([True, False, True, False, True, False]), 2)
    tensor([ True, False,  True, False, False, False])
    """
    kept = kept.clone()
    kept[(~kept).nonzero().flatten()[:max(count - int(kept.sum()), 0)]] = True
    kept[kept.nonzero().flatten()[max(count, 0):]] = False
    return kept


def common_count(counts: list[int], multiple: int) -> int:
    """The row count every process keeps: the largest kept count, rounded up to a positive
    multiple of ``multiple`` (never more than the rows a process has: the caller caps it at the
    largest multiple of ``multiple`` it has).

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


# ---------------------------------------------------------------- advantages of a merged batch

# per-row fields a round's batch carries through ``concat_rows`` and ``select_rows`` (``advantage_parts``)
ADVANTAGE_PARTS = ("grpotrl_batch_value", "grpotrl_advantage_numerator")


def uses_batch_statistics(scale_rewards: str, aggregation: str) -> bool:
    """Whether TRL's advantages depend on the whole batch, not only on each group: ``scale_rewards='batch'``
    divides by the batch's reward std, ``multi_objective_aggregation='normalize_then_sum'`` centres and divides by
    the batch's. A batch merged from several rounds then needs them over the merged rows (``merged_advantages``)."""
    return scale_rewards == "batch" or aggregation == "normalize_then_sum"


def advantage_parts(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                    aggregation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL 1.16's advantage computation (``_generate_and_score_completions``) split at its batch statistics, for a
    round's rewards ``rewards_per_func`` [N_rows, K] (every process's, NaN where a function gave None; groups of
    ``num_generations`` consecutive rows) and ``weights`` [K]: per row, the value the batch statistics are taken over
    ``q`` [N_rows] and the numerator ``n`` [N_rows] whose division by them is the advantage (``merged_advantages``).
    ``sum_then_normalize``: ``q`` the weighted reward (NaN where every function gave None), ``n`` it minus its
    group's mean; ``normalize_then_sum``: ``q = n`` the weighted sum of the group-normalised rewards.

    >>> q, n = advantage_parts(torch.tensor([[0.0], [1.0], [3.0], [3.0]]), torch.ones(1), 2, "sum_then_normalize")
    >>> q.tolist(), n.tolist()
    ([0.0, 1.0, 3.0, 3.0], [-0.5, 0.5, 0.0, 0.0])
    """
    G, K = num_generations, rewards_per_func.size(1)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)  # [N_rows]
    w = weights.to(rewards_per_func.device).unsqueeze(0)  # [1, K]
    if aggregation == "sum_then_normalize":
        q = (rewards_per_func * w).nansum(dim=1)  # [N_rows]
        q[unscorable] = torch.nan
        return q, q - torch.nanmean(q.view(-1, G), dim=1).repeat_interleave(G)
    grouped = rewards_per_func.view(-1, G, K)  # [N, G, K]
    z = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    q = (z.view(-1, K) * w).nansum(dim=1)  # [N_rows]
    q[unscorable] = torch.nan
    return q, q


def merged_advantages(q: torch.Tensor, n: torch.Tensor, aggregation: str) -> torch.Tensor:
    """The advantages [N_rows] TRL would give a batch of these rows (``advantage_parts``' ``q`` and ``n``, over every
    process), its batch statistics taken over these rows: ``n / (nanstd(q) + 1e-4)``, centred on ``nanmean(q)`` first
    under ``normalize_then_sum``; 0 where NaN (an unscorable row), as TRL's.

    >>> q, n = torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.tensor([-0.5, 0.5, -0.5, 0.5])
    >>> [round(a, 4) for a in merged_advantages(q, n, "sum_then_normalize").tolist()]  # nanstd 0.5774
    [-0.8659, 0.8659, -0.8659, 0.8659]
    """
    std = nanstd(q) if q.numel() > 1 else torch.zeros((), device=q.device)
    centre = torch.nanmean(q) if aggregation == "normalize_then_sum" else 0.0
    return torch.nan_to_num((n - centre) / (std + 1e-4), nan=0.0)


# ---------------------------------------------------------------- the rounds, for a GRPOTrainer


def refill(output: dict, advantages: torch.Tensor, record: dict | None, *,
           score_round: Callable[[list[dict]], tuple[dict, torch.Tensor, dict | None]],
           log: Callable[[dict[str, float]], None], accelerator, train_dataset, seed: int, step: int,
           num_generations: int, max_rounds: int, steps_per_generation: int, pad_token_id: int,
           row_key: str, aggregation: str | None = None) -> tuple[dict, dict | None]:
    """Drop the groups of ``output`` (one scored generation batch, rows tagged ``row_key``, guard ``record`` or
    None) that carry no policy gradient (``flat_groups`` of ``advantages`` [B_global], the advantages TRL
    computed, gathered over every process) from the loss and refill with fresh prompts from ``train_dataset``,
    for up to ``max_rounds`` extra rounds. ``score_round(rows)`` generates and scores this process's ``rows``
    and returns the round's batch, its advantages [B_global] and its guard record; ``log(metrics)`` logs
    ``dynamic_sampling/*``. Decisions use the gathered advantages, so every process takes the same rounds.
    Where the batches carry ``ADVANTAGE_PARTS`` (``aggregation`` given: TRL's advantages use batch statistics,
    ``uses_batch_statistics``), the merged rows' advantages are recomputed over the merged batch
    (``merged_advantages``): each round's were divided by its own batch's std, which the dropped groups were in.
    Returns the merged batch and the guard record of every round's rows (row tags offset to match)."""
    acc, G = accelerator, num_generations
    target = advantages.size(0) // G  # groups per generation batch, all processes
    batches, flat = [output], [flat_groups(advantages, G)]
    rounds = 0
    while rounds < max_rounds:
        missing = target - int(sum((~z).sum() for z in flat))
        if missing <= 0:
            break
        rounds += 1
        while (missing * G) % acc.num_processes:  # rows must split evenly over the processes
            missing += 1
        rows = refill_prompts(train_dataset, missing, G, seed=seed, step=step, round_=rounds,
                              process_index=acc.process_index, num_processes=acc.num_processes)
        out, round_advantages, new_record = score_round(rows)
        out[row_key] = out[row_key] + sum(b[row_key].numel() for b in batches)
        if record is not None and new_record is not None:
            record = {k: record[k] + new_record[k] for k in record}
        batches.append(out)
        flat.append(flat_groups(round_advantages, G))
    keeps = keep_groups(flat, target)
    kept = sum(int(k.sum()) for k in keeps)
    generated = sum(z.numel() for z in flat)
    log({"dynamic_sampling/dropped_share": 1 - kept / generated if kept else 0.0,
         "dynamic_sampling/rounds": rounds,
         "dynamic_sampling/filled_share": kept / target})
    if kept == 0:  # nothing has a gradient: train on the first batch as plain GRPO would
        return {k: v for k, v in output.items() if k not in ADVANTAGE_PARTS}, record
    rows = torch.cat([local_rows(k, G, acc.process_index, b[row_key].numel())
                      for k, b in zip(keeps, batches)])  # [B_local_all_rounds]
    counts = acc.gather(rows.sum().reshape(1).to(acc.device)).tolist()
    whole = rows.numel() // steps_per_generation * steps_per_generation  # the same on every process
    rows = fill_rows(rows, min(common_count(counts, steps_per_generation), whole))
    merged = select_rows(concat_rows(batches, pad_token_id), rows)
    if aggregation is not None:  # the batch statistics over the merged rows, every process's
        q, n = (merged.pop(k) for k in ADVANTAGE_PARTS)  # [B_local] each
        advantages = merged_advantages(acc.gather(q), acc.gather(n), aggregation)  # [B_global]
        local = q.numel()  # the same on every process
        merged["advantages"] = advantages[acc.process_index * local:(acc.process_index + 1) * local]
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
