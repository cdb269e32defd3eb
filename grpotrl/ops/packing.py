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
``prompt_plan`` splits them by prompt instead, for forwards that share a prompt across all of their rows.

``share_prompts`` (``share_plan``): the rows of one prompt (a GRPO group) run the prompt once, in a tree
(the prompt but its last token, then each row's last prompt token and completion) under an attention
mask that keeps each row to the prompt and itself.

``forward_plan`` groups the packed rows into forwards, each cut to its widest row: the row of one long
sequence sets its own forward's width, not every row's.

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


def balance_plan(lengths: list[int], groups: int, prompts: list[tuple] | None = None) -> list[list[int]]:
    """Indices ``0..n-1`` split into ``groups`` groups of ``n // groups`` each (``n`` a multiple of
    ``groups``), their token costs made even greedily: longest first (ties in index order), each into
    the group it leaves lightest among those with room (ties: the lower group); each group's indices
    ascending. A group's cost is its rows' lengths; with ``prompts`` (each row's prompt tokens, where
    the packed forward shares them: ``share_plan``), less each prompt's shared tokens counted once per
    extra row, so that a row goes where its prompt already is unless that group is heavier by more. Where
    the greedy plan does not lower the heaviest group's cost, the consecutive grouping ``[0..m-1],
    [m..2m-1], ...`` is returned unchanged.

    >>> balance_plan([9, 9, 1, 1], groups=2)  # consecutive: 18 and 2; balanced: 10 and 10
    [[0, 2], [1, 3]]
    >>> balance_plan([5, 1, 1, 5], groups=2)  # consecutive is already 6 and 6
    [[0, 1], [2, 3]]
    >>> balance_plan([10, 8, 7, 5], groups=2)  # 15 and 15
    [[0, 3], [1, 2]]
    >>> balance_plan([10, 8, 7, 5], groups=2, prompts=[(1,) * 6, (2,), (1,) * 6, (2,)])  # 10 + 7 - 5, 8 + 5
    [[0, 2], [1, 3]]
    """
    n = len(lengths)
    if groups < 1 or n % groups:
        raise ValueError(f"{n} rows do not split into {groups} equal groups")
    size = n // groups
    saves = [max(len(p) - 1, 0) for p in prompts] if prompts is not None else [0] * n  # tokens a shared row saves
    key = prompts if prompts is not None else list(range(n))

    def added(i: int, seen: set) -> int:  # row i's cost in a group holding the prompts ``seen``
        return lengths[i] - (saves[i] if key[i] in seen else 0)

    def cost(rows: list[int]) -> int:
        seen, total = set(), 0
        for i in rows:
            total += added(i, seen)
            seen.add(key[i])
        return total

    plan, sums, seen = [[] for _ in range(groups)], [0] * groups, [set() for _ in range(groups)]
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        g = min((g for g in range(groups) if len(plan[g]) < size), key=lambda g: (sums[g] + added(i, seen[g]), g))
        sums[g] += added(i, seen[g])
        plan[g].append(i)
        seen[g].add(key[i])
    consecutive = [list(range(g * size, (g + 1) * size)) for g in range(groups)]
    return [sorted(group) for group in plan] if max(sums) < max(map(cost, consecutive)) else consecutive


def prompt_plan(prompts: list[tuple], groups: int) -> list[list[int]]:
    """Indices ``0..n-1`` split into ``groups`` groups of ``n // groups`` each, a prompt's rows together:
    rows in the order of their prompt's first row (then by index), cut into consecutive groups; each
    group's indices ascending. Where a forward shares a prompt across all of its rows (varlen trees of up
    to a forward's tokens), a group's cost is its rows' own tokens plus each of its prompts once, so this
    grouping runs each prompt about once per step (``#prompts + groups - 1`` prompt runs at most) where
    ``balance_plan`` spreads a prompt's rows over the groups to even them.

    >>> prompt_plan([(1,), (2,), (1,), (2,)], groups=2)
    [[0, 2], [1, 3]]
    >>> prompt_plan([(3,), (3,), (3,), (4,), (4,), (4,)], groups=2)  # already together: consecutive
    [[0, 1, 2], [3, 4, 5]]
    >>> prompt_plan([(5,), (6,), (6,), (5,), (6,), (6,)], groups=3)  # 5 5 | 6 6 | 6 6
    [[0, 3], [1, 2], [4, 5]]
    """
    n = len(prompts)
    if groups < 1 or n % groups:
        raise ValueError(f"{n} rows do not split into {groups} equal groups")
    size, first = n // groups, {}
    for i, prompt in enumerate(prompts):
        first.setdefault(prompt, i)
    order = sorted(range(n), key=lambda i: (first[prompts[i]], i))
    return [sorted(order[g * size:(g + 1) * size]) for g in range(groups)]


def prompts_of(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[tuple]:
    """Each row's real prompt tokens (``prompt_ids [B, P]`` where ``prompt_mask == 1``) as a tuple: rows
    with equal tuples share a prompt (``share_plan``, ``balance_plan``). One host transfer.

    >>> prompts_of(torch.tensor([[0, 5, 6], [5, 6, 7]]), torch.tensor([[0, 1, 1], [1, 1, 1]]))
    [(5, 6), (5, 6, 7)]
    """
    rows = prompt_ids.masked_fill(prompt_mask == 0, -1).tolist()  # -1: no token id
    return [tuple(t for t in row if t != -1) for row in rows]


def share_plan(prompts: list[tuple], lengths: list[int], capacity: int) -> tuple[list[int], list[list[int]]]:
    """Rows with the same prompt share its forward: each row's tokens in its tree's shared prefix (the
    prompt but its last token, which each row keeps so that it predicts the row's first completion
    token), and the trees (rows sharing one prefix, each tree at most ``capacity`` tokens: the prefix
    once plus each row's own tokens). A prompt's rows fill trees first-fit decreasing (``pack_plan``);
    a prompt of fewer than 2 tokens, or a row alone with its prompt, is a tree of its own.

    >>> share_plan([(1, 2, 3), (1, 2, 3), (4,)], lengths=[5, 6, 2], capacity=9)
    ([2, 2, 0], [[1, 0], [2]])
    """
    rows_of: dict[tuple, list[int]] = {}
    for b, prompt in enumerate(prompts):
        rows_of.setdefault(prompt, []).append(b)
    prefix, trees = [0] * len(prompts), []
    for prompt, rows in rows_of.items():
        shared = len(prompt) - 1
        if shared < 1 or len(rows) < 2:
            trees.extend([b] for b in rows)
            continue
        for tree in pack_plan([lengths[b] - shared for b in rows], capacity - shared):
            trees.append([rows[i] for i in tree])
            for i in tree:
                prefix[rows[i]] = shared
    return prefix, trees


def forward_plan(widths: list[int], max_rows: int, overhead: int | None = None) -> list[list[int]]:
    """Packed rows (each row's used width) grouped into forwards of at most ``max_rows`` rows, each forward
    cut to its widest row (``rows x widest`` cells): rows widest first (ties in index order), in
    consecutive runs that minimise the cells plus ``overhead`` cells per forward (what a forward costs
    besides its tokens); ``overhead=None``: the fewest forwards ``max_rows`` allows, and among those the
    fewest cells. Consecutive runs of the sorted rows lose nothing: swapping a narrower row of an earlier
    run with a wider one of a later run never makes either run wider.

    >>> forward_plan([200, 298, 122, 290], max_rows=8, overhead=64)  # 596 + 200 + 122 + 3 x 64 = 1110 cells
    [[1, 3], [0], [2]]
    >>> forward_plan([200, 298, 122, 290], max_rows=8)  # one forward of 4 x 298
    [[1, 3, 0, 2]]
    >>> forward_plan([200, 298, 122, 290], max_rows=2)  # two forwards at least: 2 x 298 + 2 x 200 cells
    [[1, 3], [0, 2]]
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    order = sorted(range(len(widths)), key=lambda r: (-widths[r], r))
    w = [widths[r] for r in order]
    n = len(w)
    # None: a forward outweighs any cells saved (every plan's cells lie in [sum(w), n * w[0]])
    per_forward = n * w[0] + 1 if overhead is None and n else overhead or 0
    best, cut = [0] + [None] * n, [0] * (n + 1)  # the cheapest plan of the j widest rows; where its last run starts
    for j in range(1, n + 1):
        for i in range(max(0, j - max_rows), j):
            cost = best[i] + (j - i) * w[i] + per_forward  # rows i..j-1, as wide as row i
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], n
    while j > 0:
        runs.append(order[cut[j]:j])
        j = cut[j]
    return runs[::-1]


@dataclass
class Packed:
    """Packed rows and the map back to the padded layout."""

    input_ids: torch.Tensor  # [R, W] the sequences end to end; pad_id after the last one
    position_ids: torch.Tensor  # [R, W] 0.. within each sequence; the tail after the last restarts at 0
    labels: torch.Tensor  # [R, W] the token at scored positions, IGNORE elsewhere
    source: torch.Tensor  # [N] flat index into the head's shifted output [R, W - 1] (the position before the token)
    target: torch.Tensor  # [N] flat index into [B, K]
    shape: tuple[int, int]  # (B, K)
    widths: list[int]  # R ints: each row's used width (its sequences; the tail after them is unused)
    tree: torch.Tensor | None = None  # [R, W] shared prompts only: each position's tree, -1 in a row's tail
    branch: torch.Tensor | None = None  # [R, W] shared prompts only: each position's padded row, -1 in a prefix
    # R lists: each row's trees, left to right, as (shared prefix p, each sequence's own tokens after it); a
    # sequence that shares nothing is (0, [its length])
    trees: list[list[tuple[int, list[int]]]] | None = None

    @property
    def spans(self) -> list[list[int]]:
        """R lists: each row's sequences' (trees') lengths, left to right."""
        return [[p + sum(own) for p, own in row] for row in self.trees]

    def attention_mask(self, rows: torch.Tensor | slice, width: int) -> torch.Tensor | None:
        """Shared prompts: the attention mask [r, 1, w, w] of ``rows`` (indices) cut to their first ``width``
        columns (True: the query may see the key): a token sees the earlier tokens of its tree's prefix and
        of its own row, nothing else (a row's tail sees its own tail). None without shared prompts:
        transformers reads the sequences from the restarting position ids."""
        if self.tree is None:
            return None
        tree, branch = self.tree[rows, :width], self.branch[rows, :width]  # [r, w]
        w = torch.arange(tree.size(1), device=tree.device)  # [w]
        same_tree = tree.unsqueeze(2) == tree.unsqueeze(1)  # [r, w(query), w(key)]
        visible = (branch.unsqueeze(1) == -1) | (branch.unsqueeze(1) == branch.unsqueeze(2))  # [r, w, w]
        return (same_tree & visible & (w.view(1, -1) <= w.view(-1, 1))).unsqueeze(1)  # [r, 1, w, w]


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, capacity: int,
         pad_id: int = 0, share_prompts: bool = False) -> Packed:
    """Pack each row's real tokens (``input_ids [B, L]`` where ``attention_mask [B, L] == 1``) into rows
    of at most ``capacity`` tokens (``pack_plan``). The tokens in the last ``logits_to_keep`` columns
    are scored (labels); a sequence's first token never is (nothing of its own precedes it).

    ``share_prompts``: rows with the same prompt (the real tokens before the last ``logits_to_keep``
    columns) are laid out as one tree (``share_plan``): the prompt but its last token once, then each
    row's last prompt token and completion; ``Packed.attention_mask`` keeps each row to the prefix and
    itself. Position ids stay each token's place in its own sequence."""
    B, L = input_ids.shape
    K = logits_to_keep
    device = input_ids.device
    real = attention_mask.bool()  # [B, L]
    lengths = real.sum(1).tolist()  # B ints (a host sync; real.nonzero below is the other)
    prefix, trees = [0] * B, [[b] for b in range(B)]
    if share_prompts:  # the prompts: a third host sync
        prefix, trees = share_plan(prompts_of(input_ids[:, :L - K], real[:, :L - K]), lengths, capacity)
    plan = pack_plan([prefix[t[0]] + sum(lengths[b] - prefix[b] for b in t) for t in trees], capacity)
    tree_of, row_of, offset_of, used = [0] * B, [0] * B, [0] * B, []  # each sequence's tree, packed row, start
    shift_of = [0] * B  # where each row's own tokens start after its tree's prefix
    layout = [[] for _ in plan]  # each packed row's trees as (prefix, own lengths)
    for r, row in enumerate(plan):
        offset = 0
        for t in row:
            start, offset = offset, offset + prefix[trees[t][0]]  # the tree's start; its first row's own tokens
            for b in trees[t]:
                tree_of[b], row_of[b], offset_of[b] = t, r, start
                shift_of[b] = offset - start - prefix[b]  # 0 for a tree's first row
                offset += lengths[b] - prefix[b]
            layout[r].append((prefix[trees[t][0]], [lengths[b] - prefix[b] for b in trees[t]]))
        used.append(offset)
    R, W = len(plan), max(max(used, default=1), 2)  # the head's shifted output [R, W - 1] must not be empty
    rank = real.long().cumsum(1) - 1  # [B, L] each real token's place within its sequence
    b, j = real.nonzero(as_tuple=True)  # [T] every real token (padded row, column)
    k = rank[b, j]  # [T]
    own = k >= torch.tensor(prefix, dtype=torch.long, device=device)[b]  # [T] not in a shared prefix
    row = torch.tensor(row_of, dtype=torch.long, device=device)[b]  # [T] its packed row
    col = torch.tensor(offset_of, dtype=torch.long, device=device)[b] + k \
        + own * torch.tensor(shift_of, dtype=torch.long, device=device)[b]  # [T] its packed column
    w = torch.arange(W, device=device)  # [W]
    end = torch.tensor(used, dtype=torch.long, device=device).view(R, 1)  # [R, 1]
    pos = torch.where(w >= end, w - end, 0)  # [R, W]: the tail after the last sequence restarts at 0
    pos[row, col] = k  # a shared prefix's tokens are written once per row, the same values each time
    ids = torch.full((R, W), pad_id, dtype=input_ids.dtype, device=device)  # [R, W]
    ids[row, col] = input_ids[b, j]
    scored = (j >= L - K) & (k > 0)  # [T] in the last K columns, not a sequence's first token
    labels = torch.full((R, W), IGNORE, dtype=input_ids.dtype, device=device)  # [R, W]
    labels[row[scored], col[scored]] = input_ids[b[scored], j[scored]]
    source = row[scored] * (W - 1) + col[scored] - 1  # [N] the position that predicts each scored token
    target = b[scored] * K + j[scored] - (L - K)  # [N]
    order = source.argsort()  # packed order: row by row, left to right
    tree = branch = None
    if any(len(t) > 1 for t in trees):
        tree = torch.full((R, W), -1, dtype=torch.long, device=device)  # [R, W]
        tree[row, col] = torch.tensor(tree_of, dtype=torch.long, device=device)[b]
        branch = torch.full((R, W), -1, dtype=torch.long, device=device)  # [R, W]
        branch[row[own], col[own]] = b[own]
    return Packed(ids, pos, labels, source[order], target[order], (B, K), used, tree, branch, layout)


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The head's shifted per-position values ``[R, W - 1]`` back to the padded layout ``[B, K]``:
    each scored token's value at its padded place, 0 elsewhere (as TRL's head leaves unscored places).
    Differentiable: the gradient flows back to ``values`` at the scored positions only."""
    B, K = packed.shape
    flat = values.reshape(-1)[packed.source]  # [N]
    out = values.new_zeros(B * K).index_put((packed.target,), flat)  # [B * K]
    return out.view(B, K)
