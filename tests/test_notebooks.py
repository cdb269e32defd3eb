"""Every notebook in notebooks/ runs top to bottom, and is stored with current outputs.

Stored outputs (so the docs site and GitHub show the plots) come from ``scripts/run_notebooks.py``
(``make notebooks``), which records a hash of the code cells in the notebook's metadata; the
stored-output tests compare it with the code cells as they are, and refuse error outputs, unexecuted
cells and a plotting cell without its PNG. They read JSON only: fast, in the default run.

Each notebook is also executed with nbclient on a kernel that runs THIS interpreter
(``sys.executable``): the kernel spec is written to a temporary directory rather than looked
up, because a user-level ``python3`` spec (``~/.local/share/jupyter``) can point at another
Python. The kernel imports the grpotrl of this checkout (``PYTHONPATH``), runs with the
notebook's directory as cwd, writes under a temporary ``GRPOTRL_NB_OUT`` and never reaches the
network (``HF_HUB_OFFLINE=1``). A failing cell fails the test with the cell's traceback.

Times on 2 CPU cores: 00, 01, 03, 04 and 05 train SmolLM2-135M for a few steps (about a minute or
more each, marked slow; 03 also starts ``transformers serve`` as its judge; 04 runs 3 CAGrad steps
on two tasks; 05 runs SFT, then GAD with its discriminator, 2-4 minutes); 02 runs tiny random
models (well under a minute).
"""

import copy
import importlib.util
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
REPO = NOTEBOOKS.parent
SLOW = {"00_quickstart", "01_sft_then_grpo", "03_judges", "04_multitask_cagrad", "05_gad"}  # > 60 s on 2 cores
CELL_TIMEOUT_S = 600
MAX_STORED_BYTES = 1_000_000  # PNG plots at the inline backend's default size are ~30-60 KB each


def _run_notebooks_script():
    """scripts/run_notebooks.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("run_notebooks", REPO / "scripts" / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _params():
    return [pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if p.stem in SLOW else []) for p in _notebooks()]


def test_notebooks_exist():
    names = [p.stem for p in _notebooks()]
    assert names == ["00_quickstart", "01_sft_then_grpo", "02_guards", "03_judges", "04_multitask_cagrad", "05_gad"]


@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: p.stem)
def test_notebook_outputs_are_stored_and_current(path):
    """Stored outputs are those of the code as it is: `make notebooks` re-executes and stores them."""
    problems = _run_notebooks_script().problems(json.loads(path.read_text()), path.stem)
    assert not problems, "\n".join(problems)
    assert path.stat().st_size < MAX_STORED_BYTES, f"{path.name} is {path.stat().st_size} bytes stored"


def test_stale_or_failed_outputs_are_named():
    """The freshness check can fail: an edited code cell, an error output and a plot without its PNG."""
    script = _run_notebooks_script()
    path = NOTEBOOKS / "00_quickstart.ipynb"
    stored = json.loads(path.read_text())
    assert script.problems(stored, path.stem) == []

    edited = copy.deepcopy(stored)
    code = next(c for c in edited["cells"] if c["cell_type"] == "code")
    code["source"] = "".join(code["source"]) + "\nprint('edited')"
    assert any("code cells changed" in p for p in script.problems(edited, path.stem))

    failed = copy.deepcopy(stored)
    code = next(c for c in failed["cells"] if c["cell_type"] == "code")
    code["outputs"].append({"output_type": "error", "ename": "ValueError", "evalue": "boom", "traceback": []})
    assert any("ValueError: boom" in p for p in script.problems(failed, path.stem))

    no_plot = copy.deepcopy(stored)
    plotting = [c for c in no_plot["cells"] if c["cell_type"] == "code" and "plt." in "".join(c["source"])]
    assert plotting, "00_quickstart draws its reward and entropy curves"
    for cell in plotting:
        cell["outputs"] = [o for o in cell["outputs"] if "image/png" not in o.get("data", {})]
    assert any("stored no PNG" in p for p in script.problems(no_plot, path.stem))

    unhashed = copy.deepcopy(stored)
    del unhashed["metadata"]["grpotrl"]
    assert any("no recorded code hash" in p for p in script.problems(unhashed, path.stem))


@pytest.fixture(scope="module")
def kernel_manager_factory(tmp_path_factory):
    """Kernel managers for a kernel spec that runs sys.executable (ipykernel's own launcher)."""
    try:
        from ipykernel.kernelspec import write_kernel_spec
    except ImportError:
        pytest.fail("executing notebooks needs the dev extra: pip install -e '.[dev]'")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    kernels = tmp_path_factory.mktemp("jupyter") / "kernels"
    write_kernel_spec(str(kernels / "grpotrl-test"))
    specs = KernelSpecManager(kernel_dirs=[str(kernels)])
    assert specs.get_kernel_spec("grpotrl-test").argv[0] == sys.executable

    return lambda: KernelManager(kernel_name="grpotrl-test", kernel_spec_manager=specs)


@pytest.mark.parametrize("path", _params())
def test_notebook_runs(path, kernel_manager_factory, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    # The kernel inherits this environment.
    monkeypatch.setenv("GRPOTRL_NB_OUT", str(tmp_path))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter-runtime"))  # connection files
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))

    nb = nbformat.read(path, as_version=4)
    km = kernel_manager_factory()
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(path.parent)}})
    start, cpu = time.perf_counter(), _children_cpu_s()
    try:
        client.execute()
    except CellExecutionError as err:
        pytest.fail(f"{path.name} failed:\n{err}", pytrace=False)
    finally:
        if km.has_kernel:  # nbclient leaves a kernel it did not create running; a clean exit runs
            km.shutdown_kernel()  # the notebook's atexit hooks (03 stops its judge server there)
    # the kernel's CPU time counts once it has exited: on a busy machine wall time says little
    print(f"{path.name}: {time.perf_counter() - start:.0f} s wall, kernel CPU {_children_cpu_s() - cpu:.0f} s")
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    if "plt." in "".join(c.source for c in nb.cells):
        assert images, f"{path.name} draws a plot but no image came out"
