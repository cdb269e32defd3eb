"""``grpotrl report OUTPUT_DIR`` reads the newest ``trainer_state.json`` by ``global_step``, the top level's or a
``checkpoint-N/``'s, and says which it read. A run that finished (``save_model`` + ``save_state`` at the top level,
step 2), was resumed and then stopped by a health rule at step 3 has its newest state only in ``checkpoint-3/``:
the report used to draw the top level's stale steps 1-2 whenever that file existed."""

import json
import os

import pytest
from conftest import arithmetic_prompts

import grpotrl
from grpotrl import HealthStop, cli, report


def zero_reward(completions, **kwargs):
    """Every group flat: ``flat_rewards`` fires on the step its patience says."""
    return [0.0] * len(completions)


def trainer(model, args) -> grpotrl.GRPOTrainer:
    return grpotrl.GRPOTrainer(model=model, reward_funcs=zero_reward, args=args, train_dataset=arithmetic_prompts())


@pytest.fixture(scope="module")
def resumed_and_stopped(tiny_llama, tmp_path_factory) -> str:
    """Steps 1-2 finished and saved as the CLI saves them; then resumed, and stopped by flat_rewards at step 3."""
    out = str(tmp_path_factory.mktemp("run") / "out")
    common = dict(output_dir=out, per_device_train_batch_size=8, num_generations=4, max_completion_length=4,
                  logging_steps=1, report_to="none", use_cpu=True, guard_steps=0, save_strategy="steps", save_steps=1,
                  seed=0, health_report_steps=0)
    first = trainer(tiny_llama, grpotrl.GRPOConfig(max_steps=2, **common))
    first.train()
    first.save_model(out)
    first.save_state()
    first.end()
    assert report.find_state(out) == os.path.join(out, "trainer_state.json")  # step 2 twice: the top level's
    resumed = trainer(tiny_llama, grpotrl.GRPOConfig(max_steps=4, health_flat_reward_steps=1,
                                                     health_rule_actions={"flat_rewards": "stop"}, **common))
    with pytest.raises(HealthStop) as err:
        resumed.train(resume_from_checkpoint=True)
    resumed.end()
    assert err.value.step == 3 and err.value.checkpoint == os.path.join(out, "checkpoint-3")
    return out


def test_report_reads_the_checkpoint_newer_than_the_top_level_state(resumed_and_stopped):
    out = resumed_and_stopped
    with open(os.path.join(out, "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 2  # the finished run's, left as it was by the stopped resume
    assert report.find_state(out) == os.path.join(out, "checkpoint-3", "trainer_state.json")
    steps, _ = report.panels(report.read_log_history(report.find_state(out)))["reward"][2]["reward"]
    assert steps == [1, 2, 3]


def test_cli_report_says_which_state_it_read(resumed_and_stopped, tmp_path, capsys):
    cli.main(["report", resumed_and_stopped, "--out", str(tmp_path)])
    line = capsys.readouterr().out.strip()
    assert line.startswith("grpotrl report: ") and line.endswith(
        f"in {tmp_path}, from {os.path.join('checkpoint-3', 'trainer_state.json')} (step 3)"), line


def test_an_unreadable_top_level_state_is_still_the_error(tmp_path):
    """A cut-off top-level file cannot be dated: it is read (and refused, naming it), never passed over in silence
    for an older checkpoint."""
    os.makedirs(tmp_path / "checkpoint-1")
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text(
        json.dumps({"global_step": 1, "log_history": [{"step": 1, "reward": 0.5}]}))
    (tmp_path / "trainer_state.json").write_text('{"global_step": 2, "log_history": [{"st')
    with pytest.raises(grpotrl.InputError, match=r"trainer_state.json is not valid JSON"):
        report.write_report(str(tmp_path))
