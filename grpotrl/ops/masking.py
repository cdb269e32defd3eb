"""Completion masks, stop positions and position ids: pure tensor functions.

Letters: B rows in a generation batch, P padded prompt width (prompts are left-padded),
C padded completion width (completions are right-padded), L = P + C.

INVARIANTS I3 and I4 live here:
  * a completion is ``sequence[i, P:]``; ``P`` is the padded width, never a count of
    non-pad tokens;
  * ``completion_mask[i, t] == 1`` exactly for ``t <= first stop position`` (or for all
    real tokens when no stop token was produced), whether or not ``pad == eos``.
"""

from __future__ import annotations

import torch


def first_stop_index(completion_ids: torch.Tensor, stop_ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Index of the first stop token in each row, or ``C`` when a row holds none (every row of an empty
    completion batch, ``C = 0``).

    >>> first_stop_index(torch.tensor([[5, 2, 2], [5, 6, 7]]), [2]).tolist()
    [1, 3]
    >>> first_stop_index(torch.zeros(2, 0, dtype=torch.long), [2]).tolist()
    [0, 0]
    """
    stop = torch.as_tensor(stop_ids, device=completion_ids.device)
    is_stop = torch.isin(completion_ids, stop)  # [B, C]
    C = completion_ids.size(1)
    idx = torch.full((completion_ids.size(0),), C, dtype=torch.long, device=completion_ids.device)  # [B]
    has = is_stop.any(dim=1)  # [B]; all False for C = 0, where argmax has nothing to reduce
    if C:
        idx[has] = is_stop.int().argmax(dim=1)[has]
    return idx


def completion_mask(
    completion_ids: torch.Tensor,
    stop_ids: list[int] | torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """I4: 1 up to and including the first stop token, 0 after it.

    ``lengths`` (``[B]``) are the numbers of real tokens per row; without it every one of the
    ``C`` columns counts as real. Stop tokens after the first, including padding that equals
    eos, are masked: the mask never looks at ``pad_token_id``.

    >>> completion_mask(torch.tensor([[7, 2, 2, 2], [7, 8, 9, 2], [7, 8, 9, 9]]), [2]).tolist()
    [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    >>> completion_mask(torch.tensor([[7, 8, 0, 0]]), [2], lengths=torch.tensor([2])).tolist()
    [[1, 1, 0, 0]]
    """
    B, C = completion_ids.shape
    t = torch.arange(C, device=completion_ids.device).expand(B, C)  # [B, C]
    stop_at = first_stop_index(completion_ids, stop_ids)  # [B]
    if lengths is not None:
        stop_at = torch.minimum(stop_at, lengths.to(completion_ids.device) - 1)
    return (t <= stop_at.unsqueeze(1)).long()  # [B, C]


def expected_lengths(completion_ids: torch.Tensor, stop_ids: list[int] | torch.Tensor,
                     max_length: int) -> torch.Tensor:
    """I4's lengths from the tokens alone: each row ends at its first stop token (kept), and a row
    with none in its first ``max_length`` tokens ran to ``max_length`` (generation's cap). [B, C] -> [B]

    A result above ``C`` means a row of fewer than ``max_length`` tokens with no stop token: no
    generation ends that way, so its stop token was dropped (the I4 guard fails it).

    >>> ids = torch.tensor([[7, 2, 0, 0], [7, 8, 9, 6], [7, 8, 0, 0]])  # stop id 2, pad id 0
    >>> expected_lengths(ids, [2], max_length=4).tolist()  # row 2 lost its stop: 4 tokens, not 2
    [2, 4, 4]
    >>> expected_lengths(ids[:, :3], [2], max_length=4).tolist()  # 4 > C = 3 for rows 1, 2: impossible
    [2, 4, 4]
    """
    cap = torch.full((completion_ids.size(0),), max_length, device=completion_ids.device)  # [B]
    return torch.minimum(first_stop_index(completion_ids, stop_ids) + 1, cap)  # [B]; first stop index C if none


def extract_completions(sequences: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """I3: the completion is everything after the padded prompt width ``P``.

    >>> seq = torch.tensor([[0, 0, 11, 12, 21, 2], [13, 14, 15, 16, 22, 23]])  # pad=0, left-padded prompts
    >>> extract_completions(seq, prompt_width=4).tolist()
    [[21, 2], [22, 23]]
    """
    return sequences[:, prompt_width:]  # [B, C]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as ``generate`` builds them for a left-padded batch: ``cumsum(mask) - 1``.

    Padding positions get 0 (they are masked out of attention and of the loss anyway).

    >>> position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])).tolist()
    [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]


def unpad(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's ids where ``mask`` is on, as lists: a padded batch [B, L] back to its rows.

    >>> unpad(torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]]))
    [[5, 6], [7, 8, 9]]
    """
    return [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]


def pad_sequences(seqs: list[list[int]], pad_id: int, side: str = "right",
                  device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both [B, L], padded on ``side``.

    >>> ids, mask = pad_sequences([[5, 6], [7]], pad_id=0, side="left")
    >>> ids.tolist(), mask.tolist()
    ([[5, 6], [0, 7]], [[1, 1], [0, 1]])
    """
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        span = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, span] = torch.tensor(s, dtype=torch.long)
        mask[i, span] = 1
    return ids.to(device), mask.to(device)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 of each row, whatever the padding side; [B, L] -> [B].

    >>> last_token_index(torch.tensor([[0, 1, 1], [1, 1, 0], [1, 1, 1]])).tolist()
    [2, 1, 2]
    """
    positions = torch.arange(attention_mask.size(1), device=attention_mask.device)  # [L]
    last = torch.where(attention_mask.bool(), positions, -1).max(dim=-1).values  # [B]
    if (last < 0).any():
        raise ValueError("a row of the attention mask is all zeros: there is no token to score")
    return last


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The mean of ``x`` over the positions where ``mask`` is 1, along ``dim`` (all positions when None); an
    empty mask gives 0 (the sum over nothing, over at least 1). ``x``, ``mask``: the same shape, e.g. [B, C].

    >>> x, m = torch.tensor([[1.0, 3.0, 9.0], [2.0, 5.0, 7.0]]), torch.tensor([[1, 1, 0], [0, 0, 0]])
    >>> masked_mean(x, m, dim=-1).tolist(), masked_mean(x, m).item()
    ([2.0, 0.0], 2.0)
    """
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim, keepdim=keepdim) / mask.sum(dim, keepdim=keepdim).clamp(min=1.0)
