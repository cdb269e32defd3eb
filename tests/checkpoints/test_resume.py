"""Kill-and-resume: ``grpotrl grpo`` killed with SIGKILL in the middle of step k+1, after its
checkpoint at step k, and resumed with ``--resume_from_checkpoint``, ends with the same weights
as a run that was never interrupted (CPU, fixed seed, sampling at T = 1). The run is built so
that every piece of saved state moves the weights: Adam's moments (optimizer), a linear learning
rate decay (scheduler), sampled completions (RNG), TRL's adaptive entropy coefficient (grows by
``entropy_coef_delta`` each step; its state file is written after trainer_state.json) and the KL
to the reference model. And a checkpoint that a kill during the save left incomplete stops the
resume with an error naming it, before any weights are read.

Each run is a subprocess of ``python -m grpotrl.cli``; the killed one runs the CLI through a
wrapper (``KILLABLE``) whose training step, once step k+1 has done its generation, loss and
backward, writes a marker file and waits; the test then sends SIGKILL. The uninterrupted and the
killed run go side by side. GAD (slow) also brings back its discriminator and D's AdamW.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from grpotrl import checkpoints
from grpotrl.errors import InputError

K, STEPS = 2, 4  # checkpoint at step K, kill during step K + 1, train to STEPS

KILLABLE = """
import os, sys, time
import grpotrl
from grpotrl.cli import main

step, marker = int(os.environ["KILL_DURING_STEP"]), os.environ["KILL_MARKER"]

def killable(original):
    def training_step(self, *args, **kwargs):
        out = original(self, *args, **kwargs)  # generation, loss and backward: the optimizer step is next
        if self.state.global_step == step - 1:
            open(marker, "w").close()
            time.sleep(600)  # until SIGKILL
        return out
    return training_step

for cls in (grpotrl.GRPOTrainer, grpotrl.GADTrainer):  # GAD's warmup steps skip GRPOTrainer's
    cls.training_step = killable(cls.__dict__.get("training_step", cls.training_step))
main(sys.argv[1:])
"""


GAD_DATA = str(Path(__file__).resolve().parents[2] / "grpotrl" / "data" / "gad_toy.jsonl")


def recipe(tmp_path: Path, model: str, **overrides) -> str:
    settings = dict(
        model_name_or_path=model, dtype="float32", dataset_name="quickstart", reward_funcs=["exact_answer", "format"],
        max_steps=STEPS, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        temperature=1.0, learning_rate=1e-2, lr_scheduler_type="linear", beta=0.04, seed=7,
        use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=100.0,  # the bonus acts, its coefficient grows
        generation_kwargs={"sequence_bias": [[[0], 5.0], [[2], 5.0]]},  # rows stop early, at different lengths
        guard_steps=-1, health_action="off", activation_checkpointing=False, disable_tqdm=True,
        logging_steps=1, save_strategy="steps", save_steps=K, report_to="none", use_cpu=True, bf16=False,
    )
    settings.update(overrides)
    settings = {k: v for k, v in settings.items() if v is not None}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(settings))
    return str(path)


def env() -> dict:
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpotrl.cli", *args], env=env(), capture_output=True, text=True,
                          timeout=timeout)


def run_killed_during(step: int, args: list[str], tmp_path: Path, timeout: float = 300) -> None:
    """Run the CLI and SIGKILL it once ``step`` has done its backward (before its optimizer step)."""
    marker = tmp_path / "in-step"
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", KILLABLE, *args], stdout=log, stderr=subprocess.STDOUT,
                            env={**env(), "KILL_DURING_STEP": str(step), "KILL_MARKER": str(marker)})
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"never reached step {step}:\n{(tmp_path / 'killed.log').read_text()[-3000:]}")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def steps_logged(output_dir: Path) -> dict[int, float]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return {e["step"]: e["loss"] for e in history if "loss" in e}


def straight_and_killed(tmp_path: Path, config: str, command: str = "grpo") -> tuple[Path, Path]:
    """The uninterrupted run (checkpoints at steps K and STEPS) and the run killed during step
    K + 1, side by side on the CPU's cores; their output dirs."""
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    with open(tmp_path / "straight.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "grpotrl.cli", command, "--config", config, "--output_dir",
                                 str(straight)], stdout=log, stderr=subprocess.STDOUT, env=env())
        try:
            run_killed_during(K + 1, [command, "--config", config, "--output_dir", str(broken)], tmp_path)
        finally:
            returncode = proc.wait(timeout=300)
    assert returncode == 0, (tmp_path / "straight.log").read_text()[-3000:]
    assert sorted(p.name for p in broken.glob("checkpoint-*")) == [f"checkpoint-{K}"]
    return straight, broken


def max_difference(a: Path, b: Path) -> float:
    want, got = load_file(str(a)), load_file(str(b))
    assert want.keys() == got.keys()
    return max((want[n] - got[n]).abs().max().item() for n in want)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama) -> tuple[str, Path, Path]:
    """(recipe, uninterrupted output dir, killed output dir) of a GRPO run."""
    tmp_path = tmp_path_factory.mktemp("resume")
    config = recipe(tmp_path, tiny_llama)
    return (config, *straight_and_killed(tmp_path, config))


def test_sigkill_during_step_k_plus_1_then_resume_matches_an_uninterrupted_run(runs, tiny_llama):
    config, straight, broken = runs
    checkpoint = broken / f"checkpoint-{K}"
    saved = {p.name for p in checkpoint.iterdir()}
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "grpotrl_template.json",
            "entropy_ctrl_state.json", "model.safetensors"} <= saved
    coef = json.loads((checkpoint / "entropy_ctrl_state.json").read_text())["entropy_coef"]
    assert coef == pytest.approx(0.01 + K * 0.005)  # the controller moved: restoring it matters

    resumed = cli("grpo", "--config", config, "--output_dir", str(broken), "--resume_from_checkpoint", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    # the resumed run trained steps K+1..STEPS only, with the losses of the uninterrupted run
    a, b = steps_logged(straight), steps_logged(broken)
    assert sorted(a) == list(range(1, STEPS + 1)) and sorted(b) == list(range(1, STEPS + 1))
    assert [b[s] for s in range(K + 1, STEPS + 1)] == [a[s] for s in range(K + 1, STEPS + 1)]
    assert max_difference(straight / "model.safetensors", Path(tiny_llama) / "model.safetensors") > 0  # it trained
    worst = max_difference(straight / "model.safetensors", broken / "model.safetensors")
    assert worst == 0.0, f"resumed weights differ from the uninterrupted run's by up to {worst:.3g}"


@pytest.mark.slow
def test_gad_sigkill_during_step_k_plus_1_then_resume_matches_an_uninterrupted_run(tiny_llama, tmp_path):
    """The same for GAD: the discriminator and its AdamW (``discriminator/``) come back too."""
    config = recipe(tmp_path, tiny_llama, dataset_name=GAD_DATA, reward_funcs=None, discriminator_warmup_steps=1,
                    discriminator_learning_rate=1e-3, discriminator_lora_r=0, use_adaptive_entropy=None,
                    entropy_coef=None, entropy_target=None, beta=0.0)
    straight, broken = straight_and_killed(tmp_path, config, "gad")
    discriminator = broken / f"checkpoint-{K}" / "discriminator"
    assert {"model.safetensors", "optimizer.pt"} <= {p.name for p in discriminator.iterdir()}
    resumed = cli("gad", "--config", config, "--output_dir", str(broken), "--resume_from_checkpoint", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for weights in ("model.safetensors", "discriminator/model.safetensors"):
        assert max_difference(straight / weights, Path(tiny_llama) / "model.safetensors"
                              if weights == "model.safetensors" else broken / f"checkpoint-{K}" / weights) > 0
        worst = max_difference(straight / weights, broken / weights)
        assert worst == 0.0, f"resumed {weights} differs from the uninterrupted run's by up to {worst:.3g}"


# ---------------------------------------------------------------------------------------------
# What a kill during the save leaves: an error naming the directory, before any weights are read
# ---------------------------------------------------------------------------------------------

def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


REQUIRED = ("grpotrl_template.json", "entropy_ctrl_state.json")
DAMAGE = {  # what a SIGKILL at some point of the save leaves behind, newest file first
    "entropy_ctrl_state.json missing": lambda d: (d / "entropy_ctrl_state.json").unlink(),
    "trainer_state.json missing": lambda d: (d / "trainer_state.json").unlink(),
    "trainer_state.json cut short": lambda d: truncate(d / "trainer_state.json"),
    "rng_state.pth missing": lambda d: (d / "rng_state.pth").unlink(),
    "scheduler.pt missing": lambda d: (d / "scheduler.pt").unlink(),
    "optimizer.pt missing": lambda d: (d / "optimizer.pt").unlink(),
    "optimizer.pt cut short": lambda d: truncate(d / "optimizer.pt"),
    "model.safetensors cut short": lambda d: truncate(d / "model.safetensors"),
    "grpotrl_template.json missing": lambda d: (d / "grpotrl_template.json").unlink(),
    # a crash before the file system wrote a file's data leaves it empty; a resume reads these three
    "config.json empty": lambda d: (d / "config.json").write_text(""),
    "weights index empty": lambda d: (d / "model.safetensors.index.json").write_text(""),
    "pytorch_model.bin empty": lambda d: ((d / "model.safetensors").unlink(), (d / "pytorch_model.bin").touch()),
}
EXPECTED = {
    "entropy_ctrl_state.json missing": "no entropy_ctrl_state.json",
    "trainer_state.json missing": "no trainer_state.json",
    "trainer_state.json cut short": "trainer_state.json is not valid JSON",
    "rng_state.pth missing": "no rng_state.pth",
    "scheduler.pt missing": "no scheduler.pt",
    "optimizer.pt missing": "no optimizer.pt",
    "optimizer.pt cut short": "optimizer.pt is .* not a complete torch.save file",
    "model.safetensors cut short": "model.safetensors is .* bytes",
    "grpotrl_template.json missing": "no grpotrl_template.json",
    "config.json empty": "config.json is not valid JSON",
    "weights index empty": "model.safetensors.index.json is not valid JSON",
    "pytorch_model.bin empty": "pytorch_model.bin is 0 bytes and not a complete torch.save file",
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_incomplete_checkpoint_is_refused_naming_it_and_the_complete_one(runs, tmp_path, damage):
    out = tmp_path / "out"
    shutil.copytree(runs[1], out)
    last = out / f"checkpoint-{STEPS}"
    DAMAGE[damage](last)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    for given in (str(last), True):  # the path itself, and resume_from_checkpoint: true (newest checkpoint-N)
        with pytest.raises(InputError, match=rf"checkpoint-{STEPS}' is incomplete: .*{EXPECTED[damage]}.*"
                                             rf"--resume_from_checkpoint {out / f'checkpoint-{K}'}"):
            if given is True:
                checkpoints.find_last_checkpoint(str(out), REQUIRED)
            else:
                checkpoints.check_resume_checkpoint(given, REQUIRED)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing deleted
    checkpoints.check_resume_checkpoint(str(out / f"checkpoint-{K}"), REQUIRED)


def test_cli_refuses_an_incomplete_newest_checkpoint_before_loading_weights(runs, tiny_llama, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    from grpotrl import cli as grpotrl_cli

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the checkpoint was checked")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", refuse)
    out = tmp_path / "out"
    shutil.copytree(runs[1], out)
    (out / f"checkpoint-{STEPS}" / "optimizer.pt").unlink()  # the Trainer would resume with a fresh Adam, silently
    with pytest.raises(InputError, match=rf"checkpoint-{STEPS}' is incomplete: no optimizer.pt.*"
                                         rf"--resume_from_checkpoint {out / f'checkpoint-{K}'}"):
        grpotrl_cli.run("grpo", ["--config", recipe(tmp_path, tiny_llama), "--output_dir", str(out),
                                 "--resume_from_checkpoint", "true"])
    assert (out / f"checkpoint-{STEPS}").is_dir()


def test_resuming_inside_a_generation_batch_warns_that_it_cannot_be_exact(caplog):
    from types import SimpleNamespace

    from grpotrl.checkpoints import _warn_mid_generation

    # steps_per_generation=4, grad_accum=2: one generation feeds 2 optimizer steps; checkpoint-3 is mid-batch
    args = SimpleNamespace(steps_per_generation=4, num_iterations=1, gradient_accumulation_steps=2)
    _warn_mid_generation("out/checkpoint-4", args, "grpo")
    assert not caplog.records
    _warn_mid_generation("out/checkpoint-3", args, "grpo")
    assert "inside a generation batch" in caplog.text and "multiples of 2 optimizer steps" in caplog.text


def test_I2_train_resume_from_another_checkpoint_compares_this_runs_chat_template_kwargs(runs, tiny_llama, tmp_path,
                                                                                           monkeypatch):
    """``train(resume_from_checkpoint=X)`` with X not the config's value: X is checked as the preflight
    checks its own (complete, and I2 with the run's ``chat_template_kwargs``) before TRL resumes."""
    import transformers
    from conftest import arithmetic_prompts, length_reward
    from test_sft_trainer import TOY_TEMPLATE
    from transformers import AutoTokenizer

    import grpotrl
    from grpotrl import InvariantError
    from grpotrl.chat import templates

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = TOY_TEMPLATE  # its generation prompt reads enable_thinking
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(runs[1] / f"checkpoint-{K}", checkpoint)
    templates.save_fingerprint(str(checkpoint), tok, chat_template_kwargs=[{"enable_thinking": False}])
    resumed_from = []
    monkeypatch.setattr(transformers.Trainer, "train", lambda self, resume_from_checkpoint=None, *a, **k:
                        resumed_from.append(resume_from_checkpoint))

    def trainer(**kwargs):
        args = grpotrl.GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                                  max_completion_length=8, max_steps=1, report_to="none", use_cpu=True, **kwargs)
        return grpotrl.GRPOTrainer(model=tiny_llama, reward_funcs=length_reward, args=args, processing_class=tok,
                                   train_dataset=arithmetic_prompts(8))

    with pytest.raises(InvariantError, match=r"(?s)\[I2\].*enable_thinking.*false.*this run's \{\}"):
        trainer().train(resume_from_checkpoint=str(checkpoint))
    assert resumed_from == []  # refused before TRL's train
    trainer(chat_template_kwargs={"enable_thinking": False}).train(resume_from_checkpoint=str(checkpoint))
    assert resumed_from == [str(checkpoint)]
