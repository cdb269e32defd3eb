"""Ctrl-C during ``grpotrl grpo``: one line that says where the run stands (the checkpoint that
``--resume_from_checkpoint true`` continues, or that none was saved yet) and exit 130, not a traceback
from inside torch; the resume it names then finishes the run."""

import pytest
import yaml

import grpotrl
from grpotrl import cli


def interrupt_at_call(monkeypatch, n: int) -> None:
    """Ctrl-C (``KeyboardInterrupt``, what Python's SIGINT handler raises) in the ``n``-th training step."""
    calls = []
    original = grpotrl.GRPOTrainer.training_step

    def step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(grpotrl.GRPOTrainer, "training_step", step)


def recipe(tmp_path, model: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model_name_or_path": model, "output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": "none",
        "reward_funcs": ["exact_answer"], "max_steps": 3, "save_steps": 1, "per_device_train_batch_size": 4,
        "num_generations": 4, "max_completion_length": 4, "guard_steps": 0}))
    return str(path)


def interrupted_line(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
    except KeyboardInterrupt:  # escaping, it would also stop the whole test session
        pytest.fail("Ctrl-C left grpotrl's main() as a KeyboardInterrupt traceback")
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "grpotrl grpo: interrupted" in ln]
    assert exit_.value.code == cli.EXIT_INTERRUPTED == 130 and len(lines) == 1 and "KeyboardInterrupt" not in err, \
        err[-2000:]
    assert "grpotrl grpo: interrupted at step " in lines[0], lines[0]  # after the progress bar's last state
    return lines[0]


def test_ctrl_c_names_the_checkpoint_to_resume_and_the_resume_finishes(tmp_path, tiny_llama, monkeypatch, capsys):
    interrupt_at_call(monkeypatch, 3)  # steps 1 and 2 done and saved
    line = interrupted_line(capsys, ["grpo", "--config", recipe(tmp_path, tiny_llama)])
    assert "at step 2; the run is saved up to" in line and line.endswith(
        "checkpoint-2. Resume it: the same command plus --resume_from_checkpoint true."), line
    monkeypatch.undo()
    cli.main(["grpo", "--config", recipe(tmp_path, tiny_llama), "--resume_from_checkpoint", "true"])
    assert "grpotrl grpo: 3 steps" in capsys.readouterr().out


def test_ctrl_c_before_a_checkpoint_says_none_was_saved(tmp_path, tiny_llama, monkeypatch, capsys):
    interrupt_at_call(monkeypatch, 1)
    line = interrupted_line(capsys, ["grpo", "--config", recipe(tmp_path, tiny_llama)])
    assert "at step 0; no checkpoint of this run to resume" in line, line
