"""mkdocs hook (mkdocs.yml `hooks:`): a notebook whose stored outputs are not current fails the build.

The site shows the outputs stored in notebooks/*.ipynb (mkdocs-jupyter, ``execute: false``), so a
page is only as true as they are: before building, every notebook goes through
``scripts/run_notebooks.py``'s ``problems()`` (code cells changed since they ran, an error output,
an unexecuted cell, a plot without its PNG, a warning, a progress bar or a path of the machine that
ran it), and any problem stops the build with the fix (``make notebooks``).
"""

import importlib.util
import json
from pathlib import Path

from mkdocs.exceptions import PluginError

REPO = Path(__file__).resolve().parent.parent


def on_pre_build(config, **kwargs) -> None:
    spec = importlib.util.spec_from_file_location("run_notebooks", REPO / "scripts" / "run_notebooks.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    found = [p for path in sorted((REPO / "notebooks").glob("*.ipynb"))
             for p in script.problems(json.loads(path.read_text()), path.stem)]
    if found:
        raise PluginError("notebook outputs are not current:\n  " + "\n  ".join(found))
