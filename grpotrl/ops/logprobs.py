"""Temperature-scaled per-token logprobs and entropy: pure tensor functions.

Letters: B rows, L = P + C sequence length, C completion width, V vocabulary.

INVARIANT I5: the logprob of completion token ``t`` is ``log_softmax(logits / T)[token]``
taken from the logit at input position ``P + t - 1``, with ``T`` the sampling temperature.
This module is the independent recomputation the guards compare TRL's fused head against.
"""

from __future__ import annotations

import torch


CHUNK_ELEMENTS = 1 << 24  # fp32 elements of one chunk's [b, C, V] temporary: 64 MiB


def row_chunks(logits: torch.Tensor) -> list[slice]:
    """Row slices of ``logits`` [B, C, V] with at most ``CHUNK_ELEMENTS`` elements each (one row where a
    row alone is larger). The functions below that take [B, C, V] logits work one chunk at a time, so a
    call holds a few [b, C, V] fp32 temporaries instead of several [B, C, V] ones (at 8 rows x 256
    tokens x 49152 each is 386 MiB); rows are independent, so the
    values are those of one whole-batch call.

    >>> row_chunks(torch.empty(5, 1 << 11, 1 << 12, device="meta"))  # two rows of 2^23 per chunk
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    B, C, V = logits.shape
    step = max(1, CHUNK_ELEMENTS // max(1, C * V))
    return [slice(start, min(start + step, B)) for start in range(0, B, step)]


def _joined(pieces: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    """The per-chunk [b, C] results as one [B, C] (fp32 zeros [0, C] for no rows)."""
    return torch.cat(pieces) if pieces else logits.new_zeros(logits.shape[:2], dtype=torch.float32)


def completion_logits(logits: torch.Tensor, completion_width: int) -> torch.Tensor:
    """The logits that score completion tokens: positions ``P-1 .. L-2`` (I4's shift by one)."""
    return logits[:, -completion_width - 1 : -1, :]  # [B, C, V]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` gathered at ``tokens`` [B, C], in fp32 (rows in ``row_chunks``).

    >>> logits = torch.tensor([[[2.0, 0.0]]])  # one row, one token, V=2
    >>> round(token_logprobs(logits, torch.tensor([[0]]), temperature=2.0).item(), 6)  # log(e/(e+1))
    -0.313262
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score sampled tokens, got {temperature}")
    out = []
    for rows in row_chunks(logits):
        logps = torch.log_softmax(logits[rows].float() / temperature, dim=-1)  # [b, C, V]
        out.append(logps.gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1))  # [b, C]
    return _joined(out, logits)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / T)`` per position [B, C], in fp32 (rows in ``row_chunks``).

    >>> round(entropy_from_logits(torch.zeros(1, 1, 4)).item(), 6)  # uniform over 4: log 4
    1.386294
    """
    out = []
    for rows in row_chunks(logits):
        logps = torch.log_softmax(logits[rows].float() / temperature, dim=-1)  # [b, C, V]
        out.append(-(logps.exp() * logps).sum(-1))  # [b, C]
    return _joined(out, logits)


def logit_scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``max |logits / T|`` per position [B, C], in fp32 (rows in ``row_chunks``): the size that fp32
    rounding of a logprob grows with.

    >>> logit_scale(torch.tensor([[[3.0, -5.0]]]), 2.0).item()
    2.5
    """
    return _joined([logits[rows].float().abs().amax(-1) / temperature for rows in row_chunks(logits)], logits)


def temperature_slope(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``d log_softmax(s * logits)[token] / d s`` at ``s = 1 / T``: ``z_token - E_{softmax(z / T)}[z]``, in fp32.

    A logprob scored at another temperature ``T'`` differs from the one at ``T`` by about
    ``(1 / T' - 1 / T) * slope`` per token, whatever the logits: the direction along which a
    temperature error moves every token (``fit_along``). ``logits`` [B, C, V], ``tokens``
    [B, C] -> [B, C]; rows in ``row_chunks``.

    >>> z = torch.tensor([[[2.0, 0.0]]])  # E[z] under softmax([2, 0]) = 2 sigmoid(2) = 1.761594
    >>> round(temperature_slope(z, torch.tensor([[0]]), 1.0).item(), 6)  # 2 - 1.761594
    0.238406
    """
    out = []
    for rows in row_chunks(logits):
        z = logits[rows].float()  # [b, C, V]
        p = torch.softmax(z / temperature, dim=-1)  # [b, C, V]
        mean = (p * z).sum(-1)  # [b, C]
        out.append(z.gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1) - mean)
    return _joined(out, logits)


def fit_along(gap: torch.Tensor, direction: torch.Tensor, mask: torch.Tensor, noise: float = 0.0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Least-squares fit of ``gap ~ coef * direction`` over ``mask`` (all [B, C]). With ``gap`` the
    logprobs under test minus the reference at ``1 / T`` and ``direction`` the ``temperature_slope`` there,
    ``coef`` is how far their inverse temperature is from ``1 / T``; with ``gap = H_used - H_ref`` and
    ``direction = H_ref``, how far ``H_used`` is from a rescaled ``H_ref``. Returns ``coef``, its standard
    error (from the residual's spread, at least ``noise``: the per-token noise known to be there, which a
    fit over a few tokens, one token leaving no residual at all, cannot measure) and the residual
    ``gap - coef * direction`` [B, C] (0 off the mask), all fp32.

    >>> direction = torch.tensor([[1.0, -2.0, 3.0]])
    >>> coef, se, residual = fit_along(-0.1 * direction, direction, torch.ones(1, 3))
    >>> round(coef.item(), 6), round(se.item(), 6), round(residual.abs().max().item(), 6)
    (-0.1, 0.0, 0.0)
    >>> coef, se, _ = fit_along(torch.tensor([[0.01]]), torch.tensor([[0.001]]), torch.ones(1, 1), noise=0.02)
    >>> round(coef.item(), 3), round(se.item(), 3)  # one token: 0.01 nats of noise is no evidence of coef 10
    (10.0, 20.0)
    """
    on = mask.bool()  # [B, C]
    g = torch.where(on, gap.float(), 0.0)  # [B, C]
    f = torch.where(on, direction.float(), 0.0)  # [B, C]
    n = on.sum()
    tiny = torch.finfo(torch.float32).tiny
    power = (f * f).sum()
    coef = (g * f).sum() / power.clamp(min=tiny)
    residual = torch.where(on, g - coef * f, 0.0)  # [B, C]
    spread = ((residual * residual).sum() / (n - 1).clamp(min=1)).sqrt().clamp(min=noise)
    return coef, spread / power.sqrt().clamp(min=tiny), residual
