#!/usr/bin/env bash
# Create ./.venv with InferScale and everything its tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
# operator/ (installed as inferscale.operator) would shadow the standard library's `operator` for any
# `python -m`/`-c` started here, which puts the current directory first on sys.path; safe-path mode stops that.
export PYTHONSAFEPATH=1
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# constraints.txt pins every package to the versions the tests ran with (scripts/freeze-constraints.py writes it).
.venv/bin/python -m pip install -q -c constraints.txt -e ".[server,operator,bench,test]"
echo "set up: $(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
# The CPU kernels (kernels/__main__.py lists them) are built now, once per machine and torch version, not at the
# first model load; where they cannot be (no AMX or AVX512-BF16, no compiler) the model keeps aten's operations.
.venv/bin/python -m inferscale.kernels
# checkov (tests/chart/test_checkov.py) in a venv of its own: its pins clash with the project's.
[ -x .venv-tools/bin/python ] || "$PY" -m venv .venv-tools
.venv-tools/bin/python -m pip install -q -r scripts/tools-requirements.txt
echo "tools: $(.venv-tools/bin/checkov --version | head -1 | sed 's/^/checkov /')"
