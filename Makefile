# make setup       create .venv and install grpotrl (scripts/setup.sh; GRPOTRL_EXTRAS=deepspeed,...)
# make test        the test suite, as CI runs it (.ci/run): all but the tests marked slow
# make test-all    every test, the slow ones included (about 10 minutes more)
# make quickstart  a tiny end-to-end run on SmolLM2-135M-Instruct
# make docs        build the documentation site (mkdocs.yml, docs/) and serve it at http://127.0.0.1:8000
# make notebooks   re-execute notebooks/ and store them with their outputs (scripts/run_notebooks.py)
.PHONY: setup test test-all quickstart docs notebooks

# Idle OpenMP workers must yield, or any other busy process slows torch 30-100x on few
# cores (grpotrl/_threads.py). Exported, so it is set before Python imports torch.
export OMP_WAIT_POLICY := PASSIVE
export TOKENIZERS_PARALLELISM := false

VENV_STAMP := .venv/.grpotrl-setup

setup:
	scripts/setup.sh
	touch $(VENV_STAMP)

# Re-installs only when the package metadata or the setup script changed.
$(VENV_STAMP): setup.cfg pyproject.toml scripts/setup.sh
	scripts/setup.sh
	touch $@

# Tests run with 2 threads: the CI machine's core count, and the numbers the suite was timed with.
test: export OMP_NUM_THREADS ?= 2
# Tests marked slow (setup.cfg: real-model runs whose ground another test covers) are left out; `make test-all`
# (TEST_MARKERS empty) runs them too.
TEST_MARKERS ?= not slow
# The import layers first (setup.cfg [importlinter]: imports only go down, lazy ones included);
# pytest exits 5 when it collected nothing; make would only say "Error 5", so say what it is.
test: $(VENV_STAMP)
	.venv/bin/lint-imports
	.venv/bin/python -m pytest -q -m "$(TEST_MARKERS)" tests --doctest-modules grpotrl || { status=$$?; [ $$status -ne 5 ] || \
	    echo "make test: FAIL: pytest collected no tests (exit 5); check tests/ and that its files import" >&2; \
	    exit $$status; }

test-all:
	$(MAKE) test TEST_MARKERS=

# SFT then GRPO on SmolLM2-135M-Instruct, exactly the two commands a user would type; the
# log goes to outputs/quickstart.log as well as the terminal. A second `make quickstart` replaces
# the quickstart's own outputs (the CLI refuses a non-empty output_dir unless told so).
QUICKSTART_ARGS ?= --overwrite_output_dir true
quickstart: SHELL := /bin/bash
quickstart: $(VENV_STAMP)
	mkdir -p outputs
	set -o pipefail; { .venv/bin/grpotrl sft --config recipes/smollm2/sft_quickstart.yaml $(QUICKSTART_ARGS) && \
	  .venv/bin/grpotrl grpo --config recipes/smollm2/grpo_quickstart.yaml $(QUICKSTART_ARGS); } 2>&1 | tee outputs/quickstart.log

# Builds the site (strict: a broken link, a missing API object or stale notebook outputs stop it)
# and serves it, rebuilding on every change under docs/, grpotrl/ and notebooks/.
DOCS_ADDR ?= 127.0.0.1:8000
docs: $(VENV_STAMP)
	.venv/bin/mkdocs serve --dev-addr $(DOCS_ADDR) --watch grpotrl --watch notebooks

# Minutes of CPU (every notebook trains SmolLM2-135M for a few steps): run it after changing a
# notebook's code cells, then commit the notebooks with their outputs.
notebooks: export OMP_NUM_THREADS ?= 2
notebooks: $(VENV_STAMP)
	.venv/bin/python scripts/run_notebooks.py
