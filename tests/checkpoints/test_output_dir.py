"""An ``output_dir`` belongs to one run at a time (``grpotrl/run_lock.py``), and a finished run in
it is replaced only when the user says so, in any of the ways a user can. A full disk as train() writes the
lock or the run file is a clear error that leaves nothing behind (simulated: the write raises ENOSPC).

The CLI cases are real ``python -m grpotrl.cli grpo`` subprocesses on a tiny random model. The
first run goes through a wrapper (``PAUSED``) whose first training step waits for a file, so the
second run starts while the first is certainly running, without guessing at timings.
"""

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from grpotrl import checkpoints
from grpotrl.errors import InputError

LOCK_FILE = "_grpotrl.lock"  # grpotrl.run_lock.LOCK_FILE: "_*", which push_to_hub leaves out

PAUSED = """
import os, sys, time
import grpotrl
from grpotrl.cli import main

marker, go = os.environ["PAUSE_MARKER"], os.environ["PAUSE_UNTIL"]

def paused(original):
    def training_step(self, *args, **kwargs):
        if self.state.global_step == 0 and not os.path.exists(marker):
            open(marker, "w").close()
            deadline = time.monotonic() + 300
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.1)
        return original(self, *args, **kwargs)
    return training_step

grpotrl.GRPOTrainer.training_step = paused(grpotrl.GRPOTrainer.training_step)
main(sys.argv[1:])
"""


def env() -> dict:
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def recipe(tmp_path: Path, model: str, **overrides) -> str:
    settings = dict(
        model_name_or_path=model, dtype="float32", dataset_name="quickstart", reward_funcs=["exact_answer"],
        max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=8, guard_steps=0,
        health_action="off", activation_checkpointing=False, disable_tqdm=True, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, seed=0,
    )
    settings.update(overrides)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(settings))
    return str(path)


def finished_run(directory: Path, steps: int = 25) -> dict[str, bytes]:
    """What ``save_model`` + ``save_state`` leave: final weights and trainer_state.json. Returns the files' bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.zeros(4)}, str(directory / "model.safetensors"))
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": steps, "log_history": [{"loss": 1.0}]}))
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def start_paused(tmp_path: Path, argv: list[str], name: str) -> tuple[subprocess.Popen, Path, Path]:
    """Start the CLI through ``PAUSED``; returns the process, the file its first step waits for, its log."""
    marker, go, log = tmp_path / f"{name}.in-step", tmp_path / f"{name}.go", tmp_path / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", PAUSED, *argv], stdout=out, stderr=subprocess.STDOUT,
                                env={**env(), "PAUSE_MARKER": str(marker), "PAUSE_UNTIL": str(go)})
    return proc, marker, go


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the first run never got there:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def held_elsewhere(directory: Path) -> bool:
    """Whether some open file holds the flock of ``directory``'s lock file (this process's own
    lock counts: a flock belongs to an open file, and this probe opens another)."""
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError as err:
        assert err.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
        return True
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# One run per output_dir
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow  # 28 s: two CLI runs; the lock's refusal is also test_python_train_into_a_locked_output_dir_...
def test_a_second_cli_run_into_a_running_runs_output_dir_is_refused_naming_it(tmp_path, tiny_llama):
    """Two runs started seconds apart into one output_dir both exited 0; every file on disk was the
    second's. The first run here also replaces a finished run with the recipe key `overwrite_output_dir: true`,
    and the second, refused while the first runs, succeeds with `--overwrite_output_dir true` once it has ended."""
    out = tmp_path / "out"
    finished_run(out)
    config = recipe(tmp_path, tiny_llama, overwrite_output_dir=True)
    first, in_step, go = start_paused(tmp_path, ["grpo", "--config", config, "--output_dir", str(out)], "first")
    try:  # the first holds the lock from before its model loads (the old code had none: then its first step)
        wait_for(lambda: (out / LOCK_FILE).is_file() or in_step.exists(), first, tmp_path / "first.log")
        second_argv = [sys.executable, "-m", "grpotrl.cli", "grpo", "--config", recipe(tmp_path, tiny_llama),
                       "--output_dir", str(out), "--overwrite_output_dir", "true", "--max_steps", "1"]
        second = subprocess.run(second_argv, env=env(), capture_output=True, text=True, timeout=300)
        go.touch()
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        go.touch()
        first.kill()
    errors = [line for line in second.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
    line = errors[0]
    assert line.startswith(f"grpotrl grpo: error: output_dir '{out}' is in use by another run: pid {first.pid} on "
                           f"host {os.uname().nodename}, started 20"), line
    assert "Wait for that run to end" in line
    state = json.loads((out / "trainer_state.json").read_text())  # the first's, complete: 2 steps, not 25 or 1
    assert state["global_step"] == 2 and (out / "model.safetensors").is_file()
    assert not (out / LOCK_FILE).exists()  # removed when the first ended
    again = subprocess.run(second_argv, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]  # the flag lifts the finished-run refusal
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 1


def test_python_train_into_a_locked_output_dir_is_refused_and_a_killed_runs_lock_is_not(tmp_path, tiny_llama,
                                                                                         grpo_args):
    """From Python: trainer.train() into the output_dir of a running CLI run is refused, naming it,
    before anything is written. Once that run is SIGKILLed its lock file stays behind, and is no reason to
    refuse: the kernel released the lock. train() holds the lock through save_model until trainer.end()."""
    import grpotrl
    from conftest import arithmetic_prompts, length_reward

    out = tmp_path / "out"
    running, in_step, go = start_paused(
        tmp_path, ["grpo", "--config", recipe(tmp_path, tiny_llama), "--output_dir", str(out)], "running")
    try:
        trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward,
                                      train_dataset=arithmetic_prompts(),
                                      args=grpo_args(output_dir=str(out), max_steps=1, guard_steps=0))
        wait_for(in_step.exists, running, tmp_path / "running.log")
        before = sorted(p.name for p in out.iterdir())
        with pytest.raises(InputError, match=rf"^output_dir '{out}' is in use by another run: pid {running.pid} on "
                                             rf"host {os.uname().nodename}, started 20"):
            trainer.train()
        assert sorted(p.name for p in out.iterdir()) == before
        os.kill(running.pid, signal.SIGKILL)
        assert running.wait(timeout=30) == -signal.SIGKILL
    finally:
        go.touch()
        running.kill()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == running.pid  # stale: its process is dead
    checkpoints.check_output_dir(str(out))  # a lock file alone is an empty output_dir, for the CLI's check too
    trainer.train()
    assert trainer.state.global_step == 1
    assert held_elsewhere(out)  # still held after train(): save_model next is part of the run
    trainer.save_model()
    trainer.end()
    assert not held_elsewhere(out)


def test_a_full_disk_when_train_takes_the_lock_is_a_clear_refusal_and_the_retry_is_not_refused(
        tmp_path, tiny_llama, grpo_args, monkeypatch):
    """The disk is full when train() writes its name into the lock file. That was a bare "[Errno 28] No space left
    on device" (no path; under accelerate launch rank 0 raised before telling the other ranks, which waited for
    it), and the lock stayed held by the failed call: once space was freed, train() in the same process (a
    notebook) was refused as "in use by another run"."""
    import grpotrl
    from conftest import arithmetic_prompts, length_reward

    out = tmp_path / "out"
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                  args=grpo_args(output_dir=str(out), max_steps=1, guard_steps=0))

    def full_disk(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(InputError, match=rf"^output_dir '{out}': cannot write the run lock {out / LOCK_FILE}: "
                                         r"\[Errno 28\] No space left on device\. Nothing else was written; "
                                         "free space"):
        trainer.train()
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == []  # not even the lock file
    trainer.train()  # space freed: the same process trains
    assert trainer.state.global_step == 1
    trainer.end()
    assert not held_elsewhere(out)


def test_a_full_disk_when_train_records_its_run_leaves_no_file_behind(tmp_path, tiny_llama, grpo_args, monkeypatch):
    """The disk fills up as train() writes the run file (``_grpotrl_run.json``, on_train_begin). Its temporary file
    stayed, and the CLI's next run into that output_dir was refused for holding "files grpotrl did not write"."""
    import grpotrl
    from conftest import arithmetic_prompts, length_reward

    out = tmp_path / "out"
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                  args=grpo_args(output_dir=str(out), max_steps=1, guard_steps=0))
    dump = json.dump

    def full_disk(obj, f, **kwargs):
        if "_grpotrl_run.json" in getattr(f, "name", ""):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return dump(obj, f, **kwargs)

    monkeypatch.setattr(json, "dump", full_disk)
    with pytest.raises(OSError, match=rf"No space left on device: '{out / '_grpotrl_run.json'}'"):
        trainer.train()
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == []  # the lock given back, no temporary file
    checkpoints.check_output_dir(str(out))  # so the CLI's next run is not refused


# ---------------------------------------------------------------------------------------------
# overwrite_output_dir wherever a user can set it
# ---------------------------------------------------------------------------------------------

def test_the_finished_run_refusals_name_every_way_to_lift_them(tmp_path):
    """The refusal said `train(overwrite_output_dir=True)`, which the user of a script they do not own
    cannot pass."""
    finished_run(tmp_path / "run")
    for with_checkpoint in (False, True):
        if with_checkpoint:
            (tmp_path / "run" / "checkpoint-20").mkdir()
        for check in (checkpoints.check_finished_run, checkpoints.check_output_dir):
            with pytest.raises(InputError) as err:
                check(str(tmp_path / "run"))
            for way in ("overwrite_output_dir: true in the recipe", "--overwrite_output_dir true on the command line",
                        "GRPOConfig(overwrite_output_dir=True) (SFTConfig, GADConfig alike)",
                        "train(overwrite_output_dir=True)"):
                assert way in str(err.value), (check.__name__, str(err.value))
            # resuming is offered only where there is a checkpoint to resume: else it leads back here
            assert ("resume_from_checkpoint: true" in str(err.value)) == with_checkpoint, str(err.value)


def test_overwrite_output_dir_from_a_trlparser_scripts_recipe_lifts_the_refusal(tmp_path, tiny_llama):
    """open-r1's grpo.py builds TrlParser((ScriptArguments, GRPOConfig, ModelConfig)); transformers 5
    has no overwrite_output_dir, so a recipe could not say it. With grpotrl's GRPOConfig it parses, and train()
    into a finished run then proceeds; a trl.GRPOConfig handed in (no such field) is refused as before."""
    import trl
    from conftest import arithmetic_prompts, length_reward
    from trl import ModelConfig, ScriptArguments, TrlParser

    import grpotrl

    out = tmp_path / "out"
    finished_run(out)
    path = tmp_path / "open_r1.yaml"
    path.write_text(yaml.safe_dump(dict(
        output_dir=str(out), overwrite_output_dir=True, model_name_or_path=tiny_llama, max_steps=1,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, guard_steps=0, use_cpu=True,
        bf16=False, report_to="none", save_strategy="no", disable_tqdm=True)))
    _, args, _ = TrlParser((ScriptArguments, grpotrl.GRPOConfig, ModelConfig)).parse_args_and_config(
        ["--config", str(path)])
    assert args.overwrite_output_dir is True
    assert grpotrl.SFTConfig(output_dir=str(out), use_cpu=True, overwrite_output_dir=True).overwrite_output_dir
    assert grpotrl.GADConfig(output_dir=str(out), use_cpu=True, overwrite_output_dir=True).overwrite_output_dir

    trl_args = trl.GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, max_steps=1, report_to="none",
                              gradient_checkpointing=False,
                              per_device_train_batch_size=4, num_generations=4, max_completion_length=8)
    refused = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                  args=trl_args)
    with pytest.raises(InputError, match=r"holds a finished run of 25 steps.*overwrite_output_dir: true in the recipe"):
        refused.train()
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, train_dataset=arithmetic_prompts(),
                                  args=args)
    trainer.train()  # the recipe said so
    assert trainer.state.global_step == 1
    with pytest.raises(InputError, match=r"holds a finished run of 25 steps"):
        trainer.train(overwrite_output_dir=False)  # the argument, given, wins over the config
    trainer.end()
