"""Ctrl-C in the first seconds of ``grpotrl ...``, while torch, transformers and TRL are imported: the CLI's
one line and exit 130, as later in the run, not a KeyboardInterrupt traceback. ``import grpotrl`` imports none
of them (its exports load on first use), so the command's Ctrl-C handling is in place before they load."""

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import grpotrl

VENV_BIN = Path(sys.executable).parent
INSIDE_TORCH = re.compile(r"^import time:.*\|\s*torch\.\S+$")  # a torch submodule finished: torch is loading


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.strip()


def test_import_grpotrl_imports_no_torch_transformers_or_trl():
    out = _python("import sys, grpotrl, grpotrl.cli; "
                  "print(sorted(m for m in ('torch', 'transformers', 'trl', 'numpy') if m in sys.modules))")
    assert out == "[]", out


def test_exports_load_on_first_use_and_are_the_classes_themselves():
    """Control (passes before and after): ``__all__``, ``dir()``, ``from grpotrl import ...`` and attribute
    access give the same objects as their modules; a subpackage is an attribute too; a typo is an AttributeError."""
    from grpotrl import GRPOTrainer, InputError, SFTConfig
    from grpotrl.configs import SFTConfig as config_sft
    from grpotrl.errors import InputError as error_input
    from grpotrl.trainers.grpo import GRPOTrainer as trainer_grpo

    assert grpotrl.__all__ == ["GRPOConfig", "SFTConfig", "GADConfig", "GRPOTrainer", "MultiTaskGRPOTrainer",
                               "SFTTrainer", "GADTrainer", "InputError", "InvariantError", "HealthStop"]
    assert set(grpotrl.__all__) <= set(dir(grpotrl))
    assert (GRPOTrainer, InputError, SFTConfig) == (trainer_grpo, error_input, config_sft)
    assert grpotrl.GRPOTrainer is trainer_grpo and grpotrl.guards.check_stops is not None
    assert all(getattr(grpotrl, name) is not None for name in grpotrl.__all__)
    with pytest.raises(AttributeError, match="module 'grpotrl' has no attribute 'GRPOTrainr'"):
        grpotrl.GRPOTrainr  # noqa: B018


def test_the_star_import_gives_every_export_and_thread_defaults_come_first():
    """``from grpotrl import *`` binds all of ``__all__``; OMP_WAIT_POLICY is set before torch is imported."""
    out = _python("import os, sys; os.environ.pop('OMP_WAIT_POLICY', None); import grpotrl; "
                  "print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules); "
                  "from grpotrl import *; print(all(n in globals() for n in grpotrl.__all__))")
    assert out.splitlines() == ["PASSIVE False", "True"], out


@pytest.mark.parametrize("command", [
    [str(VENV_BIN / "grpotrl")],  # the console script: grpotrl.cli:main, after `import grpotrl`
    [sys.executable, "-m", "grpotrl"],
    [sys.executable, "-m", "grpotrl.cli"],  # as accelerate launch -m grpotrl.cli runs it
])
def test_ctrl_c_while_torch_is_imported_is_the_one_line_and_exit_130(command, tmp_path):
    """SIGINT once the child has begun importing torch (``PYTHONPROFILEIMPORTTIME`` prints each module as its
    import ends, so the first ``torch.*`` line says torch is loading; no transformers or TRL module is imported
    before the interrupt lands). It was a KeyboardInterrupt traceback and exit -2: ``import grpotrl`` imported
    torch before ``main`` ran."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_steps: 1\n")
    child = subprocess.Popen(
        [*command, "grpo", "--config", str(recipe)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPROFILEIMPORTTIME": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background shell may ignore SIGINT
    lines, loading = [], threading.Event()

    def read():
        for line in child.stderr:
            lines.append(line.rstrip("\n"))
            if INSIDE_TORCH.match(lines[-1]):
                loading.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert loading.wait(timeout=120), "torch never began to load: " + "\n".join(lines[-20:])
        child.send_signal(signal.SIGINT)
        child.wait(timeout=120)
    finally:
        child.kill()
    reader.join(timeout=30)
    said = [line for line in lines if not line.startswith("import time:")]
    assert not any(re.search(r"\|\s*(transformers|trl)(\.\S+)?$", line) for line in lines), \
        "transformers or TRL was imported before the interrupt landed: it did not land while torch loaded"
    assert child.returncode == 130 and said == ["grpotrl grpo: interrupted."], (child.returncode, said[-30:])
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in lines)
