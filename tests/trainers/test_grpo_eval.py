"""GRPO evaluation (``eval_strategy``) on a tiny model, guards on every step: TRL 1.16 groups an evaluation's
completions by ``num_generations_eval`` (``args.num_generations_eval or num_generations``), so every grouped
check or statistic grpotrl computes on an eval batch must group by it too, and what only training has (I10,
I11, the entropy sign, the health rules' findings) must not run or be logged in evaluation.

Letters: G ``num_generations`` (4 here), G_eval ``num_generations_eval``.
"""

import pytest
import torch
from conftest import arithmetic_prompts, length_reward
from datasets import Dataset

import grpotrl
from grpotrl.errors import InvariantError
from grpotrl.trainers.grpo import _check_groups_single_task


def tasked(n: int = 16) -> Dataset:
    """``arithmetic_prompts`` with a ``task`` column alternating between two tasks, row by row."""
    rows = arithmetic_prompts(n).to_list()
    return Dataset.from_list([{**r, "task": ("short", "long")[i % 2]} for i, r in enumerate(rows)])


def evaluated(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "eval_loss" in h]


@pytest.mark.parametrize("eval_generations, eval_batch", [(2, 6), (2, 8), (1, 3)],
                         ids=["batch-not-a-multiple-of-G", "batch-a-multiple-of-G", "one-generation"])
@pytest.mark.parametrize("cls", [grpotrl.GRPOTrainer, grpotrl.MultiTaskGRPOTrainer])
def test_eval_groups_are_num_generations_eval_completions_of_one_task(cls, eval_generations, eval_batch, tiny_llama,
                                                                     grpo_args):
    """G=4 in training, G_eval < G in evaluation, every eval step after a training step. Rows carry a task label
    (per-task metrics on GRPOTrainer, the task groups on MultiTaskGRPOTrainer), so the check that no group mixes
    tasks runs on every eval batch. TRL's eval sampler repeats each prompt G_eval times: an eval batch of 6 rows
    at G_eval=2 is 3 groups of 2 (not a whole number of groups of 4: ``view(-1, 4)`` fails), one of 8 rows is 4
    groups of 2 whose neighbours may be of the other task (read 4 at a time, a group "mixes tasks"), one of 3 rows
    at G_eval=1 (TRL's own lower bound) 3 groups of 1. Each batch size is TRL's minimum constraint: a multiple of
    G_eval. All must evaluate."""
    rewards = {"short": [length_reward], "long": [length_reward]} if cls is grpotrl.MultiTaskGRPOTrainer \
        else length_reward
    trainer = cls(tiny_llama, reward_funcs=rewards, train_dataset=tasked(), eval_dataset=tasked(12),
                  args=grpo_args(max_steps=2, eval_strategy="steps", eval_steps=1,
                                 num_generations_eval=eval_generations, per_device_eval_batch_size=eval_batch, max_completion_length=8))
    trainer.train()
    logs = evaluated(trainer)
    assert len(logs) == 2  # after step 1 and step 2
    for task in ("short", "long"):
        assert all(f"eval_tasks/{task}/reward" in h for h in logs), logs[-1].keys()


def test_a_batch_that_is_not_whole_groups_is_a_named_error():
    """6 gathered rows read in groups of 4: an ``InvariantError`` naming the row count and the group size and
    what to set, never torch's ``view`` error."""
    with pytest.raises(InvariantError, match=r"6 rows over every process, not a whole number of groups of 4"):
        _check_groups_single_task(torch.tensor([0, 0, 1, 1, 0, 0]), 4, ["a", "b"])
    with pytest.raises(InvariantError, match=r"group 0 mixes tasks \['a', 'a', 'b', 'b'\] \(groups of 4"):
        _check_groups_single_task(torch.tensor([0, 0, 1, 1]), 4, ["a", "b"])
    _check_groups_single_task(torch.tensor([0, 0, 1, 1]), 2, ["a", "b"])  # G_eval=2: two groups of one task each


def test_I5_checked_in_evaluation_is_logged_under_eval(tiny_llama, grpo_args):
    """Guards on every step check I5 on the eval batches' loss too. Its gap must be logged with the evaluation
    (``eval_guards/logprob_max_gap``), not appended to the training metrics, whose next log would average an
    evaluation's microbatches into the training steps' value. The run evaluates after its last training log,
    so any value left on the training lists came from the evaluation."""
    trainer = grpotrl.GRPOTrainer(tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                  eval_dataset=arithmetic_prompts(4),
                                  args=grpo_args(max_steps=1, eval_strategy="steps", eval_steps=1,
                                                 num_generations_eval=2, per_device_eval_batch_size=4,
                                                 max_completion_length=8))
    trainer.train()
    (logs,) = evaluated(trainer)
    assert "eval_guards/logprob_max_gap" in logs and logs["eval_guards/logprob_max_gap"] < 1e-4, logs.keys()
    left = {k for k, v in trainer.metric_values("train").items() if v}
    assert not left, f"evaluation metrics appended to the training lists: {sorted(left)}"


def test_boundary_report_shows_a_training_batch_after_an_evaluation(tiny_llama, grpo_args):
    """``boundary_report()`` (the health callback prints it after the first training steps) shows what training
    sampled: an evaluation after the last step, on prompts of its own, leaves the training batch in place."""
    from datasets import Dataset

    evals = Dataset.from_list([{"prompt": [{"role": "user", "content": "Name a colour."}], "answer": "red"}] * 8)
    trainer = grpotrl.GRPOTrainer(tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                  eval_dataset=evals, args=grpo_args(max_steps=1, eval_strategy="steps", eval_steps=1,
                                                                     per_device_eval_batch_size=8))
    trainer.train()
    assert evaluated(trainer)  # the evaluation ran, after the training step
    report = trainer.boundary_report()
    assert "2?<|im_end|>" in report and "colour" not in report, report  # a training prompt's tail
