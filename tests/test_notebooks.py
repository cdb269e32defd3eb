"""Every notebook in notebooks/ runs top to bottom, and is stored with current outputs.

Stored outputs (so the docs site and GitHub show the plots) come from ``scripts/run_notebooks.py``
(``make notebooks``), which records a hash of the code cells in the notebook's metadata; the
stored-output tests compare it with the code cells as they are, and refuse error outputs, unexecuted
cells, a plotting cell without its PNG, and an output that shows the machine that ran it rather than
the code: a warning, a tqdm progress bar, an absolute path. They read JSON only: fast, in the default run.

Each notebook is also executed with nbclient on a kernel that runs THIS interpreter
(``sys.executable``): the kernel spec is written to a temporary directory rather than looked
up, because a user-level ``python3`` spec (``~/.local/share/jupyter``) can point at another
Python. The kernel imports the grpotrl of this checkout (``PYTHONPATH``), runs with the
notebook's directory as cwd, writes under a temporary ``GRPOTRL_NB_OUT`` and never reaches the
network (``HF_HUB_OFFLINE=1``). A failing cell fails the test with the cell's traceback.

Times on 2 CPU cores (2026-11-27): 00, 01, 03, 04 and 05 train SmolLM2-135M for a few steps (56, 65, 75,
101 and 76 s; 03 also starts ``transformers serve`` as its judge; 04 runs 3 CAGrad steps on two tasks; 05
runs SFT, then GAD with its discriminator); 02 runs tiny random models (29 s). 01, 03, 04 and 05 are
marked slow: ``make test-all`` runs them, ``make test`` (CI) does not; what they train is tested apart
(tests/cli, tests/trainers, tests/rewards). 00 runs in the default run with 2 GRPO steps instead of its 5
(``SHORTER``), and as stored in ``make test-all``.
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
SLOW = {"01_sft_then_grpo", "02_guards", "03_judges", "04_multitask_cagrad", "05_gad"}  # 27-101 s each on 2 cores; 00 in
# the default run (02's guards are tests/guards')
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


# The default run executes 00_quickstart with its GRPO run shortened (the stored notebook is unchanged: its outputs
# are a full run's, from `make notebooks`): every cell runs, on 2 training steps instead of 5 (~4 s a step on 2
# cores). Each edit must match the code cells exactly once, or the test fails: it never silently runs the notebook
# as stored. The ``-as-stored`` parameter, slow, runs it unedited (`make test-all`).
SHORTER = {"00_quickstart": [("    max_steps=5,\n", "    max_steps=2,\n")]}


def _params():
    params = [pytest.param(p, False, id=p.stem, marks=[pytest.mark.slow] if p.stem in SLOW else [])
              for p in _notebooks()]
    # slow: the shortened run above executes every cell of the same code in the default run
    params += [pytest.param(NOTEBOOKS / f"{stem}.ipynb", True, id=f"{stem}-as-stored", marks=[pytest.mark.slow])
               for stem in SHORTER]
    return params


def _shorten(nb, stem: str) -> None:
    """Applies ``SHORTER[stem]`` to ``nb``'s code cells in place; each edit must match exactly once."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    for old, new in SHORTER.get(stem, []):
        hits = [c for c in code if old in c.source]
        assert len(hits) == 1 and hits[0].source.count(old) == 1, \
            f"{stem}: the test's edit {old!r} -> {new!r} (SHORTER) matches {len(hits)} code cells: update SHORTER"
        hits[0].source = hits[0].source.replace(old, new)


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


def _stream(name, text):
    return {"output_type": "stream", "name": name, "text": text}


# Outputs once stored in these notebooks, each of which a reader would have taken for part of the result.
MACHINE_OUTPUTS = {
    "tqdm's IProgress warning": ("a warning", _stream(
        "stderr", "/work/main/.venv/lib/python3.11/site-packages/tqdm/auto.py:21: TqdmWarning: IProgress not found. "
                  "Please update jupyter and ipywidgets.\n  from .autonotebook import tqdm as notebook_tqdm\n")),
    "a FutureWarning from a library": ("a warning", _stream(
        "stderr", "modeling_utils.py:3312: FutureWarning: `is_gradient_checkpointing` is deprecated\n"
                  "  warnings.warn(\n")),
    "DeepSpeed's no-GPU log line": ("a warning", _stream(
        "stdout", "[2026-11-24 21:36:10,301] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator "
                  "to CPU. If you have GPU or other accelerator, we were unable to detect it.\n")),
    "a weights-loading bar": ("a progress bar", _stream(
        "stderr", "\rLoading weights: 100%|##########| 272/272 [00:00<00:00, 5543.79it/s]")),
    "a temporary output folder": ("a path of the machine", _stream(
        "stdout", "grpotrl 0.1.0 | writing to /tmp/grpotrl-nb-5sjhpzhu/out/00_quickstart\n")),
    "a checkpoint path in an error": ("a path of the machine", _stream(
        "stdout", "[I2] The checkpoint '/work/main/outputs/01_sft_then_grpo/sft' was trained with another template")),
    "a home directory": ("a path of the machine", {
        "output_type": "execute_result", "execution_count": 1, "metadata": {},
        "data": {"text/plain": "PosixPath('/home/alice/.cache/grpotrl/models/smollm2-135m-instruct')"}}),
    "the root's model cache": ("a path of the machine", _stream(
        "stderr", "LlamaForSequenceClassification LOAD REPORT from: /root/.cache/grpotrl/models/smollm2\n")),
    "a virtualenv": ("a path of the machine", _stream("stdout", "lib/python3.11/site-packages/trl/__init__.py\n")),
}


@pytest.mark.parametrize("case", MACHINE_OUTPUTS)
def test_outputs_about_the_machine_are_named(case):
    """A warning, a progress bar or a path of the machine that executed the notebook, stored as an
    output, is a problem that names the cell: the docs site would show it as if it were the result."""
    script = _run_notebooks_script()
    path = NOTEBOOKS / "00_quickstart.ipynb"
    stored = json.loads(path.read_text())
    what, output = MACHINE_OUTPUTS[case]
    cell = next(i for i, c in enumerate(stored["cells"]) if c["cell_type"] == "code")
    stored["cells"][cell]["outputs"].append(output)
    found = script.problems(stored, path.stem)
    assert any(p.startswith(f"{path.stem}: code cell {cell} stored {what}") for p in found), found


def test_outputs_that_only_look_like_machine_paths_pass():
    """URLs, paths relative to the notebook and ``~`` are what a reader's own run prints."""
    script = _run_notebooks_script()
    path = NOTEBOOKS / "00_quickstart.ipynb"
    stored = json.loads(path.read_text())
    cell = next(c for c in stored["cells"] if c["cell_type"] == "code")
    cell["outputs"].append(_stream("stdout", "judge server ready at http://127.0.0.1:42091/v1\n"
                                             "writing to outputs/00_quickstart\n"
                                             "see https://ipywidgets.readthedocs.io/en/stable/user_install.html\n"
                                             "converted once to ~/.cache/grpotrl/models/\n"
                                             "[I1] row 0: the loss is computed on other prompt ids (a warning)\n"))
    assert script.problems(stored, path.stem) == []


def test_home_directory_is_stored_as_tilde(tmp_path, monkeypatch):
    script = _run_notebooks_script()
    monkeypatch.setenv("HOME", str(tmp_path / "alice"))
    nb = {"cells": [{"cell_type": "code", "source": "", "outputs": [
        _stream("stderr", f"LOAD REPORT from: {tmp_path}/alice/.cache/grpotrl/models/m\n"),
        {"output_type": "display_data", "metadata": {}, "data": {"text/plain": [f"{tmp_path}/alice\n", "x"]}}]}]}
    script.home_as_tilde(nb)
    outputs = nb["cells"][0]["outputs"]
    assert outputs[0]["text"] == "LOAD REPORT from: ~/.cache/grpotrl/models/m\n"
    assert outputs[1]["data"]["text/plain"] == "~\nx"


def test_the_shortened_quickstart_is_the_stored_one_with_fewer_steps():
    """The edit the default run makes to 00_quickstart hits its one GRPOConfig, and a notebook where it does not
    match is refused, not run as stored."""
    import nbformat

    nb = nbformat.read(NOTEBOOKS / "00_quickstart.ipynb", as_version=4)
    before = [c.source for c in nb.cells]
    _shorten(nb, "00_quickstart")
    changed = [(b, c.source) for b, c in zip(before, nb.cells) if b != c.source]
    assert len(changed) == 1 and "GRPOConfig(" in changed[0][1] and "max_steps=2," in changed[0][1]
    with pytest.raises(AssertionError, match="matches 0 code cells"):
        _shorten(nb, "00_quickstart")  # already edited: max_steps=5 is gone


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


@pytest.mark.parametrize("path, as_stored", _params())
def test_notebook_runs(path, as_stored, kernel_manager_factory, tmp_path, monkeypatch):
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
    if not as_stored:
        _shorten(nb, path.stem)
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
