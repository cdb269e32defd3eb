"""Rewards and judges under faults, through ``python -m grpotrl.cli grpo``
as a user runs it (a subprocess; a random 2-layer policy over the SmolLM2 tokenizer, 1-2 steps):

* a reward function returning +-inf on some rows: TRL 1.16 turns the whole group's advantages
  into NaN and zeroes them, so with one such row per group nothing trains, the run exits 0 and
  logs ``reward: inf``. Now the ``nonfinite_reward`` health rule stops it (exit 3, a checkpoint
  saved) naming the function, the rows and an example; set to warn, those values count as
  missing and the rest of each group trains; set to off, TRL's handling, and the summary says
  the reward was not finite instead of printing ``inf``;
* a judge's documented stop (``max_failed_batches``) is one ``stopped:`` line, exit 4;
* a rubric file that is not plain YAML: one ``error:`` line, exit 2, and its tag never runs.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml
from judge_server import LoopbackJudge

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
INF_REWARD = "nonfinite_rewards.inf_every_fourth"  # inf on one row of each group of 4


def grpo(tmp_path, model: str, timeout: int = 420, **fields) -> tuple[int, str, str, float]:
    """``python -m grpotrl.cli grpo --config R`` at tiny scale: (exit code, stdout, stderr, seconds)."""
    body = {"model_name_or_path": model, "dataset_name": "quickstart", "output_dir": str(tmp_path / "out"),
            "use_cpu": True, "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 8,
            "max_steps": 2, "logging_steps": 1, "report_to": "none", "disable_tqdm": True, "save_strategy": "no",
            "health_report_steps": 0, "seed": 0, **fields}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(body))
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "grpotrl.cli", "grpo", "--config", str(tmp_path / "r.yaml")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


def one_line(stderr: str, kind: str) -> str:
    """The one ``grpotrl grpo: KIND:`` line of stderr; no traceback anywhere."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("grpotrl grpo:")]
    assert len(lines) == 1 and lines[0].startswith(f"grpotrl grpo: {kind}: "), stderr[-3000:]
    return lines[0]


def history(tmp_path) -> list[dict]:
    return json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]


# ---------------------------------------------------------------------------------------------
# non-finite rewards
# ---------------------------------------------------------------------------------------------

def test_inf_reward_stops_the_run_naming_function_rows_and_example_with_a_checkpoint(tmp_path, tiny_llama):
    code, out, err, _ = grpo(tmp_path, tiny_llama, reward_funcs=[INF_REWARD])
    line = one_line(err, "stopped")
    assert code == 3, (code, err[-2000:])
    assert ("[health: nonfinite_reward] step 1: reward function 'inf_every_fourth' returned a non-finite value on "
            "2 of 8 rows (e.g. row 0: inf) (0.25). A reward must be a finite number, or None") in line, line
    assert line.endswith(f"Checkpoint saved to {tmp_path / 'out' / 'checkpoint-1'} (resume_from_checkpoint works).")
    assert (tmp_path / "out" / "checkpoint-1" / "model.safetensors").is_file()


def test_inf_reward_set_to_warn_counts_as_missing_and_the_rest_of_each_group_trains(tmp_path, tiny_llama):
    code, out, err, _ = grpo(tmp_path, tiny_llama, reward_funcs=[INF_REWARD],
                             health_rule_actions={"nonfinite_reward": "warn"})
    assert code == 0, err[-3000:]
    steps = [h for h in history(tmp_path) if "grad_norm" in h]
    assert len(steps) == 2
    assert all(h["rewards/inf_every_fourth/nonfinite_share"] == 0.25 for h in steps), steps
    assert all(h["grad_norm"] > 0 and h["reward"] < float("inf") for h in steps), steps  # TRL alone: 0 and inf
    warnings = [ln for ln in err.splitlines() if "grpotrl health [nonfinite_reward]" in ln]
    assert len(warnings) == 2 and "returned a non-finite value on 2 of 8 rows" in warnings[0], err[-3000:]
    assert "reward: inf" not in out and "not finite" not in out


def test_inf_reward_with_the_rule_off_is_trl_as_it_is_and_the_summary_says_not_finite(tmp_path, tiny_llama):
    """What TRL 1.16 does with one inf row per group: every advantage 0, nothing trains, reward inf."""
    code, out, err, _ = grpo(tmp_path, tiny_llama, reward_funcs=[INF_REWARD],
                             health_rule_actions={"nonfinite_reward": "off"})
    assert code == 0, err[-3000:]
    steps = [h for h in history(tmp_path) if "grad_norm" in h]
    assert [h["grad_norm"] for h in steps] == [0.0, 0.0] and all(h["reward"] == float("inf") for h in steps)
    assert "rewards/inf_every_fourth/nonfinite_share" not in steps[0]
    assert "reward: not finite at any of the 2 logged steps (inf): nothing to average" in out, out
    assert "reward: inf" not in out


# ---------------------------------------------------------------------------------------------
# a judge's documented stop
# ---------------------------------------------------------------------------------------------

def test_judge_max_failed_batches_stop_is_one_stopped_line_exit_4(tmp_path, tiny_llama):
    with LoopbackJudge(reply="I would rather not grade this.") as fake:  # answers, never a verdict
        judges = {"j": {"base_url": fake.url, "model": "m", "rubric": "fairness", "max_failed_batches": 1,
                        "max_retries": 0, "timeout": 60}}
        code, out, err, _ = grpo(tmp_path, tiny_llama, reward_funcs=["j"], judges=judges)
        asked = len(fake.chat_requests)
    line = one_line(err, "stopped")
    assert code == 4, (code, err[-2000:])
    assert asked == 8 and line.startswith("grpotrl grpo: stopped: judge 'j' gave no score for 1 batches in a row "
                                          "(last batch: 8 rows)"), line
    assert "last HTTP status: 200" in line and "raise max_failed_batches" in line


# ---------------------------------------------------------------------------------------------
# one error line before the load, as a real process exits with it (tests/cli/test_cli_inputs.py has
# every case in-process, the model load refused: the rubric file's and os.system as a reward)
# ---------------------------------------------------------------------------------------------

def test_cli_bad_rubric_is_one_error_line_exit_2_and_its_tag_never_runs(tmp_path, tiny_llama):
    rubric = tmp_path / "rubric.yaml"
    rubric.write_text(f"!!python/object/apply:os.system ['touch {tmp_path / 'PWNED'}']\n")
    judges = {"j": {"base_url": "http://127.0.0.1:9/v1", "model": "m", "rubric": str(rubric)}}
    code, out, err, _ = grpo(tmp_path, tiny_llama, judges=judges, reward_funcs=["j"])
    line = one_line(err, "error")
    assert code == 2 and "not plain YAML: could not determine a constructor for the tag" in line, line
    assert not (tmp_path / "PWNED").exists()
