"""Which run a ``checkpoint-N`` belongs to, and how many processes saved it (``grpotrl/checkpoints``).

* A run started afresh into a used ``output_dir`` (``overwrite_output_dir``, or the Python API into a dir
  that holds checkpoints only) leaves the earlier run's ``checkpoint-N`` dirs where they are, and
  ``resume_from_checkpoint=True`` never resumes one of them: it takes the newest checkpoint of the current
  run (a resume continues the run it resumes), or, when only an earlier run's checkpoints are there, stops
  with an error naming them. The earlier run may be plain TRL's, which records no run. ``save_total_limit``
  deletes only the current run's older checkpoints, never the one just saved; at the end of training, under
  ``save_total_limit=1`` with a best checkpoint, the current run's other than the best.
* A checkpoint saved by several processes is complete only with every rank's ``rng_state_<rank>.pth``
  (under ``save_on_each_node``: every rank on the machine whose copy it is); one written by a single process,
  or by plain TRL (no grpotrl record), is checked as before.

Tiny random model, 4-token completions, no guards: each run takes a second or two; the two-process
launch takes ~30 s on 2 cores and is marked slow.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import trl
from conftest import arithmetic_prompts, free_port, length_reward
from planted import PlantedBest
from test_resume_paths import CtrlC, small, trainer_for

from grpotrl import checkpoints
from grpotrl.checkpoints import checkpoint_problems, find_last_checkpoint, resume_checkpoint, resume_files
from grpotrl.errors import InputError

EVERY_STEP = dict(save_strategy="steps", save_steps=1)


def interrupted(model, args, step: int, resume=None):
    """A grpotrl run into ``args.output_dir`` stopped (Ctrl-C) at the end of ``step``, before that step's
    checkpoint; returns the checkpoint names it loaded from."""
    trainer = trainer_for(model, args, callbacks=[CtrlC(step)])
    loaded = []
    original = trainer._load_from_checkpoint
    trainer._load_from_checkpoint = lambda checkpoint, model=None: (loaded.append(os.path.basename(checkpoint)),
                                                                    original(checkpoint, model))[1]
    with pytest.raises(KeyboardInterrupt):
        trainer.train(resume_from_checkpoint=resume)
    return loaded


def plain_trl_run(model, output_dir: Path, steps: int) -> None:
    """A run of TRL's own GRPOTrainer (no grpotrl record), a checkpoint every step."""
    args = trl.GRPOConfig(output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=4, max_steps=steps, report_to="none", use_cpu=True, **EVERY_STEP)
    trl.GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=arithmetic_prompts(), args=args).train()


def test_resume_true_never_picks_a_checkpoint_of_an_overwritten_run(tiny_llama, grpo_args, tmp_path):
    """Run A saves checkpoint-1..3; run B, overwriting it, saves checkpoint-1 and is stopped at step 2.
    ``resume_from_checkpoint=True`` used to pick A's checkpoint-3 (the highest step in output_dir)."""
    out = tmp_path / "out"
    required = resume_files(small(grpo_args, out), "grpo")
    run_a = trainer_for(tiny_llama, small(grpo_args, out, max_steps=3, **EVERY_STEP))
    run_a.train()
    run_a.end()
    assert find_last_checkpoint(str(out), required) == str(out / "checkpoint-3")

    interrupted(tiny_llama, small(grpo_args, out, max_steps=3, overwrite_output_dir=True, **EVERY_STEP), step=2)
    assert checkpoints._checkpoints(str(out)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]  # none deleted
    assert find_last_checkpoint(str(out), required) == str(out / "checkpoint-1")  # B's, not A's checkpoint-3

    # resuming B continues B: its checkpoints, the one it resumed from and the ones it saves, are the current run's
    args = small(grpo_args, out, max_steps=3, **EVERY_STEP)
    assert interrupted(tiny_llama, args, step=2, resume=True) == ["checkpoint-1"]
    assert find_last_checkpoint(str(out), required) == str(out / "checkpoint-1")  # stopped again before a save
    assert interrupted(tiny_llama, args, step=3, resume=True) == ["checkpoint-1"]
    assert find_last_checkpoint(str(out), required) == str(out / "checkpoint-2")  # B's continuation saved it

    # run C overwrites B and is stopped before its first checkpoint: every checkpoint is an earlier run's
    interrupted(tiny_llama, small(grpo_args, out, max_steps=3, overwrite_output_dir=True, **EVERY_STEP), step=1)
    for find in (lambda: find_last_checkpoint(str(out), required),
                 lambda: resume_checkpoint(True, small(grpo_args, out), "grpo")):
        with pytest.raises(InputError, match=r"resume_from_checkpoint is true but every checkpoint in output_dir "
                                             r".*\(\['checkpoint-1', 'checkpoint-2', 'checkpoint-3'\]\) belongs to an "
                                             rf"earlier run.*--resume_from_checkpoint {out / 'checkpoint-3'}") as err:
            find()
        assert re.search(r"\(started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d, with overwrite_output_dir", str(err.value)), err.value
    assert checkpoints._checkpoints(str(out)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    # named explicitly, an earlier run's checkpoint resumes as before
    assert resume_checkpoint(str(out / "checkpoint-3"), small(grpo_args, out), "grpo") == str(out / "checkpoint-3")


def test_resume_true_never_picks_a_checkpoint_of_an_overwritten_plain_trl_run(tiny_llama, grpo_args, tmp_path):
    """A plain TRL run records no run in its checkpoints: grpotrl's run that overwrites it tells them apart by
    when they were written (before it started)."""
    out = tmp_path / "out"
    required = resume_files(small(grpo_args, out), "grpo")
    plain_trl_run(tiny_llama, out, steps=2)
    assert find_last_checkpoint(str(out), ()) == str(out / "checkpoint-2")  # no grpotrl run recorded: as TRL

    interrupted(tiny_llama, small(grpo_args, out, max_steps=3, overwrite_output_dir=True, **EVERY_STEP), step=2)
    assert find_last_checkpoint(str(out), required) == str(out / "checkpoint-1")  # not TRL's checkpoint-2


def test_an_incomplete_checkpoint_of_an_overwritten_run_does_not_block_the_resume(tiny_llama, grpo_args, tmp_path):
    """Run A was killed while saving checkpoint-3 (no trainer_state.json); run B, overwriting it, saved
    checkpoint-1. A's cut-short checkpoint-3 is A's: the resume takes B's checkpoint-1."""
    out = tmp_path / "out"
    required = resume_files(small(grpo_args, out), "grpo")
    run_a = trainer_for(tiny_llama, small(grpo_args, out, max_steps=3, **EVERY_STEP))
    run_a.train()
    run_a.end()
    (out / "checkpoint-3" / "trainer_state.json").unlink()
    with pytest.raises(InputError, match="checkpoint-3' is incomplete"):
        find_last_checkpoint(str(out), required)
    interrupted(tiny_llama, small(grpo_args, out, max_steps=3, overwrite_output_dir=True, **EVERY_STEP), step=2)
    assert find_last_checkpoint(str(out), required) == str(out / "checkpoint-1")


def test_save_total_limit_deletes_only_the_current_runs_older_checkpoints(tiny_llama, grpo_args, tmp_path):
    """Run A is stopped after saving checkpoint-1 and -2; run B starts afresh into the same dir (the Python API
    allows a checkpoint-only dir) with save_total_limit=1. transformers' rotation deleted A's checkpoints along
    with B's older ones (the docs say an earlier run's are left where they are); only B's checkpoint-4 goes."""
    out = tmp_path / "out"
    interrupted(tiny_llama, small(grpo_args, out, max_steps=6, **EVERY_STEP), step=3)
    assert checkpoints._checkpoints(str(out)) == ["checkpoint-1", "checkpoint-2"]
    run_b = trainer_for(tiny_llama, small(grpo_args, out, max_steps=8, save_strategy="steps", save_steps=4,
                                          save_total_limit=1))
    run_b.train()
    run_b.end()
    assert checkpoints._checkpoints(str(out)) == ["checkpoint-1", "checkpoint-2", "checkpoint-8"]  # B's -4 rotated
    required = resume_files(small(grpo_args, out), "grpo")
    assert all(not checkpoint_problems(str(out / c), required) for c in checkpoints._checkpoints(str(out)))


def test_save_total_limit_keeps_the_checkpoint_just_saved_where_mtimes_are_not_reliable(
        tiny_llama, grpo_args, tmp_path, monkeypatch):
    """A run saved checkpoint-1..3, the last cut short (no trainer_state.json); it is resumed from checkpoint-1
    with save_total_limit=1 and stopped after saving checkpoint-2. On a file system whose mtimes are all alike
    (cloud FUSE mounts) transformers sorts by step and keeps the highest, the cut-short checkpoint-3: it deleted
    checkpoint-1 and the checkpoint-2 just saved, leaving no checkpoint to resume from."""
    out = tmp_path / "out"
    run = trainer_for(tiny_llama, small(grpo_args, out, max_steps=3, **EVERY_STEP))
    run.train()
    run.end()
    (out / "checkpoint-3" / "trainer_state.json").unlink()
    monkeypatch.setattr(os.path, "getmtime", lambda path: 1_000_000.0)  # every file written at the same moment
    interrupted(tiny_llama, small(grpo_args, out, max_steps=3, save_total_limit=1, **EVERY_STEP), step=3,
                resume=str(out / "checkpoint-1"))
    monkeypatch.undo()
    required = resume_files(small(grpo_args, out), "grpo")
    assert "checkpoint-1" not in checkpoints._checkpoints(str(out))  # rotated, as save_total_limit asks
    assert (out / "checkpoint-2").is_dir()
    assert checkpoint_problems(str(out / "checkpoint-2"), required) == []  # the state to resume from, kept


def best_tracked(grpo_args, out: Path):
    """Evaluated and saved every 3 steps, the best model loaded at the end, ``save_total_limit=1``: where
    transformers' end of training deletes every checkpoint in ``output_dir`` but the best."""
    return small(grpo_args, out, max_steps=6, save_strategy="steps", save_steps=3, eval_strategy="steps",
                 eval_steps=3, per_device_eval_batch_size=8, load_best_model_at_end=True,
                 metric_for_best_model="planted", greater_is_better=True, save_total_limit=1)


def best_tracked_trainer(model, args, best: int, extra=()):
    return trainer_for(model, args, eval_dataset=arithmetic_prompts(2), callbacks=[PlantedBest(best), *extra])


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resuming-its-own-checkpoint"])
def test_the_end_of_training_keeps_an_earlier_runs_checkpoints_under_save_total_limit_1(
        tiny_llama, grpo_args, tmp_path, resumed):
    """Run A is stopped after saving checkpoint-1 and -2; run B starts afresh into the same dir, evaluated and
    saved at steps 3 and 6, ``load_best_model_at_end`` and ``save_total_limit=1``. At the end of training
    transformers deletes every checkpoint in output_dir but the best, A's included; only B's other checkpoint
    goes. Fresh, B's best is its checkpoint-3 (its checkpoint-6 goes); resuming, B was stopped after saving
    checkpoint-3 and resumed from it, its best is checkpoint-6 and the checkpoint it resumed from goes. A copy of
    a checkpoint under another name (``checkpoint-2-kept``) is no run's checkpoint and stays too."""
    out = tmp_path / "out"
    interrupted(tiny_llama, small(grpo_args, out, max_steps=6, **EVERY_STEP), step=3)
    assert checkpoints._checkpoints(str(out)) == ["checkpoint-1", "checkpoint-2"]
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-2-kept")  # a user's copy: transformers lists it too
    best = 6 if resumed else 3
    args = best_tracked(grpo_args, out)
    if resumed:  # B stopped at step 5, after saving checkpoint-3
        with pytest.raises(KeyboardInterrupt):
            best_tracked_trainer(tiny_llama, args, best, extra=[CtrlC(5)]).train()
        assert checkpoints._checkpoints(str(out)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    run_b = best_tracked_trainer(tiny_llama, args, best)
    run_b.train(resume_from_checkpoint=True if resumed else None)
    run_b.end()
    assert run_b.state.best_model_checkpoint == str(out / f"checkpoint-{best}")
    assert checkpoints._checkpoints(str(out)) == ["checkpoint-1", "checkpoint-2", f"checkpoint-{best}"]
    assert (out / "checkpoint-2-kept").is_dir()
    assert run_b.args.save_total_limit == 1
    required = resume_files(args, "grpo")
    assert all(not checkpoint_problems(str(out / c), required) for c in checkpoints._checkpoints(str(out)))


# ---------------------------------------------------------------------------------------------
# Every rank's RNG state
# ---------------------------------------------------------------------------------------------

def saved_by(checkpoint: Path, processes: int, **record) -> None:
    """Make a single process's checkpoint read as rank 0's part of a ``processes``-process save: its RNG file
    as that rank names it and the record grpotrl's saving processes write into trainer_state.json (``record``:
    further attributes, ``save_on_each_node`` and ``node_ranks``)."""
    (checkpoint / "rng_state.pth").rename(checkpoint / "rng_state_0.pth")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    entry = state.setdefault("stateful_callbacks", {}).setdefault("GrpotrlRun", {"args": {}, "attributes": {}})
    entry["attributes"].update(processes=processes, **record)
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))


def one_step_checkpoint(model, grpo_args, out: Path) -> tuple[Path, tuple[str, ...]]:
    """A one-step grpotrl run into ``out`` (one process): its ``checkpoint-1`` and the files a resume needs."""
    args = small(grpo_args, out, max_steps=1, **EVERY_STEP)
    trainer = trainer_for(model, args)
    trainer.train()
    trainer.end()
    return out / "checkpoint-1", resume_files(args, "grpo")


def test_a_checkpoint_needs_the_rng_state_of_every_process_that_saved_it(tiny_llama, grpo_args, tmp_path):
    """A 2-process checkpoint without rank 1's rng_state_1.pth used to pass (any one rng_state file did);
    a resume then restarts rank 1's sampling from a fresh RNG, silently."""
    out = tmp_path / "out"
    checkpoint, required = one_step_checkpoint(tiny_llama, grpo_args, out)
    assert checkpoint_problems(str(checkpoint), required) == []
    saved_by(checkpoint, 2)
    assert checkpoint_problems(str(checkpoint), required) == [
        "no rng_state_1.pth (2 processes saved this checkpoint, each its own rng_state_<rank>.pth)"]
    with pytest.raises(InputError, match=r"checkpoint-1' is incomplete: no rng_state_1.pth \(2 processes"):
        find_last_checkpoint(str(out), required)
    (checkpoint / "rng_state_1.pth").write_bytes((checkpoint / "rng_state_0.pth").read_bytes())
    assert checkpoint_problems(str(checkpoint), required) == []


def test_save_on_each_node_needs_the_rng_state_of_every_rank_on_that_machine(tiny_llama, grpo_args, tmp_path):
    """transformers' Trainer._save_rng_state runs on every process, each writing rng_state_<rank>.pth into its own
    machine's output_dir, and a resume loads each rank's own file. Under save_on_each_node any one RNG file used
    to pass: a machine's copy without one of its own ranks' files (a save cut short) resumed that rank from a fresh
    RNG, silently. Each copy is checked for the ranks recorded as running on its machine, and only those: the
    second machine's copy holds no rng_state_0.pth, and needs none."""
    out = tmp_path / "out"
    checkpoint, required = one_step_checkpoint(tiny_llama, grpo_args, out)
    saved_by(checkpoint, 2, save_on_each_node=True, node_ranks=[0, 1])  # one machine, two processes
    assert checkpoint_problems(str(checkpoint), required) == [
        "no rng_state_1.pth (save_on_each_node: this machine's copy holds the rng_state_<rank>.pth of its ranks "
        "0, 1, of 2 processes)"]
    with pytest.raises(InputError, match=r"checkpoint-1' is incomplete: no rng_state_1.pth \(save_on_each_node"):
        find_last_checkpoint(str(out), required)
    rank_0 = (checkpoint / "rng_state_0.pth").read_bytes()
    (checkpoint / "rng_state_1.pth").write_bytes(rank_0)
    assert checkpoint_problems(str(checkpoint), required) == []

    saved_by_second = json.loads((checkpoint / "trainer_state.json").read_text())  # machine 2 of 2: ranks 2 and 3
    saved_by_second["stateful_callbacks"]["GrpotrlRun"]["attributes"].update(processes=4, node_ranks=[2, 3])
    (checkpoint / "trainer_state.json").write_text(json.dumps(saved_by_second))
    (checkpoint / "rng_state_1.pth").rename(checkpoint / "rng_state_2.pth")
    (checkpoint / "rng_state_0.pth").unlink()
    assert checkpoint_problems(str(checkpoint), required) == [
        "no rng_state_3.pth (save_on_each_node: this machine's copy holds the rng_state_<rank>.pth of its ranks "
        "2, 3, of 4 processes)"]
    (checkpoint / "rng_state_3.pth").write_bytes(rank_0)
    assert checkpoint_problems(str(checkpoint), required) == []  # ranks 0 and 1 are on the other machine


def test_each_machine_records_the_ranks_that_run_on_it(monkeypatch):
    """``host_ranks``: the ranks sharing this process's host name, whatever order the launcher numbered them in
    (contiguous per machine, or round-robin as Slurm's cyclic distribution); recorded only under
    save_on_each_node with several processes (the collective is skipped otherwise)."""
    from types import SimpleNamespace

    import accelerate.utils

    from grpotrl.checkpoints import run_lock

    world = [(0, "a"), (1, "b"), (2, "a"), (3, "b")]
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda mine: world)
    assert run_lock.host_ranks(1) == [1, 3] and run_lock.host_ranks(2) == [0, 2]
    for each_node, world_size, expected in ((True, 4, [1, 3]), (False, 4, None), (True, 1, None)):
        args = SimpleNamespace(world_size=world_size, process_index=1, save_on_each_node=each_node, should_save=False,
                               output_dir="unused")
        state = SimpleNamespace(global_step=1, stateful_callbacks={"GrpotrlRun": {"attributes": {"run": "r1"}}})
        run_lock.GrpotrlRun().on_train_begin(args, state, None)
        assert state.stateful_callbacks["GrpotrlRun"]["attributes"]["node_ranks"] == expected


def test_a_plain_trl_checkpoint_is_checked_for_rng_state_as_before(tiny_llama, tmp_path):
    """Without grpotrl's record the number of processes is unknown: any one rng_state file passes, none fails."""
    out = tmp_path / "out"
    plain_trl_run(tiny_llama, out, steps=1)
    checkpoint = out / "checkpoint-1"
    assert checkpoint_problems(str(checkpoint)) == []
    (checkpoint / "rng_state.pth").rename(checkpoint / "rng_state_0.pth")
    assert checkpoint_problems(str(checkpoint)) == []
    (checkpoint / "rng_state_0.pth").unlink()
    assert checkpoint_problems(str(checkpoint)) == ["no rng_state.pth"]


WORKER = """
import sys
from datasets import Dataset
import grpotrl

model, out = sys.argv[1], sys.argv[2]
rows = [{"prompt": [{"role": "user", "content": "What is " + "1 + " * (i % 5) + "2?"}]} for i in range(16)]
args = grpotrl.GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
                          max_steps=1, report_to="none", use_cpu=True, guard_steps=0, health_action="off",
                          save_strategy="steps", save_steps=1, seed=0, disable_tqdm=True)

def length(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]

trainer = grpotrl.GRPOTrainer(model=model, args=args, reward_funcs=length, train_dataset=Dataset.from_list(rows))
trainer.train()
trainer.end()
"""


@pytest.mark.slow
@pytest.mark.parametrize("each_node", [False, True])
def test_a_two_process_checkpoint_without_rank_1s_rng_state_is_incomplete(tiny_llama, tmp_path, each_node):
    """The same on a checkpoint two processes really saved (``accelerate launch``, DDP over gloo), also under
    save_on_each_node (one machine: its copy holds both ranks' files)."""
    worker, out = tmp_path / "worker.py", tmp_path / "out"
    worker.write_text(WORKER.replace("disable_tqdm=True", f"disable_tqdm=True, save_on_each_node={each_node}"))
    root = Path(__file__).resolve().parents[2]
    launch = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
         "recipes/accelerate/ddp.yaml", "--main_process_port", str(free_port()), str(worker), tiny_llama, str(out)],
        cwd=root, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"})
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    checkpoint = out / "checkpoint-1"
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(checkpoint))
    assert checkpoint_problems(str(checkpoint), ("grpotrl_template.json",)) == []
    (checkpoint / "rng_state_1.pth").unlink()
    assert checkpoint_problems(str(checkpoint), ("grpotrl_template.json",)) == [
        "no rng_state_1.pth (save_on_each_node: this machine's copy holds the rng_state_<rank>.pth of its ranks "
        "0, 1, of 2 processes)" if each_node else
        "no rng_state_1.pth (2 processes saved this checkpoint, each its own rng_state_<rank>.pth)"]
