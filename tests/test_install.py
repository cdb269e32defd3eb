"""Installed, not only cloned: a non-editable install of the package (``pip install .``), imported from
another directory, ships its data, runs the README's Python example (model by Hub id, from the session's
offline HF cache) and ``grpotrl grpo --config <recipe>``."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """``pip install --no-deps .`` into a fresh target directory (the dependencies come from this venv)."""
    target = tmp_path_factory.mktemp("site-packages")
    build = tmp_path_factory.mktemp("build")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                           "--disable-pip-version-check", "--target", str(target), str(ROOT)],
                          capture_output=True, text=True, timeout=600, cwd=build)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def run_installed(target: Path, args: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(target)}  # before the editable install of the checkout
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_installed_package_is_imported_and_ships_its_data(installed, tmp_path):
    proc = run_installed(installed, [sys.executable, "-c", (
        "import grpotrl, grpotrl.data as d; print(grpotrl.__file__); "
        "print(len(d.load_quickstart('train')), len(d.load_multitask('train')))")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, sizes = proc.stdout.split()[0], proc.stdout.split()[1:]
    assert where.startswith(str(installed)), f"imported {where}, not the installed copy"
    assert all(int(n) > 0 for n in sizes)


def readme_example() -> str:
    """The README's first Python example that builds a trainer, cut to one step."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    code = next(b for b in blocks if "GRPOTrainer(" in b)
    assert 'model="HuggingFaceTB/SmolLM2-135M-Instruct"' in code, "the README's example names its model by Hub id"
    short = code.replace("max_steps=5", "max_steps=1").replace("max_completion_length=16", "max_completion_length=8")
    assert short != code
    return short


def test_readme_example_runs_from_the_installed_package(installed, hub_smollm2, tmp_path):
    proc = run_installed(installed, [sys.executable, "-c", readme_example()], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "outputs" / "demo").is_dir()


def test_cli_recipe_runs_from_the_installed_package(installed, hub_tiny_llama, tmp_path):
    recipe = ROOT / "recipes" / "smollm2" / "grpo_quickstart.yaml"
    proc = run_installed(installed, [str(installed / "bin" / "grpotrl"), "grpo", "--config", str(recipe),
                                     "--model_name_or_path", hub_tiny_llama, "--output_dir", str(tmp_path / "out"),
                                     "--max_steps", "1", "--max_completion_length", "8",
                                     "--per_device_train_batch_size", "4", "--save_strategy", "no"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()
