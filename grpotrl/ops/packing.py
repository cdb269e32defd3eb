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

Why rows of at most ``capacity`` (the padded width ``L``) rather than one ``[1, sum]`` row: a
masked attention costs ``W^2`` per row, so one long row would cost more than the padded batch;
rows no wider than a padded row each cost at most what a padded row does, and there are fewer.
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
    cols = [real[i].nonzero().squeeze(-1) for i in range(B)]  # B x [n_i] the real columns of each row
    plan = pack_plan([c.numel() for c in cols], capacity)
    W = max((sum(cols[i].numel() for i in row) for row in plan), default=1)
    W = max(W, 2)  # the head's shifted output [R, W - 1] must not be empty
    ids = torch.full((len(plan), W), pad_id, dtype=input_ids.dtype, device=device)  # [R, W]
    pos = torch.zeros((len(plan), W), dtype=torch.long, device=device)  # [R, W]
    labels = torch.full((len(plan), W), IGNORE, dtype=input_ids.dtype, device=device)  # [R, W]
    source, target = [], []
    for r, row in enumerate(plan):
        offset = 0
        for i in row:
            c = cols[i]  # [n_i]
            n = c.numel()
            ids[r, offset:offset + n] = input_ids[i, c]
            pos[r, offset:offset + n] = torch.arange(n, device=device)
            scored = (c >= L - K).nonzero().squeeze(-1)  # [m_i] indices within the sequence
            scored = scored[scored > 0]
            labels[r, offset + scored] = input_ids[i, c[scored]]
            source.append(r * (W - 1) + offset + scored - 1)  # the position that predicts it
            target.append(i * K + c[scored] - (L - K))
            offset += n
        pos[r, offset:] = torch.arange(W - offset, device=device)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return Packed(ids, pos, labels, torch.cat(source) if source else empty, torch.cat(target) if target else empty,
                  (B, K))


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The head's shifted per-position values ``[R, W - 1]`` back to the padded layout ``[B, K]``:
    each scored token's value at its padded place, 0 elsewhere (as TRL's head leaves unscored places).
    Differentiable: the gradient flows back to ``values`` at the scored positions only."""
    B, K = packed.shape
    flat = values.reshape(-1)[packed.source]  # [N]
    out = values.new_zeros(B * K).index_put((packed.target,), flat)  # [B * K]
    return out.view(B, K)
