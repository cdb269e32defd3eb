"""ops.importance by hand: the raw (untruncated) importance ratios and the sampler/trainer gap statistics
that the sampler-gap gate (guards/identity.py) reads, reduced on each process and combined across them."""

import math

import pytest
import torch

from grpotrl.ops import importance


def test_raw_ratio_stats_by_hand():
    trainer = torch.tensor([[math.log(2), math.log(3), 0.0], [0.0, math.log(0.25), 0.0]])
    sampler = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    s = importance.raw_ratio_stats(trainer, sampler, mask)
    assert s["token/mean"] == pytest.approx((2 + 3 + 1 + 0.25 + 1) / 5)
    assert (s["token/min"], s["token/max"]) == pytest.approx((0.25, 3.0))
    assert s["token/outside_share"] == pytest.approx(2 / 5)  # 3 and 0.25 are outside [0.5, 2]
    assert (s["seq/min"], s["seq/max"]) == pytest.approx((0.25, 6.0))  # the products 2*3 and 1*0.25*1
    assert s["seq/outside_share"] == 1.0
    assert s["abs_gap/mean"] == pytest.approx((math.log(2) + math.log(3) + math.log(4)) / 5)
    sampler[0, 0] = -math.inf  # the sampler could not have drawn this token: out of range, not averaged
    s = importance.raw_ratio_stats(trainer, sampler, mask)
    assert s["token/outside_share"] == pytest.approx(3 / 5) and s["seq/max"] == pytest.approx(0.25)


def test_sampler_gap_stats_in_one_pass_across_processes():
    """sampler_gap_local reduces with masks on the device (no host sync); sampler_gap_metrics combines
    the processes' rows with one: |used - sampler| mean of means and max of maxes, each ratio statistic
    over the processes where it is finite (a process with no loss token has none)."""
    torch.manual_seed(0)
    used, trainer, sampler = (torch.randn(3, 5) - 2 for _ in range(3))
    sampler[0, 1] = -math.inf  # the sampler could not have drawn it: out of every mean
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    local = importance.sampler_gap_local(used, trainer, sampler, mask)
    gap = (used - sampler).abs()[mask.bool()]
    gap = gap[torch.isfinite(gap)]  # 7 finite tokens
    raw = importance.raw_ratio_stats(trainer, sampler, mask)
    assert local[:2].tolist() == pytest.approx([gap.mean().item(), gap.max().item()])
    assert local[2:].tolist() == pytest.approx(list(raw.values()))
    empty = importance.sampler_gap_local(used, trainer, sampler, torch.zeros_like(mask))
    assert empty[:2].tolist() == [0.0, 0.0] and math.isnan(empty[2])  # token/mean: no token
    m = importance.sampler_gap_metrics(torch.stack([local, empty]))  # [world=2, 11]
    assert m["sampling/sampler_trainer_logp_gap/mean"] == pytest.approx(gap.mean().item() / 2)
    assert m["sampling/sampler_trainer_logp_gap/max"] == pytest.approx(gap.max().item())
    assert m["sampling/raw_ratio/token/min"] == pytest.approx(raw["token/min"])
    assert m["sampling/raw_ratio/seq/max"] == pytest.approx(raw["seq/max"])
    assert m["sampling/raw_ratio/token/outside_share"] == pytest.approx(raw["token/outside_share"] / 2)


def test_a_ratio_too_large_for_fp32_is_logged_at_the_cap_not_left_out():
    """A sampler logprob of -100 on a token the trainer gives logprob 0: the token ratio e^100 overflows fp32 to
    inf, and an inf statistic is left out of the logged metrics (one process: not logged at all; several: the
    max of the others' finite maxes, smaller than this one's). Token and sequence ratios are both taken at
    log-ratio MAX_LOG_RATIO (80): token/max = seq/max = e^80, token/mean = (e^80 + 1) / 2."""
    trainer, sampler, mask = torch.zeros(1, 2), torch.tensor([[-100.0, 0.0]]), torch.ones(1, 2)
    s = importance.raw_ratio_stats(trainer, sampler, mask)
    cap = math.exp(80.0)  # importance.MAX_LOG_RATIO
    assert s["token/max"] == pytest.approx(cap, rel=1e-6) and s["seq/max"] == pytest.approx(cap, rel=1e-6)
    assert s["token/mean"] == pytest.approx((cap + 1) / 2, rel=1e-6)
    calm = importance.sampler_gap_local(trainer, trainer, torch.full((1, 2), -0.1), mask)  # ratios e^0.1
    m = importance.sampler_gap_metrics(torch.stack([importance.sampler_gap_local(trainer, trainer, sampler, mask),
                                                    calm]))  # [world=2, 11]
    assert m["sampling/raw_ratio/token/max"] == pytest.approx(cap, rel=1e-6)  # this process's, not the calm one's
    assert m["sampling/raw_ratio/token/mean"] == pytest.approx(((cap + 1) / 2 + math.exp(0.1)) / 2, rel=1e-6)
