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
    """sampler_gap_local reduces with masks on the device (no host sync), each value with the number of tokens
    it is over; sampler_gap_metrics combines the processes' rows with one: a process with no loss token (its
    means NaN over 0 tokens) contributes nothing to any mean or share."""
    torch.manual_seed(0)
    used, trainer, sampler = (torch.randn(3, 5) - 2 for _ in range(3))
    sampler[0, 1] = -math.inf  # the sampler could not have drawn it: out of every mean
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    local = importance.sampler_gap_local(used, trainer, sampler, mask)
    gap = (used - sampler).abs()[mask.bool()]
    gap = gap[torch.isfinite(gap)]  # 7 finite tokens
    raw = importance.raw_ratio_stats(trainer, sampler, mask)
    K = len(importance.RATIO_STATS)
    assert local[:2].tolist() == pytest.approx([gap.mean().item(), gap.max().item()])
    assert local[2:2 + K].tolist() == pytest.approx(list(raw.values()))
    # counts: 7 finite gaps (mean, max); token/*: 7 finite, 8 loss tokens for the share; seq/*: row 1 only
    # (row 0 holds the -inf), 2 rows with a token for the share; abs_gap/mean: 7 finite
    assert local[2 + K:].tolist() == [7, 7, 7, 7, 7, 8, 1, 1, 1, 2, 7]
    empty = importance.sampler_gap_local(used, trainer, sampler, torch.zeros_like(mask))
    assert math.isnan(empty[0]) and math.isnan(empty[2]) and not empty[2 + K:].any()  # NaN over 0 tokens
    m, tokens = importance.sampler_gap_metrics(torch.stack([local, empty]))  # [world=2, 22]
    assert tokens == 8
    assert m["sampling/sampler_trainer_logp_gap/mean"] == pytest.approx(gap.mean().item())
    assert m["sampling/sampler_trainer_logp_gap/max"] == pytest.approx(gap.max().item())
    for name, value in raw.items():  # the empty process changes none of them
        assert m[f"sampling/raw_ratio/{name}"] == pytest.approx(value), name


def test_I5_sampler_gap_is_the_token_mean_over_every_processs_loss_tokens():
    """The gap the sampler-gap gate reads, by hand: process 0 holds 3 loss tokens at gap 1.0, process 1 one
    token at gap 3.0, process 2 none. The token mean is (3 * 1.0 + 1 * 3.0) / 4 = 1.5 (a mean of the
    processes' means would be (1.0 + 3.0) / 2 = 2.0, or (1.0 + 3.0 + 0) / 3 = 1.33 counting the empty one
    as 0); the max is 3.0. The raw ratios alike (trainer 0, sampler -1 or -3): token ratios e (x3) and e^3,
    token/mean (3e + e^3) / 4, all four above 2 (outside share 1); process 0's row e^3, process 1's e^3."""
    z = torch.zeros(1, 3)
    three = importance.sampler_gap_local(z, z, -torch.ones(1, 3), torch.ones(1, 3))
    one = importance.sampler_gap_local(z, z, torch.full((1, 3), -3.0), torch.tensor([[1, 0, 0]]))
    none = importance.sampler_gap_local(z, z, torch.full((1, 3), -9.0), torch.zeros(1, 3))
    m, tokens = importance.sampler_gap_metrics(torch.stack([three, one, none]))
    assert tokens == 4
    assert m["sampling/sampler_trainer_logp_gap/mean"] == pytest.approx(1.5)
    assert m["sampling/sampler_trainer_logp_gap/max"] == pytest.approx(3.0)
    e = math.exp(1.0)
    assert m["sampling/raw_ratio/token/mean"] == pytest.approx((3 * e + e ** 3) / 4)
    assert m["sampling/raw_ratio/abs_gap/mean"] == pytest.approx(1.5)
    assert m["sampling/raw_ratio/token/outside_share"] == 1.0  # e and e^3 are both above 2
    assert m["sampling/raw_ratio/seq/mean"] == pytest.approx(e ** 3)  # two rows, both e^3
    assert (m["sampling/raw_ratio/token/min"], m["sampling/raw_ratio/token/max"]) == pytest.approx((e, e ** 3))


def test_I5_a_mixed_batch_split_across_processes_logs_what_one_process_would():
    """Each logged statistic over the processes' rows equals the same statistic of all their tokens on one
    process: rows of 5, 2 and 0 loss tokens (one holding a sampler -inf, out of the means) split 2 + 1 + 0."""
    torch.manual_seed(1)
    used, trainer, sampler = (torch.randn(3, 5) - 2 for _ in range(3))
    sampler[1, 0] = -math.inf
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    whole, _ = importance.sampler_gap_metrics(importance.sampler_gap_local(used, trainer, sampler, mask)[None])
    parts = [importance.sampler_gap_local(used[rows], trainer[rows], sampler[rows], mask[rows])
             for rows in (slice(0, 2), slice(2, 3), slice(0, 0))]
    split, tokens = importance.sampler_gap_metrics(torch.stack(parts))
    assert tokens == 7 and split.keys() == whole.keys()
    assert split == pytest.approx(whole)


def test_no_loss_token_anywhere_leaves_every_statistic_out():
    """Every process without a loss token: no gap, no ratio is measured, so none is logged (TRL would log
    0 for a token mean over no token) and the gate learns there were 0 loss tokens (guards/identity.py).
    Loss tokens whose gap is not finite on any (the sampler gave each -inf): the gap's mean is left out too,
    but the gate learns there were 2, so it trips on the missing value rather than pass."""
    z = torch.zeros(2, 3)
    m, tokens = importance.sampler_gap_metrics(torch.stack([importance.sampler_gap_local(z, z, z, z)] * 2))
    assert (m, tokens) == ({}, 0)
    drawn_at_minus_inf = importance.sampler_gap_local(z, z, torch.full((2, 3), -math.inf), torch.eye(2, 3))
    m, tokens = importance.sampler_gap_metrics(drawn_at_minus_inf[None])
    assert tokens == 2 and "sampling/sampler_trainer_logp_gap/mean" not in m
    assert m == {"sampling/raw_ratio/token/outside_share": 1.0, "sampling/raw_ratio/seq/outside_share": 1.0,
                 "sampling/sampler_trainer_logp_gap/unmeasured_tokens": 2.0}


def test_I5_sampler_gap_causes_are_token_means_over_every_processs_loss_tokens():
    """The causes the gate names, by hand: kept mass 1.0 on process 0's 3 tokens, 0.5 on process 1's one
    token: (3 * 1.0 + 1 * 0.5) / 4 = 0.875 (a mean of means would be 0.75); truncation |log 0.5| / 4.
    A process with no loss token, or where nothing was measured (counts 0), changes nothing; the stale
    gap, NaN without old logprobs, is measured on no token and left out."""
    z, one = torch.zeros(1, 3), torch.ones(1, 3)
    three = importance.sampler_causes_local(z, None, z, z, z, one)
    half = importance.sampler_causes_local(z, None, z, z, torch.full((1, 3), math.log(0.5)), torch.tensor([[1, 0, 0]]))
    empty = importance.sampler_causes_local(z, None, z, z, torch.full((1, 3), -5.0), torch.zeros(1, 3))
    unmeasured = torch.zeros(2 * len(importance.CAUSES))
    found = importance.sampler_causes_metrics(torch.stack([three, half, empty, unmeasured]))
    assert found.keys() == {"kept_mass", "truncation_gap", "processor_gap", "forward_gap"}
    assert found["kept_mass"] == pytest.approx(0.875)
    assert found["truncation_gap"] == pytest.approx(math.log(2) / 4)
    assert found["processor_gap"] == 0.0 and found["forward_gap"] == 0.0
    stale = importance.sampler_causes_local(one, z, z, z, z, one)  # |used - old| = 1 on 3 tokens
    assert importance.sampler_causes_metrics(stale[None])["stale_gap"] == pytest.approx(1.0)
    assert importance.sampler_causes_metrics(torch.stack([unmeasured] * 2)) == {}


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
    m, _ = importance.sampler_gap_metrics(torch.stack([importance.sampler_gap_local(trainer, trainer, sampler, mask),
                                                       calm]))  # [world=2, 22]
    assert m["sampling/raw_ratio/token/max"] == pytest.approx(cap, rel=1e-6)  # this process's, not the calm one's
    assert m["sampling/raw_ratio/token/mean"] == pytest.approx(((cap + 1) / 2 + math.exp(0.1)) / 2, rel=1e-6)
