"""Execute the notebooks and store them WITH their outputs, so the docs site and GitHub show the plots.

    .venv/bin/python scripts/run_notebooks.py                 # every notebook in notebooks/ (`make notebooks`)
    .venv/bin/python scripts/run_notebooks.py 02_guards       # some of them, by name

Each notebook runs top to bottom on a kernel of THIS interpreter (the kernel spec is written to a
temporary directory, so a user-level ``python3`` spec pointing at another Python is never used),
offline (``HF_HUB_OFFLINE=1``), with the grpotrl of this checkout first on ``PYTHONPATH``. Its cwd
is a fresh temporary directory and ``GRPOTRL_NB_OUT`` is unset, so it writes under the default
``outputs/<notebook>`` there and prints that relative path, as a reader's run in notebooks/ does;
nothing is left behind. A failing cell stops the script and leaves the stored notebook as it was.

The kernel's environment drops what only describes the machine that ran it (``KERNEL_WARNINGS``, and
``DS_ACCELERATOR=cpu`` for DeepSpeed, which TRL imports: without it the import logs a WARNING that it
found no GPU); the notebooks turn progress bars off themselves. In the stored outputs the home
directory is written ``~`` (the model cache, ``~/.cache/grpotrl/models``, appears in a load report).

What makes stored outputs current: the script records a SHA-256 of the code cells' sources in
the notebook's metadata (``metadata.grpotrl.code_sha256``). ``problems()`` (run by
tests/test_notebooks.py and by the docs build, scripts/docs_hooks.py) compares it with the code cells as
they are now, and also refuses error outputs, unexecuted code cells, a plotting cell (one that
calls ``plt.``) without a PNG, and an output a reader cannot take at face value: a warning (a
``...Warning`` category, a ``[WARNING]`` log line), a progress bar (the timings of the machine that ran
it) or a path of that machine (``/work/``, ``/tmp/``, ``/root/``, ``/home/``, ``site-packages``, ...).
Edit a code cell, and the test names this script.

Times on 2 CPU cores: 02 well under a minute; 00, 01, 03, 04 a minute or two each; 05 2-4 minutes.
"""

import hashlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
CELL_TIMEOUT_S = 600
COMMAND = "scripts/run_notebooks.py"

# Warnings the kernel never shows (PYTHONWARNINGS: action:message start:category): they describe the
# machine or the installed versions, not the notebook. The first comes from tqdm.auto, imported by
# datasets and transformers, on a Jupyter without ipywidgets; the second from TRL 1.16's
# unwrap_model_for_generation reading `model.is_gradient_checkpointing`, which transformers 5 deprecates.
KERNEL_WARNINGS = ("ignore:IProgress not found:Warning",
                   "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

# What a stored output must not show (``problems()``).
WARNING = re.compile(r"\b[A-Z]\w*Warning\b|\[WARNING\]|warnings\.warn\(")  # FutureWarning: ..., logging's [WARNING]
PROGRESS_BAR = re.compile(r"\d+/\d+ \[\d+:\d+<")  # tqdm: "272/272 [00:00<00:00, 5543.79it/s]"; not the Trainer table
MACHINE_PATH = re.compile(  # an absolute path (not a URL's path, not ~/...), a venv, a Windows drive
    r"(?<![\w.~:/-])/(?:work|tmp|root|home|Users|usr|opt|var|private|mnt|srv|scratch)/|site-packages|\b[A-Z]:\\")


def code_sha256(nb) -> str:
    """SHA-256 over the code cells' sources, in order (markdown cells may change freely)."""
    digest = hashlib.sha256()
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            digest.update(source.encode() + b"\0")
    return digest.hexdigest()


def output_texts(cell) -> list[tuple[str, str]]:
    """``(kind, text)`` of each text a code cell's outputs show: ``stdout``/``stderr`` streams, a result's or a
    display's ``text/plain``/``text/html``, an error's traceback; images are not read."""
    found = []
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream":
            found.append((out.get("name", "stream"), _text(out.get("text", ""))))
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            found += [(mime, _text(data[mime])) for mime in ("text/plain", "text/html") if mime in data]
        elif kind == "error":
            found.append(("traceback", "\n".join(out.get("traceback", []))))
    return found


def _text(value) -> str:
    return value if isinstance(value, str) else "".join(value)


def _excerpt(text: str, match) -> str:
    line_start = text.rfind("\n", 0, match.start()) + 1
    line_end = text.find("\n", match.end())
    return repr(text[line_start:line_end if line_end >= 0 else len(text)][:160])


def problems(nb, name: str) -> list[str]:
    """What makes the stored outputs of notebook ``nb`` (a dict as stored) not current; [] if nothing."""
    found = []
    recorded = nb.get("metadata", {}).get("grpotrl", {}).get("code_sha256")
    if recorded is None:
        found.append("no recorded code hash (metadata.grpotrl.code_sha256): it was not stored by this script")
    elif recorded != code_sha256(nb):
        found.append("its code cells changed since their outputs were stored")
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code" or recorded is None:
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        outputs = cell.get("outputs", [])
        if cell.get("execution_count") is None and source.strip():
            found.append(f"code cell {i} was not executed")
        errors = [o for o in outputs if o.get("output_type") == "error"]
        if errors:
            found.append(f"code cell {i} stored an error: {errors[0].get('ename')}: {errors[0].get('evalue')}")
        if "plt." in source and not any("image/png" in o.get("data", {}) for o in outputs):
            found.append(f"code cell {i} draws a plot but stored no PNG")
        texts = output_texts(cell)
        for what, pattern in (("a warning", WARNING), ("a progress bar", PROGRESS_BAR),
                              ("a path of the machine that ran it", MACHINE_PATH)):
            first = next(((kind, text, m) for kind, text in texts for m in [pattern.search(text)] if m), None)
            if first:  # the first such output of the cell
                found.append(f"code cell {i} stored {what} ({first[0]}): {_excerpt(first[1], first[2])}")
    if found:
        found.append(f"to store current outputs: `.venv/bin/python {COMMAND} {name}` (or `make notebooks`)")
    return [f"{name}: {p}" for p in found]


def home_as_tilde(nb) -> None:
    """Write the home directory as ``~`` in every text output of ``nb`` (in place)."""
    home = str(Path.home())
    if home in ("/", ""):
        return
    pattern = re.compile(re.escape(home) + r"(?!\w)")
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                out["text"] = pattern.sub("~", _text(out["text"]))
            for mime in ("text/plain", "text/html"):
                if mime in out.get("data", {}):
                    out["data"][mime] = pattern.sub("~", _text(out["data"][mime]))


def kernel_specs(kernel_dir: Path):
    """A kernel spec manager holding one spec, ``grpotrl-nb``, that runs sys.executable (ipykernel's launcher)."""
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager

    write_kernel_spec(str(kernel_dir / "grpotrl-nb"))
    return KernelSpecManager(kernel_dirs=[str(kernel_dir)])


def execute(path: Path, specs, cwd: Path):
    """Run notebook ``path`` top to bottom on the ``grpotrl-nb`` kernel in ``cwd``; returns the executed notebook."""
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="grpotrl-nb", kernel_spec_manager=specs)
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, record_timing=False,
                            resources={"metadata": {"path": str(cwd)}})
    try:
        client.execute()
    finally:
        if km.has_kernel:  # a clean kernel exit runs the notebook's atexit hooks (03 stops its judge server)
            km.shutdown_kernel()
    return nb


def main(names: list[str]) -> int:
    import nbformat

    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if names:
        unknown = [n for n in names if not (NOTEBOOKS / f"{Path(n).stem}.ipynb").is_file()]
        if unknown:
            print(f"{COMMAND}: error: no notebook {unknown} in notebooks/ (have: {[p.stem for p in paths]})",
                  file=sys.stderr)
            return 2
        paths = [NOTEBOOKS / f"{Path(n).stem}.ipynb" for n in names]
    with tempfile.TemporaryDirectory(prefix="grpotrl-nb-") as tmp:
        work = Path(tmp)
        os.environ.pop("GRPOTRL_NB_OUT", None)  # the default, outputs/<notebook> under the kernel's cwd
        os.environ.update({  # the kernel inherits this environment
            "JUPYTER_RUNTIME_DIR": str(work / "runtime"),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
            "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),  # the notebooks run with use_cpu=True
            "PYTHONWARNINGS": ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), *KERNEL_WARNINGS])),
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        })
        specs = kernel_specs(work / "kernels")
        for path in paths:
            start = time.perf_counter()
            cwd = work / path.stem
            cwd.mkdir()
            nb = execute(path, specs, cwd)
            home_as_tilde(nb)
            nb.metadata["grpotrl"] = {"code_sha256": code_sha256(nb)}
            left = problems(nb, path.stem)
            if left:
                print("\n".join(left), file=sys.stderr)
                return 1
            nbformat.write(nb, path)
            print(f"{path.name}: {time.perf_counter() - start:.0f} s, stored {path.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
