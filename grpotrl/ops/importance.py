"""The raw importance ratio between the trainer's and the sampler's logprobs, as statistics: pure
functions of tensors (no host sync until ``sampler_gap_metrics`` and ``sampler_causes_metrics``), logged
by ``GRPOTrainer`` next to TRL's truncated ratio wherever the sampler's own logprobs exist.

Letters: B rows, C completion width, K = ``len(RATIO_STATS)``.
"""

from __future__ import annotations

import math

import torch

# the largest log-ratio a ratio statistic is taken at: e^80 ~ 5.5e34 is finite in fp32, e^89 is not (a ratio that
# overflowed to inf would be left out of the logged mean and max, on one process or on all)
MAX_LOG_RATIO = 80.0

RATIO_STATS = ("token/mean", "token/min", "token/max", "token/outside_share",
               "seq/mean", "seq/min", "seq/max", "seq/outside_share", "abs_gap/mean")
# what ``sampler_gap_local`` measures, each logged as ``sampling/<column>``
GAP_COLUMNS = ("sampler_trainer_logp_gap/mean", "sampler_trainer_logp_gap/max",
               *(f"raw_ratio/{name}" for name in RATIO_STATS))


def _summary(x: torch.Tensor, keep: torch.Tensor, total: torch.Tensor, low: float,
             high: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(values, counts): mean, min, max of ``x`` where ``keep`` (NaN where nothing is kept) and the share of
    ``total`` entries outside [low, high] (a ``total`` entry not kept counts as outside); then the number of
    entries each value is over (kept, kept, kept, ``total``). 0-d tensors."""
    n = keep.sum()
    nan = torch.tensor(math.nan, device=x.device)
    mean = torch.where(keep, x, 0.0).sum() / n
    edge = x.new_full((1,), math.inf)  # an empty batch still reduces
    lo = torch.where(n > 0, torch.cat([torch.where(keep, x, math.inf).flatten(), edge]).amin(), nan)
    hi = torch.where(n > 0, torch.cat([torch.where(keep, x, -math.inf).flatten(), -edge]).amax(), nan)
    inside = (keep & (x >= low) & (x <= high)).sum()
    return [mean, lo, hi, (total - inside) / total.clamp(min=1)], [n, n, n, total]


def _ratio_columns(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                   low: float, high: float) -> torch.Tensor:
    """[2, K]: ``raw_ratio_stats``' values, then the number of tokens (or rows, for seq/*) each is over."""
    on = mask.bool()  # [B, C]
    log_ratio = trainer_logps.detach().float() - sampler_logps.detach().float()  # [B, C]
    finite = on & torch.isfinite(log_ratio)  # [B, C]
    safe = torch.where(finite, log_ratio, 0.0)  # [B, C]
    seq_rows = on.any(1) & (finite.sum(1) == on.sum(1))  # [B] rows whose every token is finite
    seq = safe.sum(1).clamp(max=MAX_LOG_RATIO).exp()  # [B]
    n_gap = finite.sum()
    token, token_n = _summary(safe.clamp(max=MAX_LOG_RATIO).exp(), finite, on.sum(), low, high)
    rows, rows_n = _summary(seq, seq_rows, on.any(1).sum(), low, high)
    return torch.stack([torch.stack([*token, *rows, safe.abs().sum() / n_gap]).float(),
                        torch.stack([*token_n, *rows_n, n_gap]).float()])


def raw_ratio_tensor(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                     low: float = 0.5, high: float = 2.0) -> torch.Tensor:
    """``raw_ratio_stats`` as one tensor [len(RATIO_STATS)] on the logprobs' device: masked
    reductions only, no host sync."""
    return _ratio_columns(trainer_logps, sampler_logps, mask, low, high)[0]


def raw_ratio_stats(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                    low: float = 0.5, high: float = 2.0) -> dict[str, float]:
    """The raw, untruncated importance ratio ``exp(logp_trainer - logp_sampler)`` per token and per
    sequence (``exp`` of the summed log-ratio over the sequence's tokens), and the mean absolute
    logprob gap, over ``mask`` [B, C]. Non-finite sampler values (a token the sampler gave -inf)
    count as out of range and are left out of the means. A log-ratio above ``MAX_LOG_RATIO`` (80) is
    taken at 80, token and sequence alike, so that a ratio too large for fp32 still reaches the logged
    mean and max (at e^80) instead of overflowing to inf, which the logs leave out.

    >>> s = raw_ratio_stats(torch.tensor([[0.0, math.log(4)]]), torch.zeros(1, 2), torch.ones(1, 2))
    >>> s["token/mean"], s["token/max"], s["token/outside_share"], round(s["seq/mean"], 6), round(s["abs_gap/mean"], 6)
    (2.5, 4.0, 0.5, 4.0, 0.693147)
    """
    return dict(zip(RATIO_STATS, raw_ratio_tensor(trainer_logps, sampler_logps, mask, low, high).tolist()))


def sampler_gap_local(used: torch.Tensor, trainer: torch.Tensor, sampler: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """This process's sampler/trainer statistics on the loss's tokens, one tensor [2 * len(GAP_COLUMNS)] to
    gather (no host sync): the values of ``GAP_COLUMNS``, then the number of tokens (rows, for seq/*) each
    value is over. The values: mean and max of ``|used - sampler|`` over ``mask``'s finite entries (NaN where
    none), then ``raw_ratio_tensor(trainer, sampler, mask)``. ``sampler_gap_metrics`` weights each process's
    means by these counts. used, trainer, sampler, mask: [B, C]."""
    on = mask.bool()  # [B, C]
    gap = (used.detach().float() - sampler.detach().float()).abs()  # [B, C]
    (mean, _, worst, _), (n, *_) = _summary(gap, on & torch.isfinite(gap), on.sum(), 0.0, math.inf)
    ratio = _ratio_columns(trainer, sampler, mask, 0.5, 2.0)  # [2, K]
    return torch.cat([torch.stack([mean, worst]).float(), ratio[0], torch.stack([n, n]).float(), ratio[1]])


def _across(stats: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """Every process's (values, counts) [world, 2, N], float64 (a capped ratio e^80 times a token count passes
    fp32's range), as one [2, N]: per column the min (``pick`` 0), max (1) or count-weighted mean (2) over the
    processes whose count is > 0 and value finite, then the count those hold together (0: the column is
    measured nowhere; its value is then meaningless)."""
    values, counts = stats.unbind(1)  # [world, N] each
    ok = (counts > 0) & torch.isfinite(values)  # [world, N]
    n = torch.where(ok, counts, 0.0).sum(0)  # [N]
    mean = torch.where(ok, values * counts, 0.0).sum(0) / n.clamp(min=1)  # [N]
    lo, hi = torch.where(ok, values, math.inf).amin(0), torch.where(ok, values, -math.inf).amax(0)  # [N]
    return torch.stack([torch.stack([lo, hi, mean]).gather(0, pick.unsqueeze(0)).squeeze(0), n])


def sampler_gap_metrics(stats: torch.Tensor) -> tuple[dict[str, float], int]:
    """The logged values from every process's ``sampler_gap_local`` [world, 2 * len(GAP_COLUMNS)], and the
    loss tokens of every process together. Each column over every process's tokens: a mean is the token
    mean (seq/*: the row mean) over all of them, each process weighted by its count, so a process with no
    loss token contributes nothing; a min or max is over the processes with a value. A column measured on
    no process is left out (``sampling/sampler_trainer_logp_gap/mean`` too: no loss token anywhere, or no
    finite gap on any); ``sampling/sampler_trainer_logp_gap/unmeasured_tokens`` counts the loss tokens whose gap
    is not finite (logged where there is a loss token). One host sync.

    >>> three = sampler_gap_local(torch.zeros(1, 3), torch.zeros(1, 3), -torch.ones(1, 3), torch.ones(1, 3))
    >>> one = sampler_gap_local(torch.zeros(1, 3), torch.zeros(1, 3), torch.full((1, 3), -3.0), torch.eye(3)[:1])
    >>> m, tokens = sampler_gap_metrics(torch.stack([three, one]))  # (3 * 1.0 + 1 * 3.0) / 4
    >>> m["sampling/sampler_trainer_logp_gap/mean"], m["sampling/sampler_trainer_logp_gap/max"], tokens
    (1.5, 3.0, 4)
    """
    N = len(GAP_COLUMNS)
    per = stats.detach().cpu().double().view(-1, 2, N)  # [world, 2, N]: the one host sync
    pick = torch.tensor([0 if name.endswith("/min") else 1 if name.endswith("/max") else 2 for name in GAP_COLUMNS])
    values, counts = _across(per, pick).tolist()
    tokens = per[:, 1, GAP_COLUMNS.index("raw_ratio/token/outside_share")].sum()  # every process's mask.sum()
    out = {f"sampling/{name}": v for name, v, n in zip(GAP_COLUMNS, values, counts) if n}
    if tokens:  # loss tokens whose gap is not finite (a logprob of -inf or NaN): the gate cannot measure them
        out["sampling/sampler_trainer_logp_gap/unmeasured_tokens"] = float(tokens - counts[0])
    return out, int(tokens)


CAUSES = ("kept_mass", "truncation_gap", "processor_gap", "forward_gap", "stale_gap")


def _masked_mean(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean of ``x`` over ``keep`` & finite, NaN where nothing is kept; the number of entries it is over),
    0-d float32."""
    keep = keep & torch.isfinite(x)
    n = keep.sum()
    return (torch.where(keep, x, 0.0).sum() / n).float(), n.float()


def sampler_causes_local(used: torch.Tensor, old: torch.Tensor | None, untruncated: torch.Tensor, raw: torch.Tensor,
                         log_kept_mass: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What a sampler/trainer gap is made of, measured per token on this process's loss tokens ``mask``,
    as one tensor [2 * len(CAUSES)] (no host sync): the means of ``CAUSES``, then the number of tokens each
    is over (``sampler_causes_metrics`` weights the processes by them). The means: the kept mass
    ``exp(log_kept_mass)`` of the truncation warpers, then mean absolute differences in nats:

    * truncation: ``|log_kept_mass|``, what the sampler's truncated logprob lacks of the full softmax;
    * processors: ``|untruncated - raw|``, every processor but temperature and truncation (penalties,
      sequence bias, a processor of the user's);
    * forward: ``|trainer at the sampling weights - raw|``, the same weights scored by the loss's forward
      and by generate's (dtype, kernels, position ids; a temperature difference too, ``raw`` being at the
      sampler's T); the trainer side is ``old`` where it exists, else ``used``;
    * stale: ``|used - old|``, how far the weights moved since sampling (NaN over 0 tokens without ``old``).

    used, old: the loss's and the old policy's logprobs; untruncated: the sampler's under the full softmax
    of its processed scores; raw: ``log_softmax(model logits / T_sampler)[token]``; all [B, C].

    >>> z, one = torch.zeros(1, 2), torch.ones(1, 2)
    >>> c = sampler_causes_local(z, None, z, z, torch.tensor([[math.log(0.5), 0.0]]), one)
    >>> [round(v, 4) for v in c[:4].tolist()], math.isnan(c[4]), c[5:].tolist()  # (0.5 + 1) / 2; |log 0.5| / 2
    ([0.75, 0.3466, 0.0, 0.0], True, [2.0, 2.0, 2.0, 2.0, 0.0])
    """
    on = mask.bool()  # [B, C]
    now = used.detach().float()  # [B, C]
    at_sampling = now if old is None else old.detach().float()  # [B, C]
    stale = _masked_mean((now - at_sampling).abs(), on if old is not None else torch.zeros_like(on))
    means, counts = zip(_masked_mean(log_kept_mass.float().exp(), on), _masked_mean(log_kept_mass.float().abs(), on),
                        _masked_mean((untruncated.float() - raw.float()).abs(), on),
                        _masked_mean((at_sampling - raw.float()).abs(), on), stale)
    return torch.stack([*means, *counts])


def sampler_causes_metrics(stats: torch.Tensor) -> dict[str, float]:
    """Every process's ``sampler_causes_local`` [world, 2 * len(CAUSES)] as cause -> its token mean over every
    process's loss tokens (each process weighted by its token count: one with no loss token, or not measured,
    counts 0); a cause measured on no token is left out. One host sync.

    >>> z, one = torch.zeros(1, 3), torch.ones(1, 3)
    >>> three = sampler_causes_local(z, None, z, z, z, one)  # kept mass 1 on 3 tokens
    >>> half = sampler_causes_local(z, None, z, z, torch.full((1, 3), math.log(0.5)), torch.eye(3)[:1])
    >>> round(sampler_causes_metrics(torch.stack([three, half]))["kept_mass"], 6)  # (3 * 1 + 1 * 0.5) / 4
    0.875
    """
    per = stats.detach().cpu().double().view(-1, 2, len(CAUSES))  # [world, 2, len(CAUSES)]: the one host sync
    values, counts = _across(per, torch.full((len(CAUSES),), 2)).tolist()  # every column a mean
    return {name: v for name, v, n in zip(CAUSES, values, counts) if n}
