"""The documentation site builds in strict mode, and strict mode really fails on what it should.

``mkdocs build --strict`` (mkdocs.yml at the repo root) renders docs/, the API reference from the
docstrings (mkdocstrings, static analysis: nothing is imported) and the notebooks with their stored
outputs (mkdocs-jupyter, nothing is executed; scripts/docs_hooks.py fails the build when they are
not current). A broken link or anchor, an API object that does not exist and stale notebook outputs
each fail it. About 10 s on 2 CPU cores; the two broken builds are a few seconds each.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Material for MkDocs prints a banner about MkDocs 2.0 on every build; it is no warning of ours.
QUIET = {"NO_MKDOCS_2_WARNING": "1"}


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail("building the docs needs the docs extra: pip install -e '.[docs]' (the dev extra pulls it)")

    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **QUIET})


def test_site_builds_in_strict_mode(tmp_path):
    proc = mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    site = tmp_path / "site"
    api = (site / "api" / "index.html").read_text()
    for name in ("GRPOTrainer", "GRPOConfig", "InvariantError", "MultiTaskGRPOTrainer", "GADTrainer"):
        assert f'id="grpotrl.{name}"' in api, f"the API reference lacks grpotrl.{name}"
    guarantees = (site / "guarantees" / "index.html").read_text()
    assert "I10" in guarantees and "--8&lt;--" not in guarantees, "INVARIANTS.md was not included"
    quickstart_nb = (site / "notebooks" / "00_quickstart" / "index.html").read_text()
    assert "data:image/png;base64," in quickstart_nb, "the quickstart notebook's plots are not on its page"


@pytest.mark.parametrize("page, named", [
    ("See [the missing page](missing.md).\n", "missing.md"),
    ("See [the section](#no-such-section).\n", "no-such-section"),
    ("::: grpotrl.no_such_module\n", "grpotrl.no_such_module"),
], ids=["broken-link", "broken-anchor", "missing-api-object"])
def test_strict_build_fails_and_names_the_problem(tmp_path, page, named):
    """The repo's own settings, on a one-page site that has one defect: the build fails naming it."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# A page\n\n{page}")
    config = tmp_path / "mkdocs.yml"
    for name in ("grpotrl", "scripts"):  # mkdocs.yml's paths are relative to the config file
        (tmp_path / name).symlink_to(REPO / name)
    # hooks: the notebooks' check has its own test (test_notebooks.py) and reads paths of the repo
    config.write_text(f"INHERIT: {REPO / 'mkdocs.yml'}\ndocs_dir: {docs}\nnav: [index.md]\nhooks: []\n")
    proc = mkdocs_build(config, tmp_path / "site")
    assert proc.returncode != 0, f"a page with {named!r} built:\n{proc.stderr[-4000:]}"
    assert named in proc.stderr, proc.stderr[-4000:]


def test_readme_recipe_excerpt_is_the_recipe():
    """Every line of the README's recipe excerpt is a line of the recipe it names."""
    readme = (REPO / "README.md").read_text()
    excerpt = re.search(r"`(recipes/[^`]+\.yaml)`[^\n]*\n\n```yaml\n(.*?)```", readme, re.S)
    assert excerpt, "the README shows a recipe: `recipes/....yaml` then a ```yaml block"
    recipe = (REPO / excerpt.group(1)).read_text().splitlines()
    missing = [line for line in excerpt.group(2).splitlines() if line.strip() and line not in recipe]
    assert not missing, f"README lines not in {excerpt.group(1)}: {missing}"


def test_every_recipe_is_on_the_launching_page():
    """docs/launching.md lists every recipe and accelerate config shipped under recipes/."""
    page = (REPO / "docs" / "launching.md").read_text()
    missing = [str(p.relative_to(REPO)) for p in sorted((REPO / "recipes").glob("*/*.yaml")) if f"`{p.name}`" not in page]
    assert not missing, f"docs/launching.md does not list {missing}"
