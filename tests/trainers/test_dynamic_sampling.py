"""DAPO dynamic sampling: the row bookkeeping by hand, then a tiny run where half the prompts
always get flat rewards: none of their rows reaches the loss, the batch is refilled, the
loss normaliser counts only kept tokens, and the I1-I5 guards (on every step) pass on the
merged batches."""

import pytest
import torch
from datasets import Dataset

import grpotrl
from grpotrl.trainers import dynamic_sampling as ds
from grpotrl.trainers.grpo import ROW_KEY


def test_keep_groups_first_come_up_to_the_target():
    # round 0: groups 0 and 2 flat -> keep group 1; round 1: keep 2 of its 3 non-flat groups (target 3)
    keeps = ds.keep_groups([torch.tensor([True, False, True]), torch.tensor([False, False, False])], 3)
    assert [k.tolist() for k in keeps] == [[False, True, False], [True, True, False]]


def test_rows_of_kept_groups_per_process():
    # 2 processes, G=2, 4 global groups -> 8 global rows, 4 per process; keep groups 1 and 2
    keep = torch.tensor([False, True, True, False])
    assert ds.local_rows(keep, 2, 0, 4).tolist() == [False, False, True, True]
    assert ds.local_rows(keep, 2, 1, 4).tolist() == [True, True, False, False]


def test_every_process_keeps_as_many_rows_in_whole_microbatches():
    # kept 3 rows here, 6 on another process, steps_per_generation=4: both keep 8 rows;
    # this process adds back 5 of its dropped rows (advantage 0)
    count = ds.common_count([3, 6], 4)
    assert count == 8
    kept = ds.fill_rows(torch.tensor([True, False, True, False, True] + [False] * 7), count)
    assert kept.tolist() == [True] * 8 + [False] * 4
    assert ds.common_count([0, 0], 1) == 1  # never an empty microbatch
    # more kept than the count (rows that cannot fill a whole microbatch): the last kept ones go
    assert ds.fill_rows(torch.tensor([True, False, True, True]), 2).tolist() == [True, False, True, False]


def test_concat_then_select_pads_each_side_correctly():
    a = {"prompt_ids": torch.tensor([[7, 8, 9]]), "prompt_mask": torch.ones(1, 3, dtype=torch.long),
         "completion_ids": torch.tensor([[5]]), "completion_mask": torch.ones(1, 1, dtype=torch.long),
         "advantages": torch.tensor([0.5]), ROW_KEY: torch.tensor([0]), "num_items_in_batch": torch.tensor(1)}
    b = {"prompt_ids": torch.tensor([[6]]), "prompt_mask": torch.ones(1, 1, dtype=torch.long),
         "completion_ids": torch.tensor([[4, 3]]), "completion_mask": torch.ones(1, 2, dtype=torch.long),
         "advantages": torch.tensor([-0.5]), ROW_KEY: torch.tensor([1]), "num_items_in_batch": torch.tensor(2)}
    out = ds.concat_rows([a, b], pad_token_id=2)
    assert out["prompt_ids"].tolist() == [[7, 8, 9], [2, 2, 6]]  # left padding
    assert out["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert out["completion_ids"].tolist() == [[5, 2], [4, 3]]  # right padding
    assert out["completion_mask"].tolist() == [[1, 0], [1, 1]]
    assert "num_items_in_batch" not in out  # global: the trainer recomputes it
    picked = ds.select_rows(out, torch.tensor([False, True]))
    assert picked["advantages"].tolist() == [-0.5] and picked[ROW_KEY].tolist() == [1]


class OneProcess:
    """What ``refill`` uses of ``accelerate.Accelerator`` on one process: gather returns its input."""
    num_processes, process_index, device = 1, 0, torch.device("cpu")

    @staticmethod
    def gather(t):
        return t


def scored(prompt_ids, completion_lens):
    """A scored generation batch of len(prompt_ids) rows, completion i ``completion_lens[i]`` tokens long (C=3)."""
    n = len(prompt_ids)
    cmask = torch.tensor([[1] * k + [0] * (3 - k) for k in completion_lens])  # [n, 3]
    return {"prompt_ids": torch.tensor(prompt_ids).view(n, 1), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
            "completion_ids": cmask * 9, "completion_mask": cmask, "advantages": torch.zeros(n),
            ROW_KEY: torch.arange(n)}


def test_refill_runs_rounds_through_the_callables_it_is_given():
    # G=2. First batch: group 0 (rows 0, 1) has advantages [0, 0] (flat), group 1 (rows 2, 3) [-0.7, 0.7]: 1 of 2
    # target groups has a gradient, so one round of 1 group (2 rows) is scored; its advantages [-0.7, 0.7] vary.
    first = scored([10, 10, 11, 11], [1, 1, 2, 3])
    calls, logged = [], []

    def score_round(rows):
        calls.append(rows)
        return scored([12, 12], [3, 1]), torch.tensor([-0.7, 0.7]), {"prompt": ["r0", "r1"]}

    data = [{"prompt": "p"}] * 5
    merged, record = ds.refill(first, torch.tensor([0.0, 0.0, -0.7, 0.7]), {"prompt": ["a", "b", "c", "d"]},
                               score_round=score_round, log=logged.append, accelerator=OneProcess(),
                               train_dataset=data, seed=0, step=0, num_generations=2, max_rounds=3,
                               steps_per_generation=2, pad_token_id=0, row_key=ROW_KEY)
    assert calls == [[{"prompt": "p"}] * 2]  # one round: 1 group x G=2 rows
    # kept: rows 2, 3 of the first batch and both rows of the round, tagged 4, 5 after the first batch's 0..3
    assert merged[ROW_KEY].tolist() == [2, 3, 4, 5]
    assert merged["prompt_ids"].flatten().tolist() == [11, 11, 12, 12]
    assert record == {"prompt": ["a", "b", "c", "d", "r0", "r1"]}  # record[tag] is each kept row's
    assert int(merged["num_items_in_batch"]) == 2 + 3 + 3 + 1  # the kept rows' completion tokens
    # 3 groups generated, 2 kept: dropped 1 - 2/3; target 2 groups filled: 2/2
    assert logged == [{"dynamic_sampling/dropped_share": 1 - 2 / 3, "dynamic_sampling/rounds": 1,
                       "dynamic_sampling/filled_share": 1.0}]


class TwoProcesses:
    """Two processes of ``refill`` in two threads: ``gather`` concatenates both processes' tensors."""
    num_processes, device = 2, torch.device("cpu")

    def __init__(self, process_index, barrier, slots):
        self.process_index, self.barrier, self.slots = process_index, barrier, slots

    def gather(self, t):
        self.slots[self.process_index] = t.reshape(-1)
        self.barrier.wait()
        out = torch.cat([self.slots[0], self.slots[1]])
        self.barrier.wait()  # both have read before either writes the next gather
        return out


def test_refilled_rows_split_into_whole_microbatches_on_every_process():
    """2 processes, G=2, steps_per_generation=4, 4 rows each. Round 0 (global advantages): process 0's two groups
    vary, process 1's two are flat, so 2 of 4 target groups are missing; one round of 2 groups (2 rows per
    process), both varying. Kept: 6 rows on process 0, 2 on process 1; each holds 6 rows in all. 8 (6 rounded up
    to a multiple of 4) is more than 6, and 6 rows would split into TRL's 4 microbatches of 6 // 4 = 1 row,
    2 rows never trained but counted in num_items_in_batch: each process keeps 4, in 4 microbatches of 1."""
    import threading

    from trl.trainer.utils import split_tensor_dict

    first = torch.tensor([-1.0, 1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # [B_global = 8]
    again = torch.tensor([-1.0, 1.0, -1.0, 1.0])  # the round's [B_global = 4]
    barrier, slots, merged = threading.Barrier(2, timeout=60), {}, {}

    def run(p):
        batch = scored([10 + p] * 4, [3] * 4) | {"advantages": first[4 * p:4 * p + 4]}
        merged[p], _ = ds.refill(
            batch, first, None, score_round=lambda rows: (scored([20 + p] * 2, [2] * 2) | {
                "advantages": again[2 * p:2 * p + 2]}, again, None),
            log=lambda m: None, accelerator=TwoProcesses(p, barrier, slots), train_dataset=[{"prompt": "p"}] * 4,
            seed=0, step=0, num_generations=2, max_rounds=1, steps_per_generation=4, pad_token_id=0, row_key=ROW_KEY)

    threads = [threading.Thread(target=run, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert merged[0]["advantages"].tolist() == [-1.0, 1.0, -1.0, 1.0]  # its first 4 kept rows
    assert merged[1]["advantages"].tolist() == [0.0, 0.0, -1.0, 1.0]  # 2 kept + 2 flat ones added back
    for m in merged.values():
        rows = {k: v for k, v in m.items() if k != "num_items_in_batch"}
        assert sum(c[ROW_KEY].numel() for c in split_tensor_dict(rows, 4)) == m[ROW_KEY].numel() == 4
    # the kept rows' tokens, both processes: 4 x 3 + 2 x 3 + 2 x 2
    assert int(merged[0]["num_items_in_batch"]) == int(merged[1]["num_items_in_batch"]) == 22


def flat_for_two(completions, prompts, **kwargs):
    """0 for every completion of "What is 2?" (a zero-variance group); the length otherwise."""
    return [0.0 if p[-1]["content"] == "What is 2?" else len(c[0]["content"]) / 10
            for c, p in zip(completions, prompts)]


class Observed(grpotrl.GRPOTrainer):
    def _compute_loss(self, model, inputs):
        tok = self._tokenizer
        texts = tok.batch_decode([ids[m.bool()] for ids, m in zip(inputs["prompt_ids"], inputs["prompt_mask"])])
        self.seen = getattr(self, "seen", []) + [(texts, int(inputs["completion_mask"].sum()),
                                                  int(inputs["num_items_in_batch"]))]
        return super()._compute_loss(model, inputs)


def test_dynamic_sampling_drops_flat_groups_and_refills(tiny_llama, grpo_args):
    # every other prompt is "What is 2?" (flat); the others "What is 1 + 2?", "What is 1 + 1 + 2?", ...
    rows = [{"prompt": [{"role": "user", "content": "What is " + "1 + " * (i % 4) + "2?"}]} for i in range(16)]
    rows = [r if i % 2 else {"prompt": [{"role": "user", "content": "What is 2?"}]} for i, r in enumerate(rows)]
    trainer = Observed(model=tiny_llama, reward_funcs=flat_for_two, train_dataset=Dataset.from_list(rows),
                       args=grpo_args(max_steps=2, dynamic_sampling=True, dynamic_sampling_max_rounds=6,
                                      max_completion_length=6))
    trainer.train()
    dropped = [h["dynamic_sampling/dropped_share"] for h in trainer.state.log_history
               if "dynamic_sampling/dropped_share" in h]
    assert len(dropped) == 2 and max(dropped) > 0, dropped
    for texts, tokens, normaliser in trainer.seen:
        assert not any("What is 2?<|im_end|>" in t for t in texts), "a flat group reached the loss"
        assert len(texts) == 8  # refilled to 2 groups x 4
        assert normaliser == tokens  # dapo's normaliser counts only the kept tokens


def trl_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, G: int, aggregation: str) -> torch.Tensor:
    """TRL 1.16's advantages (``_generate_and_score_completions``, ``scale_rewards='group'``), restated."""
    from trl.trainer.utils import nanstd

    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights).nansum(1)  # [B]
        grouped = rewards.view(-1, G)
        mean, std = grouped.mean(1).repeat_interleave(G), nanstd(grouped, dim=1).repeat_interleave(G)
        return (rewards - mean) / (std + 1e-4)
    grouped = rewards_per_func.view(-1, G, rewards_per_func.size(1))  # [N, G, K]
    z = (grouped - grouped.nanmean(1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    rewards = (z.view(-1, rewards_per_func.size(1)) * weights).nansum(1)  # [B]
    return (rewards - rewards.nanmean()) / (nanstd(rewards) + 1e-4)


def test_dynamic_sampling_decides_from_trls_advantages_under_either_aggregation():
    # G = 2, reward functions f1, f2 with weights (1, 2). Group 0: f1 = (2, 0), f2 = (0, 1): the weighted sums
    # are 2 + 0 = 2 and 0 + 2 = 2, equal. normalize_then_sum normalises each function in the group first:
    # f1 -> (+0.707, -0.707), f2 -> (-0.707, +0.707), sums 0.707 - 1.414 = -0.707 and +0.707: a gradient.
    # Group 1: f1 = (1, 0), f2 = (0, 0): sums 1 and 0 (a gradient either way), normalised +0.707, -0.707.
    # Group 2: both functions flat, 0 and 0. Over the batch (mean 0, std sqrt(4 * 0.5 / 5) = 0.632): -/+1.118.
    rewards = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [1.0, 3.0], [1.0, 3.0]])
    w = torch.tensor([1.0, 2.0])
    summed = trl_advantages(rewards, w, 2, "sum_then_normalize")
    normalised = trl_advantages(rewards, w, 2, "normalize_then_sum")
    assert normalised[:2].tolist() == pytest.approx([-1.118, 1.118], abs=1e-3)
    assert ds.flat_groups(summed, 2).tolist() == [True, False, True]
    assert ds.flat_groups(normalised, 2).tolist() == [False, False, True]


def length(completions, **kwargs):
    return [len(c[0]["content"]) / 10 for c in completions]


def minus_half_length(completions, **kwargs):  # weighted x2 it cancels ``length`` in the sum, not once normalised
    return [-len(c[0]["content"]) / 20 for c in completions]


@pytest.mark.parametrize("aggregation, kept", [("normalize_then_sum", True), ("sum_then_normalize", False)])
def test_dynamic_sampling_keeps_groups_whose_normalised_rewards_vary_under_normalize_then_sum(
        tiny_llama, grpo_args, aggregation, kept):
    """Rewards ``length`` and ``-length / 2`` weighted (1, 2): every weighted sum is 0, so under
    sum_then_normalize every advantage is 0 and no group has a gradient; under normalize_then_sum each function is
    normalised in its group first, ``z - 2 z = -z``, so every group whose lengths vary has one. Dynamic sampling
    must keep those (it dropped them all, reading the weighted sums)."""
    prompts = Dataset.from_list([{"prompt": [{"role": "user", "content": "Hi?"}]}] * 8)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=[length, minus_half_length], train_dataset=prompts,
                                  args=grpo_args(max_steps=1, dynamic_sampling=True, dynamic_sampling_max_rounds=1,
                                                 reward_weights=[1.0, 2.0], multi_objective_aggregation=aggregation))
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "dynamic_sampling/filled_share" in h)
    if kept:
        # both groups' lengths vary: both kept, no refill round (reading the sums: both dropped, 1 round, 0 filled)
        assert logged["dynamic_sampling/filled_share"] == 1.0 and logged["dynamic_sampling/rounds"] == 0, logged
    else:
        # every advantage 0: nothing kept after the one round allowed; the batch trains as plain GRPO would
        assert logged["dynamic_sampling/filled_share"] == 0.0 and logged["dynamic_sampling/rounds"] == 1, logged


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_advantage_parts_give_trls_advantages_on_one_round(aggregation):
    """``merged_advantages`` of one round's ``advantage_parts`` is TRL's own advantage computation of that round
    (restated here under scale_rewards='batch' for sum_then_normalize, as TRL computes it under normalize_then_sum)."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [1.0, 3.0], [1.0, 3.0],
                            [float("nan"), float("nan")], [0.5, 1.0]])  # row 6: every function gave None
    w = torch.tensor([1.0, 2.0])
    got = ds.merged_advantages(*ds.advantage_parts(rewards, w, 2, aggregation), aggregation)
    if aggregation == "normalize_then_sum":  # trl_advantages, the unscorable row NaN before the batch statistics
        grouped = rewards.view(-1, 2, 2)  # [N, G, K]
        z = (grouped - grouped.nanmean(1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
        r = (z.view(-1, 2) * w).nansum(1)
        r[6] = float("nan")
        want = (r - r.nanmean()) / (nanstd(r) + 1e-4)
        scorable = ds.merged_advantages(*ds.advantage_parts(rewards[:6], w, 2, aggregation), aggregation)
        assert torch.allclose(scorable, trl_advantages(rewards[:6], w, 2, aggregation), atol=1e-6)
    else:  # sum_then_normalize, scale_rewards='batch': the group's mean, the batch's std
        r = (rewards * w).nansum(1)
        r[6] = float("nan")
        want = (r - torch.nanmean(r.view(-1, 2), 1).repeat_interleave(2)) / (nanstd(r) + 1e-4)
    assert torch.allclose(got, torch.nan_to_num(want, nan=0.0), atol=1e-6), (got, want)
    assert got[6] == 0.0  # unscorable: 0, as TRL's


def test_refill_under_batch_statistics_divides_by_the_merged_batchs_std():
    """scale_rewards='batch', G=2. Round 0: group 0 rewards (0, 1), groups 1-3 flat (0, 0): TRL divides by round 0's
    std, nanstd(0, 1, 0, 0, 0, 0, 0, 0) = 0.354: advantages -/+1.414. The refill round of three groups (0, 1): its
    own std 0.548, -/+0.913. A batch of the four kept groups is (0, 1) x 4: std 0.535, so every kept row's advantage
    is -/+0.935 -- round 0's kept rows weighed 1.5x the refill's before."""
    G = 2
    first = scored([10] * 8, [1] * 8)
    r0 = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]).unsqueeze(1)
    q0, n0 = ds.advantage_parts(r0, torch.ones(1), G, "sum_then_normalize")
    first.update(dict(zip(ds.ADVANTAGE_PARTS, (q0, n0))))
    first["advantages"] = ds.merged_advantages(q0, n0, "sum_then_normalize")
    assert first["advantages"][:2].tolist() == pytest.approx([-1.414, 1.414], abs=1e-3)  # round 0 alone

    def score_round(rows):
        out = scored([12] * len(rows), [2] * len(rows))
        r = torch.tensor([0.0, 1.0] * (len(rows) // 2)).unsqueeze(1)
        q, n = ds.advantage_parts(r, torch.ones(1), G, "sum_then_normalize")
        out.update(dict(zip(ds.ADVANTAGE_PARTS, (q, n))))
        out["advantages"] = ds.merged_advantages(q, n, "sum_then_normalize")
        assert out["advantages"][:2].tolist() == pytest.approx([-0.913, 0.913], abs=1e-3)  # the round alone
        return out, out["advantages"], None

    merged, _ = ds.refill(first, first["advantages"], None, score_round=score_round, log=lambda m: None,
                          accelerator=OneProcess(), train_dataset=[{"prompt": "p"}] * 8, seed=0, step=0,
                          num_generations=G, max_rounds=1, steps_per_generation=1, pad_token_id=0, row_key=ROW_KEY,
                          aggregation="sum_then_normalize")
    assert merged[ROW_KEY].tolist() == [0, 1, 8, 9, 10, 11, 12, 13]
    assert merged["advantages"].tolist() == pytest.approx([-0.935, 0.935] * 4, abs=1e-3)
    assert not set(ds.ADVANTAGE_PARTS) & set(merged)  # the parts do not reach the loss


class ObservedRounds(grpotrl.GRPOTrainer):
    """Records each round's rewards (TRL's ``_calculate_rewards``, [B, K]) and each merged generation batch."""

    def _calculate_rewards(self, *args, **kwargs):
        rewards = super()._calculate_rewards(*args, **kwargs)
        self.rounds = getattr(self, "rounds", []) + [rewards.detach().clone()]
        return rewards

    def _score_round(self, inputs):
        output, generated = super()._score_round(inputs)
        self.scored = getattr(self, "scored", []) + [{k: output[k].clone() for k in ("advantages",
                                                                                        *ds.ADVANTAGE_PARTS)}]
        return output, generated

    def _generate_and_score_completions(self, inputs):
        self.rounds = []
        output = super()._generate_and_score_completions(inputs)
        self.merged = getattr(self, "merged", []) + [(output, self.rounds)]
        return output


def test_dynamic_sampling_under_batch_scaling_trains_the_merged_batchs_advantages(tiny_llama, grpo_args):
    """scale_rewards='batch': each kept row's advantage is its reward minus its group's mean, over the std of the
    rewards of the rows the merged batch trains on, as TRL would compute for that batch; each round's own std
    (the dropped flat groups in it) made the rounds' rows weigh differently."""
    from trl.trainer.utils import nanstd

    rows = [{"prompt": [{"role": "user", "content": "What is " + "1 + " * (i % 4) + "2?"}]} for i in range(16)]
    rows = [r if i % 2 else {"prompt": [{"role": "user", "content": "What is 2?"}]} for i, r in enumerate(rows)]
    trainer = ObservedRounds(model=tiny_llama, reward_funcs=flat_for_two, train_dataset=Dataset.from_list(rows),
                             args=grpo_args(max_steps=2, dynamic_sampling=True, dynamic_sampling_max_rounds=6,
                                            max_completion_length=6, scale_rewards="batch"))
    trainer.train()
    refilled = 0
    for output, rounds in trainer.merged:
        r = torch.cat(rounds)[:, 0]  # [rows of every round], one reward function of weight 1
        means = torch.cat([x[:, 0].view(-1, 4).mean(1).repeat_interleave(4) for x in rounds])
        tags = output[ROW_KEY]
        want = (r[tags] - means[tags]) / (nanstd(r[tags]) + 1e-4)
        assert torch.allclose(output["advantages"], want, atol=1e-5), (output["advantages"], want)
        refilled += len(rounds) > 1
    assert refilled, "no batch was refilled: the test shows nothing"
    for round_ in trainer.scored:  # the parts a round carries give TRL's own advantages of that round back
        parts = [round_[k] for k in ds.ADVANTAGE_PARTS]
        assert torch.allclose(ds.merged_advantages(*parts, "sum_then_normalize"), round_["advantages"], atol=1e-6)
