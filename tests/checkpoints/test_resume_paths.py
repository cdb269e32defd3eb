"""Which checkpoint a ``train()`` resumes from, what a resume permits, and what a save into an existing
``checkpoint-N`` leaves when it is cut short (``grpotrl/trainers/_common.py``, ``grpotrl/checkpoints``).

* A resume lifts the finished-run refusal of ``output_dir`` only when it continues that run: its
  checkpoint lies inside ``output_dir``. Another run's checkpoint resumed into it would replace the
  finished model and log with a continuation of something else.
* ``resume_from_checkpoint=True`` is resolved when ``train()`` runs: the preflight's resolution (made
  before the weights loaded) serves the first ``train()`` only.
* A run resumed from an earlier checkpoint reaches step N again and saves into the existing
  ``checkpoint-N``; cut short there, that checkpoint must read incomplete, never the new weights beside
  the old optimizer and RNG state.
* ``train()`` that raises releases the ``output_dir`` lock: the resume may come from another process.
* A resume path written with ``~`` resumes the checkpoint that was checked.

Tiny random model, 4-token completions, no guards: each run takes a second or two.
"""

import os

import pytest
from conftest import arithmetic_prompts, length_reward
from test_output_dir import finished_run, held_elsewhere
from transformers import TrainerCallback

import grpotrl
from grpotrl import checkpoints
from grpotrl.checkpoints import WEIGHTS_ONLY, checkpoint_problems, find_last_checkpoint, resume_files
from grpotrl.errors import InputError


def trainer_for(model, args, **kwargs) -> grpotrl.GRPOTrainer:
    return grpotrl.GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=arithmetic_prompts(),
                               **kwargs)


def small(grpo_args, output_dir, **overrides):
    return grpo_args(output_dir=str(output_dir), max_completion_length=4, guard_steps=0, health_action="off",
                     **overrides)


def test_resuming_another_runs_checkpoint_does_not_lift_the_finished_run_refusal(tiny_llama, grpo_args, tmp_path):
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    trainer = trainer_for(tiny_llama, small(grpo_args, run_a, max_steps=1, save_strategy="steps", save_steps=1))
    trainer.train()
    trainer.end()
    other = str(run_a / "checkpoint-1")
    before = finished_run(run_b)

    # the Python API: check_finished_run, for a resume from outside output_dir as for no resume
    trainer = trainer_for(tiny_llama, small(grpo_args, run_b, max_steps=2))
    with pytest.raises(InputError, match=rf"holds a finished run of 25 steps.*resume_from_checkpoint '{other}' lies "
                                         "outside it"):
        trainer.train(resume_from_checkpoint=other)
    assert {p.name: p.read_bytes() for p in run_b.iterdir()} == before  # refused before anything was written
    assert not held_elsewhere(run_b)

    # the CLI's stricter check, given the resume value itself: only a checkpoint inside output_dir counts
    with pytest.raises(InputError, match="lies outside it"):
        checkpoints.check_output_dir(str(run_b), resume=other)
    checkpoints.check_output_dir(str(run_b), resume=True)
    checkpoints.check_output_dir(str(run_b), resume=str(run_b / "checkpoint-9"))
    checkpoints.check_finished_run(str(run_b), resume=str(run_b / "checkpoint-9"))

    trainer.train(resume_from_checkpoint=other, overwrite_output_dir=True)  # asked for: proceeds
    assert trainer.state.global_step == 2
    trainer.end()


class CtrlC(TrainerCallback):
    """Ctrl-C at the end of step ``step`` (after its optimizer step, before its checkpoint), once."""

    def __init__(self, step: int):
        self.step, self.done = step, False

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and not self.done:
            self.done = True
            raise KeyboardInterrupt


def test_a_second_train_resolves_resume_true_afresh_and_a_raising_train_releases_the_lock(tiny_llama, grpo_args,
                                                                                          tmp_path):
    """The preflight resolved ``resume_from_checkpoint="true"`` to checkpoint-1 at __init__; after the first
    train() wrote checkpoint-2 and was interrupted, the second train("true") used to resume from checkpoint-1
    again (the stale resolution), retraining step 2."""
    out = tmp_path / "out"
    first = trainer_for(tiny_llama, small(grpo_args, out, max_steps=1, save_strategy="steps", save_steps=1))
    first.train()
    first.end()

    args = small(grpo_args, out, max_steps=4, save_strategy="steps", save_steps=1, resume_from_checkpoint="true")
    trainer = trainer_for(tiny_llama, args, callbacks=[CtrlC(3)])
    loaded = []
    original = trainer._load_from_checkpoint
    trainer._load_from_checkpoint = lambda checkpoint, model=None: (loaded.append(os.path.basename(checkpoint)),
                                                                    original(checkpoint, model))[1]
    with pytest.raises(KeyboardInterrupt):
        trainer.train(resume_from_checkpoint="true")
    assert checkpoints._checkpoints(str(out)) == ["checkpoint-1", "checkpoint-2"]
    assert not held_elsewhere(out)  # released when train() raised: another process may resume now
    trainer.train(resume_from_checkpoint="true")
    assert loaded == ["checkpoint-1", "checkpoint-2"]
    assert trainer.state.global_step == 4
    trainer.end()


def test_an_interrupted_save_into_an_existing_checkpoint_leaves_it_incomplete(tiny_llama, grpo_args, tmp_path):
    """Run 1 saves checkpoint-1 and -2; run 2 resumes from checkpoint-1 and is interrupted while re-saving
    checkpoint-2, after the new weights and before the optimizer. checkpoint-2 used to hold the new weights,
    the old optimizer, scheduler and RNG state and the old trainer_state.json, and to count as complete."""
    out = tmp_path / "out"
    every_step = dict(max_steps=2, save_strategy="steps", save_steps=1)
    trainer = trainer_for(tiny_llama, small(grpo_args, out, learning_rate=1e-2, **every_step))
    trainer.train()
    trainer.end()
    checkpoint_2 = str(out / "checkpoint-2")
    required = resume_files(trainer.args, "grpo")
    assert checkpoint_problems(checkpoint_2, required) == []

    trainer = trainer_for(tiny_llama, small(grpo_args, out, learning_rate=5e-2, seed=1, **every_step))

    def interrupted(output_dir):
        raise KeyboardInterrupt

    trainer._save_optimizer_and_scheduler = interrupted
    with pytest.raises(KeyboardInterrupt):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert "no trainer_state.json" in checkpoint_problems(checkpoint_2, required)
    with pytest.raises(InputError, match=r"checkpoint-2' is incomplete: no trainer_state.json.*Complete checkpoints "
                                         r"beside it: \['checkpoint-1'\]"):
        find_last_checkpoint(str(out), required)

    # a weights-only save into it leaves no optimizer or RNG state of the old checkpoint beside its weights
    trainer = trainer_for(tiny_llama, small(grpo_args, out, save_only_model=True, **every_step))
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    trainer.end()
    assert WEIGHTS_ONLY in checkpoint_problems(checkpoint_2, required)
    assert not {"optimizer.pt", "scheduler.pt", "rng_state.pth"} & set(os.listdir(checkpoint_2))


def test_a_resume_path_under_home_written_with_a_tilde_resumes(tiny_llama, grpo_args, tmp_path, monkeypatch):
    """``resume_from_checkpoint: ~/runs/a/checkpoint-1`` (a recipe: no shell expands it). grpotrl checked the
    expanded path and found it complete, then handed the Trainer "~/..." as written: "Can't find a valid checkpoint
    at ~/runs/a/checkpoint-1", after the model had loaded."""
    monkeypatch.setenv("HOME", str(tmp_path))
    out = tmp_path / "runs" / "a"
    trainer = trainer_for(tiny_llama, small(grpo_args, out, max_steps=1, save_strategy="steps", save_steps=1))
    trainer.train()
    trainer.end()
    trainer = trainer_for(tiny_llama, small(grpo_args, "~/runs/a", max_steps=2))
    assert trainer.args.output_dir == str(out)  # transformers expands output_dir
    trainer.train(resume_from_checkpoint="~/runs/a/checkpoint-1")
    assert trainer.state.global_step == 2
    trainer.end()
