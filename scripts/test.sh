#!/usr/bin/env bash
# The project's test command (CI runs exactly this): every test, CPU only.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
