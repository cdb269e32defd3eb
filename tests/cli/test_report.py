"""``grpotrl report OUTPUT_DIR`` on a real short run's trainer_state.json: non-empty PNGs with
the expected panels; GAD's discriminator panel and a stopped run's checkpoint are found too."""

import json
import os

import pytest
from conftest import arithmetic_prompts, length_reward
from datasets import Dataset

import grpotrl
from grpotrl import cli, report
from grpotrl.errors import InputError

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tiny_llama, tmp_path_factory):
    """A 2-step GRPO run with two tasks and KL, saved the way the CLI saves it."""
    out = str(tmp_path_factory.mktemp("run") / "out")
    rows = [{**r, "task": "sum" if i % 2 else "echo"} for i, r in enumerate(arithmetic_prompts())]
    args = grpotrl.GRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4,
                              max_completion_length=6, max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
                              guard_steps=-1, beta=0.04, save_strategy="no", seed=0, health_report_steps=0)
    trainer = grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args,
                                  train_dataset=Dataset.from_list(rows))
    trainer.train()
    trainer.save_state()
    return out


def test_report_on_a_real_run_writes_every_panel(run_dir, tmp_path):
    paths = report.write_report(run_dir, str(tmp_path))
    assert set(paths) == {"reward", "entropy", "kl", "completion_length", "clip_ratio", "health", "logits",
                          "task_completions_mean_length", "task_completions_min_length",
                          "task_completions_max_length", "task_completions_one_token_share", "task_reward",
                          "task_reward_std", "task_entropy", "sampler_mismatch", "report"}
    for name, path in paths.items():
        with open(path, "rb") as f:
            head = f.read(8)
        assert head == PNG and os.path.getsize(path) > 10_000, (name, os.path.getsize(path))


def test_panels_have_the_titles_and_curves_of_the_run(run_dir):
    with open(os.path.join(run_dir, "trainer_state.json")) as f:
        found = report.panels(json.load(f)["log_history"])
    titles = {name: title for name, (title, _, _) in found.items()}
    assert titles["reward"] == "Reward" and titles["kl"] == "KL to the reference"
    assert titles["task_completions_mean_length"] == "Per task: completions/mean_length"
    assert set(found["task_reward"][2]) == {"sum", "echo"}  # a curve per task
    assert {"entropy", "entropy/sample_min", "entropy/sample_p10"} <= set(found["entropy"][2])
    assert "rewards/length_reward/mean" in found["reward"][2]
    steps, values = found["reward"][2]["reward"]
    assert steps == [1, 2] and len(values) == 2


def test_cli_report_command(run_dir, capsys):
    cli.main(["report", run_dir])
    assert "grpotrl report: 15 panels" in capsys.readouterr().out
    assert os.path.getsize(os.path.join(run_dir, "report", "report.png")) > 50_000


def test_gad_discriminator_and_a_stopped_run_read_from_its_checkpoint(tmp_path):
    """A run stopped by a health rule has trainer_state.json only in checkpoint-N/."""
    history = [{"step": s, "reward": 0.1 * s, "gad/d_acc": 0.5 + 0.1 * s, "gad/d_loss": 0.7 - 0.1 * s,
                "gad/teacher_score": 1.0, "gad/student_score": -s} for s in (1, 2, 3)]
    for step in (1, 3):  # the newest checkpoint wins
        os.makedirs(tmp_path / f"checkpoint-{step}")
        with open(tmp_path / f"checkpoint-{step}" / "trainer_state.json", "w") as f:
            json.dump({"log_history": history[:step]}, f)
    paths = report.write_report(str(tmp_path))
    assert set(paths) == {"reward", "discriminator", "discriminator_scores", "report"}
    assert report.panels(history)["discriminator"][0] == "GAD discriminator"
    assert os.path.dirname(paths["report"]) == str(tmp_path / "report")


def test_sampler_mismatch_and_raw_ratio_panels():
    """The sampler/trainer gap, I10's step-0 gaps and the raw (untruncated) ratios are drawn."""
    history = [{"step": s, "sampling/sampler_trainer_logp_gap/mean": 0.2, "sampling/sampler_trainer_logp_gap/max": 1.5,
                "sampling/raw_ratio/token/mean": 1.1, "sampling/raw_ratio/token/min": 0.3,
                "sampling/raw_ratio/seq/max": 9.0, "sampling/raw_ratio/token/outside_share": 0.1,
                "sampling/importance_sampling_ratio/mean": 1.0} for s in (1, 2)]
    history[0]["identity/step0_ref_logp_gap/max"] = 1e-6
    found = report.panels(history)
    assert set(found["sampler_mismatch"][2]) == {"sampling/sampler_trainer_logp_gap/mean",
                                                 "sampling/sampler_trainer_logp_gap/max",
                                                 "identity/step0_ref_logp_gap/max"}
    assert set(found["raw_ratio"][2]) == {"sampling/raw_ratio/token/mean", "sampling/raw_ratio/token/min",
                                          "sampling/raw_ratio/seq/max", "sampling/importance_sampling_ratio/mean"}


def test_missing_state_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(InputError, match="No trainer_state.json"):
        report.write_report(str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["report", str(tmp_path)])
    assert exit_.value.code == 2 and "grpotrl report: error: No trainer_state.json" in capsys.readouterr().err


@pytest.mark.parametrize("content, expected", [
    ('{"log_history": [{"step": 1, "loss": 1.0}, {"st', r"trainer_state.json is not valid JSON \(line 1, column "
                                                       r"\d+: .*\): it was probably cut short"),
    ("", r"is not valid JSON \(line 1, column 1"),
    ("[1, 2]", r"is a JSON list, not a mapping"),
    ('"text"', r"is a JSON str, not a mapping"),
    ('{"log_history": {"loss": 1}}', r"a mapping whose log_history is a dict"),
    ('{"log_history": [1, 2]}', r"a mapping whose log_history is a list with non-mapping entries"),
])
def test_cut_off_or_non_mapping_state_is_one_error_line(content, expected, tmp_path, capsys):
    """A cut-off or non-mapping trainer_state.json was a raw traceback."""
    (tmp_path / "trainer_state.json").write_text(content)
    with pytest.raises(InputError, match=expected):
        report.write_report(str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["report", str(tmp_path)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("grpotrl report: error: "), err


def test_out_pointing_at_a_file_and_bad_arguments_are_one_error_line(tmp_path, capsys):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "reward": 0.5}]}))
    (tmp_path / "plots").write_text("not a directory")
    for argv, expected in ((["report", str(tmp_path), "--out", str(tmp_path / "plots")], "is a file, not a directory"),
                           (["report"], "The following arguments are required: output_dir"),
                           (["report", str(tmp_path), "--outt", "x"], "Unrecognized arguments: --outt x")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert exit_.value.code == 2 and len(err) == 1 and expected in err[0], err
    assert (tmp_path / "plots").read_text() == "not a directory"


def test_out_that_cannot_be_written_is_one_error_line(tmp_path, capsys):
    """A directory that cannot be created (here under a file; likewise a read-only mount) is an error naming it."""
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "reward": 0.5}]}))
    (tmp_path / "afile").write_text("kept")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["report", str(tmp_path), "--out", str(tmp_path / "afile" / "plots")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(err) == 1, err
    assert "Cannot write the report into" in err[0] and "afile/plots" in err[0], err
    assert (tmp_path / "afile").read_text() == "kept"
