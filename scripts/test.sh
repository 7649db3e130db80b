#!/usr/bin/env bash
# The project's test command (CI runs exactly this): every test, CPU only.
set -euo pipefail
cd "$(dirname "$0")/.."
# operator/ (installed as inferscale.operator) would shadow the standard library's `operator` for any
# `python -m`/`-c` started here, which puts the current directory first on sys.path; safe-path mode stops that.
export PYTHONSAFEPATH=1
export HF_HUB_OFFLINE=1
# A fresh clone has no .venv yet: set it up first (the same set-up CI runs), so this command works on its own.
[ -x .venv/bin/python ] || bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
