"""Execute the notebooks and store them WITH their outputs, so the docs site and GitHub show the plots.

    .venv/bin/python scripts/run_notebooks.py                 # every notebook in notebooks/ (`make notebooks`)
    .venv/bin/python scripts/run_notebooks.py 02_guards       # some of them, by name

Each notebook runs top to bottom on a kernel of THIS interpreter (the kernel spec is written to a
temporary directory, so a user-level ``python3`` spec pointing at another Python is never used),
offline (``HF_HUB_OFFLINE=1``), with the notebook's directory as cwd, the grpotrl of this checkout
first on ``PYTHONPATH`` and its files under a temporary ``GRPOTRL_NB_OUT``. A failing cell stops
the script and leaves the stored notebook as it was.

What makes stored outputs current: the script records a SHA-256 of the code cells' sources in
the notebook's metadata (``metadata.grpotrl.code_sha256``). ``problems()`` (run by
tests/test_notebooks.py and by the docs build, scripts/docs_hooks.py) compares it with the code cells as
they are now, and also refuses error outputs, unexecuted code cells, and a plotting cell (one that
calls ``plt.``) without a PNG. Edit a code cell, and the test names this script.

Times on 2 CPU cores: 02 well under a minute; 00, 01, 03, 04 a minute or two each; 05 2-4 minutes.
"""

import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
CELL_TIMEOUT_S = 600
COMMAND = "scripts/run_notebooks.py"


def code_sha256(nb) -> str:
    """SHA-256 over the code cells' sources, in order (markdown cells may change freely)."""
    digest = hashlib.sha256()
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            digest.update(source.encode() + b"\0")
    return digest.hexdigest()


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
    if found:
        found.append(f"to store current outputs: `.venv/bin/python {COMMAND} {name}` (or `make notebooks`)")
    return [f"{name}: {p}" for p in found]


def kernel_specs(kernel_dir: Path):
    """A kernel spec manager holding one spec, ``grpotrl-nb``, that runs sys.executable (ipykernel's launcher)."""
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager

    write_kernel_spec(str(kernel_dir / "grpotrl-nb"))
    return KernelSpecManager(kernel_dirs=[str(kernel_dir)])


def execute(path: Path, specs):
    """Run notebook ``path`` top to bottom on the ``grpotrl-nb`` kernel; returns the executed notebook."""
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="grpotrl-nb", kernel_spec_manager=specs)
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
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
        os.environ.update({  # the kernel inherits this environment
            "GRPOTRL_NB_OUT": str(work / "out"), "JUPYTER_RUNTIME_DIR": str(work / "runtime"),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        })
        specs = kernel_specs(work / "kernels")
        for path in paths:
            start = time.perf_counter()
            nb = execute(path, specs)
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
