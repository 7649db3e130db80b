#!/usr/bin/env bash
# Set up ./.venv, start `inferscale serve` on the embedded default model, run the demo against it, stop it.
set -euo pipefail
cd "$(dirname "$0")/.."
# operator/ (installed as inferscale.operator) would shadow the standard library's `operator` for any
# `python -m`/`-c` started here, which puts the current directory first on sys.path; safe-path mode stops that.
export PYTHONSAFEPATH=1
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
DATA=${INFERSCALE_DATA_DIR:-$PWD/.inferscale-demo}
PORT=${INFERSCALE_PORT:-8000}
mkdir -p "$DATA"
LOG="$DATA/serve.log"
.venv/bin/inferscale serve --data-dir "$DATA" --port "$PORT" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
echo "inferscale serve (pid $SERVER) starting on 127.0.0.1:$PORT; log: $LOG"
for _ in $(seq 1 300); do
  if curl -fs "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1; then break; fi
  if ! kill -0 $SERVER 2>/dev/null; then cat "$LOG"; exit 1; fi
  sleep 1
done
# The first start creates the tenants file and prints its key once (only its hash is stored): the demo's data dir
# keeps that key for the next runs (owner-only file), else INFERSCALE_API_KEY gives it.
KEYFILE="$DATA/demo-api-key"
KEY=$(grep -o 'isk-[A-Za-z0-9_-]*' "$LOG" | head -1 || true)
if [ -n "$KEY" ]; then (umask 077 && printf '%s\n' "$KEY" >"$KEYFILE"); fi
if [ -z "$KEY" ] && [ -n "${INFERSCALE_API_KEY:-}" ]; then KEY=$INFERSCALE_API_KEY; fi
if [ -z "$KEY" ] && [ -s "$KEYFILE" ]; then KEY=$(cat "$KEYFILE"); fi
if [ -z "$KEY" ]; then
  echo "no API key for $DATA/tenants.json (its key was printed when it was created): set INFERSCALE_API_KEY, or" \
       "remove $DATA to start over" >&2
  exit 1
fi
INFERSCALE_API_KEY="$KEY" .venv/bin/inferscale demo --url "http://127.0.0.1:$PORT"
