"""Two faults around checkpoints, through the CLI as a user meets them (``python -m grpotrl.cli``
subprocesses): one ``grpotrl sft: error: ...`` line and a non-zero exit, no traceback.

* Resuming a checkpoint written by a model of another architecture: refused from the checkpoint's
  ``config.json`` (LoRA: ``adapter_config.json``) before the model loads, naming the field and both
  values. The CLI runs through ``NO_LOAD``, whose ``from_pretrained`` fails loudly if reached.
* A full disk while a checkpoint is written (a real one: a small tmpfs, mounted as root): the file,
  "no space left on device" and the last complete checkpoint, nothing already on disk lost, and the
  incomplete ``checkpoint-N`` refused by the next resume.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpotrl import checkpoints
from grpotrl.errors import InputError

NO_LOAD = """
import sys
import transformers
from grpotrl.cli import main

def refuse(*args, **kwargs):
    raise AssertionError("the model was loaded before the resume checkpoint was checked")

transformers.PreTrainedModel.from_pretrained = refuse
main(sys.argv[1:])
"""

SFT = ["--dataset_name", "quickstart", "--per_device_train_batch_size", "2", "--max_length", "64",
       "--save_strategy", "steps", "--save_steps", "1", "--use_cpu", "true", "--report_to", "none",
       "--disable_tqdm", "true", "--seed", "7"]


def env() -> dict:
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def sft(*args: str, no_load: bool = False) -> subprocess.CompletedProcess:
    runner = ["-c", NO_LOAD] if no_load else ["-m", "grpotrl.cli"]
    return subprocess.run([sys.executable, *runner, "sft", *SFT, *args], env=env(), capture_output=True, text=True,
                          timeout=300)


def sft_here(*args: str) -> None:
    """``sft(*args)`` in this process (``cli.main``): for the runs that only write the checkpoint a test resumes
    (a subprocess would pay torch's, transformers' and TRL's imports again, ~5 s on 2 cores)."""
    from grpotrl import cli

    cli.main(["sft", *SFT, *args])


def one_error_line(run: subprocess.CompletedProcess) -> str:
    """The run's ``grpotrl sft: error:`` line, checked to be the whole failure (exit 2, no traceback)."""
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("grpotrl sft: error: "), run.stderr[-3000:]
    return line


# ---------------------------------------------------------------------------------------------
# A checkpoint of another architecture
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory, tiny_llama) -> Path:
    """checkpoint-1 of a 1-step SFT run of ``tiny_llama`` (full weights)."""
    out = tmp_path_factory.mktemp("llama-run")
    sft_here("--model_name_or_path", tiny_llama, "--max_steps", "1", "--output_dir", str(out / "run"))
    return out / "run" / "checkpoint-1"


def narrower_llama(tiny_llama: str, where: Path) -> str:
    """``tiny_llama`` with hidden_size 32 in its config.json (the preflight reads no weights)."""
    shutil.copytree(tiny_llama, where)
    config = json.loads((where / "config.json").read_text())
    config.update(hidden_size=32, head_dim=8)
    (where / "config.json").write_text(json.dumps(config))
    return str(where)


@pytest.mark.parametrize("other", ["gpt2", "llama with hidden_size 32"])
def test_cli_refuses_a_checkpoint_of_another_architecture_before_the_model_loads(llama_checkpoint, tiny_gpt2,
                                                                                tiny_llama, tmp_path, other):
    model, expected = {
        "gpt2": (tiny_gpt2, "model_type is 'llama' in its config.json but 'gpt2' in this run's model; architectures "
                            "is ['LlamaForCausalLM'] in its config.json but ['GPT2LMHeadModel']"),
        "llama with hidden_size 32": (None, "hidden_size is 64 in its config.json but 32 in this run's model"),
    }[other]
    model = model or narrower_llama(tiny_llama, tmp_path / "narrow")
    run = sft("--model_name_or_path", model, "--max_steps", "2", "--output_dir", str(tmp_path / "out"),
              "--resume_from_checkpoint", str(llama_checkpoint), no_load=True)
    line = one_error_line(run)  # NO_LOAD's AssertionError (a traceback) had the model loaded first
    assert f"Checkpoint '{llama_checkpoint}' was written by a model of another architecture than this run's " \
           f"{model}" in line
    assert expected in line and "Resume with the model that wrote it" in line, line


def test_lora_checkpoint_of_another_rank_is_refused_before_the_model_loads(tiny_llama, tmp_path):
    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj", "--lora_alpha", "8"]
    sft_here("--model_name_or_path", tiny_llama, *lora, "--lora_r", "4", "--max_steps", "1",
             "--output_dir", str(tmp_path / "run"))
    checkpoint = tmp_path / "run" / "checkpoint-1"
    assert (checkpoint / "adapter_config.json").is_file()
    run = sft("--model_name_or_path", tiny_llama, *lora, "--lora_r", "8", "--max_steps", "2", "--output_dir",
              str(tmp_path / "run"), "--resume_from_checkpoint", str(checkpoint), no_load=True)
    line = one_error_line(run)
    assert f"LoRA checkpoint '{checkpoint}' holds adapters of another shape than this run makes: lora r is 4 in " \
           f"{checkpoint / 'adapter_config.json'} but 8 in this run's settings" in line, line


# ---------------------------------------------------------------------------------------------
# A full disk while a checkpoint is written
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """``mount(size_kib) -> Path``: a tmpfs of that size, unmounted afterwards. Needs root (CI runs as
    root); elsewhere the test is skipped, saying so."""
    mounted = []

    def mount(size_kib: int) -> Path:
        where = tmp_path / "disk"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"a full disk needs a small tmpfs, and mounting one is not permitted here (not root?): "
                        f"{done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("steps", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: a later checkpoint, the same path
def test_full_disk_while_a_checkpoint_is_written_names_the_file_and_the_last_complete_checkpoint(
        small_disk, tiny_llama, steps):
    """Sized so that the checkpoints before step ``steps`` fit and the model of step ``steps`` fits too,
    but not its AdamW state (2 x the weights): torch.save fails in optimizer.pt with "unexpected pos"."""
    model_dir = sum(p.stat().st_size for p in Path(tiny_llama).iterdir())
    weights = (Path(tiny_llama) / "model.safetensors").stat().st_size
    checkpoint = model_dir + 2 * weights  # weights, tokenizer, config + optimizer.pt
    disk = small_disk(((steps - 1) * checkpoint + model_dir + weights) // 1024)
    out = disk / "out"
    run = sft("--model_name_or_path", tiny_llama, "--max_steps", str(steps), "--output_dir", str(out))
    line = one_error_line(run)
    last = str(out / "checkpoint-1") if steps == 2 else "none yet"
    assert f"No space left on device while writing {out / f'checkpoint-{steps}' / 'optimizer.pt'} (the checkpoint " \
           f"of step {steps};" in line, line
    assert f"Last complete checkpoint: {last}." in line, line
    # nothing on disk lost; the cut-short checkpoint is never taken for a complete one
    required = ("grpotrl_template.json",)
    with pytest.raises(InputError, match=rf"checkpoint-{steps}' is incomplete: .*optimizer.pt is \d+ bytes and not "
                                         r"a complete torch.save file"):
        checkpoints.find_last_checkpoint(str(out), required)
    if steps == 2:
        assert checkpoints.checkpoint_problems(str(out / "checkpoint-1"), required) == []
