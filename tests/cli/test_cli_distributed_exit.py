"""A distributed CLI run that stops before ``trainer.end()`` (bad input, a health or judge stop, a bug) gives
torch's collective threads their pause (``trainers._common.collectives_settled``) before the interpreter shuts
down, so that it exits with the documented code rather than a collective thread's SIGABRT; a run without a
process group exits without it. The SIGABRT itself is a race (tests/test_distributed.py's launches exit through
``trainer.end()``); this pins that every exit path of ``main`` reaches the pause while the group is up."""

import pytest
import torch
import torch.distributed as dist

import grpotrl.cli as cli
from grpotrl.errors import HealthStop, InputError
from grpotrl.rewards.judges import JudgeError

STOPS = [(InputError("bad value"), cli.EXIT_INPUT), (HealthStop("non_finite", 3, "loss is NaN"), cli.EXIT_HEALTH_STOP),
         (JudgeError("no score for 3 batches"), cli.EXIT_JUDGE_STOP), (RuntimeError("a bug"), None)]


@pytest.fixture
def gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def stopping_run(error):
    def run(command, argv):
        if dist.is_initialized():
            total = torch.ones(4)
            dist.all_reduce(total)  # a finished collective, as a training step leaves one behind
        raise error

    return run


@pytest.mark.parametrize("error, code", STOPS, ids=lambda v: type(v).__name__ if isinstance(v, Exception) else v)
def test_a_distributed_run_stopped_before_end_pauses_for_the_collective_threads(gloo_group, monkeypatch, error, code):
    paused = []
    monkeypatch.setattr(cli, "collectives_settled", lambda: paused.append(dist.is_initialized()))
    monkeypatch.setattr(cli, "run", stopping_run(error))
    with pytest.raises(SystemExit if code else RuntimeError) as stopped:
        cli.main(["grpo", "--config", "recipe.yaml"])
    if code is not None:
        assert stopped.value.code == code
    assert paused == [True]  # once, with the process group still up


def test_a_run_without_a_process_group_exits_without_the_pause(monkeypatch):
    paused = []
    monkeypatch.setattr(cli, "collectives_settled", lambda: paused.append(True))
    monkeypatch.setattr(cli, "run", stopping_run(HealthStop("non_finite", 3, "loss is NaN")))
    with pytest.raises(SystemExit) as stopped:
        cli.main(["grpo", "--config", "recipe.yaml"])
    assert stopped.value.code == cli.EXIT_HEALTH_STOP and paused == []
