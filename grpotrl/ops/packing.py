"""Padding-free packing for the GRPO logprob forward: pure index math, no model, no trainer.

Letters: ``B`` rows of the padded batch, ``L`` its width (prompt width ``P`` + completion width
``K``, left-padded prompts, right-padded completions), ``R`` packed rows, ``W`` their width
(``W <= capacity``), ``N`` scored tokens.

A padded row's real tokens (``attention_mask == 1``) form one sequence. ``pack`` lays the
sequences end to end into rows of at most ``capacity`` tokens (first-fit decreasing,
``pack_plan``), with position ids restarting at 0 for each sequence: transformers then keeps
attention inside each sequence (``attention_mask=None``; ``masking_utils.find_packed_sequence_indices``).
Labels are -100 everywhere except the scored tokens (real tokens in the last ``K`` columns), so
no prediction across a sequence boundary is ever scored. ``unpack`` puts the per-position values
a fused LM head returns for the packed rows (shifted: ``values[r, w]`` scores token ``w + 1``)
back into the padded layout ``[B, K]``, zeros where nothing is scored, differentiably.

``balance_plan`` splits one optimizer step's rows into its microbatches (same count each) with even
token sums: the heaviest microbatch sets the peak memory, and packing alone cannot lighten it.

Why rows of at most ``capacity`` (the padded width ``L``) rather than one ``[1, sum]`` row: a
masked attention costs ``W^2`` per row. Measured on SmolLM2 (``bench/bench_packing_capacity.py``):
one loss microbatch's forward + backward at rows of at most L, 1.5 L, 2 L, 3 L and one row took 0.64-0.67x,
0.61-0.79x, 0.64-0.75x, 0.77-0.90x and 0.64-0.77x of the padded one's in two runs; only 1.5 L was faster
than ``L``, in one run of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # the label transformers and TRL's fused head skip


def pack_plan(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: sequence indices per packed row, each row's lengths summing to at most
    ``capacity``. Sequences are placed longest first (ties in index order), each into the first row
    with room, else a new row; a row lists its sequences in placement order.

    >>> pack_plan([3, 5, 2, 4], capacity=6)
    [[1], [3, 2], [0]]
    """
    if any(n > capacity for n in lengths):
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit a row of capacity {capacity}")
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if r is None:
            rows.append([])
            room.append(capacity)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


def balance_plan(lengths: list[int], groups: int) -> list[list[int]]:
    """Indices ``0..n-1`` split into ``groups`` groups of ``n // groups`` each (``n`` a multiple of
    ``groups``), their token sums made even greedily: longest first (ties in index order), each into
    the lightest group with room (ties: the lower group); each group's indices ascending. Where that
    does not lower the heaviest group's sum, the consecutive grouping ``[0..m-1], [m..2m-1], ...`` is
    returned unchanged.

    >>> balance_plan([9, 9, 1, 1], groups=2)  # consecutive: 18 and 2; balanced: 10 and 10
    [[0, 2], [1, 3]]
    >>> balance_plan([5, 1, 1, 5], groups=2)  # consecutive is already 6 and 6
    [[0, 1], [2, 3]]
    """
    n = len(lengths)
    if groups < 1 or n % groups:
        raise ValueError(f"{n} rows do not split into {groups} equal groups")
    size = n // groups
    consecutive = [list(range(g * size, (g + 1) * size)) for g in range(groups)]
    plan, sums = [[] for _ in range(groups)], [0] * groups
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        g = min((g for g in range(groups) if len(plan[g]) < size), key=lambda g: (sums[g], g))
        plan[g].append(i)
        sums[g] += lengths[i]
    heaviest = max(sum(lengths[i] for i in group) for group in consecutive)
    return [sorted(group) for group in plan] if max(sums) < heaviest else consecutive


@dataclass
class Packed:
    """Packed rows and the map back to the padded layout."""

    input_ids: torch.Tensor  # [R, W] the sequences end to end; pad_id after the last one
    position_ids: torch.Tensor  # [R, W] 0.. within each sequence; the tail after the last restarts at 0
    labels: torch.Tensor  # [R, W] the token at scored positions, IGNORE elsewhere
    source: torch.Tensor  # [N] flat index into the head's shifted output [R, W - 1] (the position before the token)
    target: torch.Tensor  # [N] flat index into [B, K]
    shape: tuple[int, int]  # (B, K)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, capacity: int,
         pad_id: int = 0) -> Packed:
    """Pack each row's real tokens (``input_ids [B, L]`` where ``attention_mask [B, L] == 1``) into rows
    of at most ``capacity`` tokens (``pack_plan``). The tokens in the last ``logits_to_keep`` columns
    are scored (labels); a sequence's first token never is (nothing of its own precedes it)."""
    B, L = input_ids.shape
    K = logits_to_keep
    device = input_ids.device
    real = attention_mask.bool()  # [B, L]
    lengths = real.sum(1).tolist()  # B ints (a host sync; real.nonzero below is the other)
    plan = pack_plan(lengths, capacity)
    row_of, offset_of, used = [0] * B, [0] * B, []  # each sequence's packed row and start; each row's length
    for r, row in enumerate(plan):
        offset = 0
        for i in row:
            row_of[i], offset_of[i] = r, offset
            offset += lengths[i]
        used.append(offset)
    R, W = len(plan), max(max(used, default=1), 2)  # the head's shifted output [R, W - 1] must not be empty
    rank = real.long().cumsum(1) - 1  # [B, L] each real token's place within its sequence
    b, j = real.nonzero(as_tuple=True)  # [T] every real token (padded row, column)
    k = rank[b, j]  # [T]
    row = torch.tensor(row_of, dtype=torch.long, device=device)[b]  # [T] its packed row
    col = torch.tensor(offset_of, dtype=torch.long, device=device)[b] + k  # [T] its packed column
    w = torch.arange(W, device=device)  # [W]
    end = torch.tensor(used, dtype=torch.long, device=device).view(R, 1)  # [R, 1]
    pos = torch.where(w >= end, w - end, 0)  # [R, W]: the tail after the last sequence restarts at 0
    pos[row, col] = k
    ids = torch.full((R, W), pad_id, dtype=input_ids.dtype, device=device)  # [R, W]
    ids[row, col] = input_ids[b, j]
    scored = (j >= L - K) & (k > 0)  # [T] in the last K columns, not a sequence's first token
    labels = torch.full((R, W), IGNORE, dtype=input_ids.dtype, device=device)  # [R, W]
    labels[row[scored], col[scored]] = input_ids[b[scored], j[scored]]
    source = row[scored] * (W - 1) + col[scored] - 1  # [N] the position that predicts each scored token
    target = b[scored] * K + j[scored] - (L - K)  # [N]
    order = source.argsort()  # packed order: row by row, left to right
    return Packed(ids, pos, labels, source[order], target[order], (B, K))


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The head's shifted per-position values ``[R, W - 1]`` back to the padded layout ``[B, K]``:
    each scored token's value at its padded place, 0 elsewhere (as TRL's head leaves unscored places).
    Differentiable: the gradient flows back to ``values`` at the scored positions only."""
    B, K = packed.shape
    flat = values.reshape(-1)[packed.source]  # [N]
    out = values.new_zeros(B * K).index_put((packed.target,), flat)  # [B * K]
    return out.view(B, K)
