"""The raw importance ratio between the trainer's and the sampler's logprobs, as statistics: pure
functions of tensors (no host sync until ``sampler_gap_metrics``), logged by ``GRPOTrainer`` next to
TRL's truncated ratio wherever the sampler's own logprobs exist.

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


def _summary(x: torch.Tensor, keep: torch.Tensor, total: torch.Tensor, low: float, high: float) -> list[torch.Tensor]:
    """mean, min, max of ``x`` where ``keep`` (NaN where nothing is kept) and the share of ``total``
    entries outside [low, high] (a ``total`` entry not kept counts as outside). 0-d tensors."""
    n = keep.sum()
    nan = torch.tensor(math.nan, device=x.device)
    mean = torch.where(keep, x, 0.0).sum() / n
    edge = x.new_full((1,), math.inf)  # an empty batch still reduces
    lo = torch.where(n > 0, torch.cat([torch.where(keep, x, math.inf).flatten(), edge]).amin(), nan)
    hi = torch.where(n > 0, torch.cat([torch.where(keep, x, -math.inf).flatten(), -edge]).amax(), nan)
    inside = (keep & (x >= low) & (x <= high)).sum()
    return [mean, lo, hi, (total - inside) / total.clamp(min=1)]


def raw_ratio_tensor(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                     low: float = 0.5, high: float = 2.0) -> torch.Tensor:
    """``raw_ratio_stats`` as one tensor [len(RATIO_STATS)] on the logprobs' device: masked
    reductions only, no host sync."""
    on = mask.bool()  # [B, C]
    log_ratio = trainer_logps.detach().float() - sampler_logps.detach().float()  # [B, C]
    finite = on & torch.isfinite(log_ratio)  # [B, C]
    safe = torch.where(finite, log_ratio, 0.0)  # [B, C]
    seq_rows = on.any(1) & (finite.sum(1) == on.sum(1))  # [B] rows whose every token is finite
    seq = safe.sum(1).clamp(max=MAX_LOG_RATIO).exp()  # [B]
    n_gap = finite.sum()
    return torch.stack([*_summary(safe.clamp(max=MAX_LOG_RATIO).exp(), finite, on.sum(), low, high),
                        *_summary(seq, seq_rows, on.any(1).sum(), low, high),
                        safe.abs().sum() / n_gap]).float()


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
    """This process's sampler/trainer statistics on the loss's tokens, one tensor [2 + len(RATIO_STATS)]
    to gather (no host sync): mean and max of ``|used - sampler|`` over ``mask`` (finite entries; 0 when
    none), then ``raw_ratio_tensor(trainer, sampler, mask)``. used, trainer, sampler, mask: [B, C]."""
    gap = (used.detach().float() - sampler.detach().float()).abs()  # [B, C]
    keep = mask.bool() & torch.isfinite(gap)  # [B, C]
    n = keep.sum()
    mean = torch.where(n > 0, torch.where(keep, gap, 0.0).sum() / n.clamp(min=1), 0.0)
    worst = torch.where(keep, gap, 0.0).amax() if gap.numel() else gap.new_zeros(())
    return torch.cat([torch.stack([mean, worst]), raw_ratio_tensor(trainer, sampler, mask)])


def sampler_gap_metrics(stats: torch.Tensor) -> dict[str, float]:
    """The logged values from every process's ``sampler_gap_local`` [world, 2 + len(RATIO_STATS)]: the
    gap's mean of means and max of maxes; per ratio statistic the min, max or mean across processes
    of its finite entries (left out where none is finite). One host sync."""
    raw = stats[:, 2:]  # [world, K]
    ok = torch.isfinite(raw)  # [world, K]
    n = ok.sum(0)  # [K]
    values = torch.stack([torch.where(ok, raw, math.inf).amin(0), torch.where(ok, raw, -math.inf).amax(0),
                          torch.where(ok, raw, 0.0).sum(0) / n.clamp(min=1)])  # [3, K] min, max, mean
    pick = torch.tensor([0 if name.endswith("/min") else 1 if name.endswith("/max") else 2 for name in RATIO_STATS],
                        device=stats.device)
    row = torch.cat([stats[:, 0].mean().reshape(1), stats[:, 1].max().reshape(1),
                     values.gather(0, pick.unsqueeze(0)).squeeze(0), n.float()]).tolist()
    K = len(RATIO_STATS)
    out = {"sampling/sampler_trainer_logp_gap/mean": row[0], "sampling/sampler_trainer_logp_gap/max": row[1]}
    out.update({f"sampling/raw_ratio/{name}": v for name, v, c in zip(RATIO_STATS, row[2:2 + K], row[2 + K:]) if c})
    return out



CAUSES = ("kept_mass", "truncation_gap", "processor_gap", "forward_gap", "stale_gap")


def _masked_mean(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``keep`` & finite, 0-d float32; NaN where nothing is kept."""
    keep = keep & torch.isfinite(x)
    return (torch.where(keep, x, 0.0).sum() / keep.sum()).float()


def sampler_causes_local(used: torch.Tensor, old: torch.Tensor | None, untruncated: torch.Tensor, raw: torch.Tensor,
                         log_kept_mass: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What a sampler/trainer gap is made of, measured per token on this process's loss tokens ``mask``,
    as one tensor [len(CAUSES)] (no host sync): the mean kept mass ``exp(log_kept_mass)`` of the
    truncation warpers, then mean absolute differences in nats:

    * truncation: ``|log_kept_mass|``, what the sampler's truncated logprob lacks of the full softmax;
    * processors: ``|untruncated - raw|``, every processor but temperature and truncation (penalties,
      sequence bias, a processor of the user's);
    * forward: ``|trainer at the sampling weights - raw|``, the same weights scored by the loss's forward
      and by generate's (dtype, kernels, position ids; a temperature difference too, ``raw`` being at the
      sampler's T); the trainer side is ``old`` where it exists, else ``used``;
    * stale: ``|used - old|``, how far the weights moved since sampling (NaN without ``old``).

    used, old: the loss's and the old policy's logprobs; untruncated: the sampler's under the full softmax
    of its processed scores; raw: ``log_softmax(model logits / T_sampler)[token]``; all [B, C].

    >>> z, one = torch.zeros(1, 2), torch.ones(1, 2)
    >>> c = sampler_causes_local(z, None, z, z, torch.tensor([[math.log(0.5), 0.0]]), one)
    >>> [round(v, 4) for v in c.tolist()[:4]], math.isnan(c[4])  # kept mass (0.5 + 1) / 2; |log 0.5| / 2
    ([0.75, 0.3466, 0.0, 0.0], True)
    """
    on = mask.bool()  # [B, C]
    now = used.detach().float()  # [B, C]
    at_sampling = now if old is None else old.detach().float()  # [B, C]
    stale = _masked_mean((now - at_sampling).abs(), on) if old is not None else now.new_full((), math.nan)
    return torch.stack([_masked_mean(log_kept_mass.float().exp(), on), _masked_mean(log_kept_mass.float().abs(), on),
                        _masked_mean((untruncated.float() - raw.float()).abs(), on),
                        _masked_mean((at_sampling - raw.float()).abs(), on), stale])
