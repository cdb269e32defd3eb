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
