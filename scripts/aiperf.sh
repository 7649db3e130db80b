#!/usr/bin/env bash
# NVIDIA's aiperf against `inferscale serve`, the way a user measures it (README, "Measured with aiperf").
# aiperf is a reference client, not a dependency: install it into a venv of its own, e.g.
#   python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf
# Usage: scripts/aiperf.sh [PORT] [REQUESTS]   (AIPERF=path/to/aiperf; MODES="kv text"; K=20;
#   CONCURRENCY=1, or a list such as "1 16" run in turn on the same server; OUTPUT_TOKENS=16, each answer's length;
#   PROMPTS=bench sends `inferscale bench load`'s own question, as a single_turn input file, instead of aiperf's
#   24-token synthetic prompts: the same requests through both clients, so their TTFTs can be compared;
#   LOCOMO=path/to/locomo10.json stores the first conversation's observations, dated, for "maya" and sends its
#   questions, so that retrieval picks K of a few hundred real memories for real questions: the product's workload)
# Starts a server on a fresh data dir with one tenant, stores K synthetic memories for user "maya" (dated, as
# `bench ttft` stores them: 586 tokens at K=20; before 2026-12-06 without their dates, 395), runs aiperf once per mode
# (concurrency 1, 24-token synthetic prompts, 16 output tokens forced as aiperf's users force them: ignore_eos and
# min_tokens), stops it. CONCURRENCY="1 16" OUTPUT_TOKENS=64 measures many streams beside one the same
# way (REQUESTS per concurrency): aiperf's output token throughput then counts the prompt passes of the requests that
# replace finished ones too, its inter-token latency the steps those passes share.
# aiperf paces its requests at RATE per second (default 100, above what one stream can ask for, so concurrency 1 is
# what binds): with concurrency alone its timing_manager polls for a free slot without sleeping, a whole core
# (95 % of one measured), which on a small machine shared with the server is taken from the server (kv TTFT 214 ms
# vs 136 ms paced, the same server). RATE=0 leaves it unpaced.
set -euo pipefail
LOCOMO=${LOCOMO:+$(realpath "$LOCOMO")}  # a path from where the script was started, before it moves to the repo root
cd "$(dirname "$0")/.."
PORT=${1:-8000}
REQUESTS=${2:-20}
CONCURRENCY=${CONCURRENCY:-1}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-16}
for n in $CONCURRENCY $OUTPUT_TOKENS $REQUESTS; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "aiperf.sh: '$n' is not a positive integer (CONCURRENCY, OUTPUT_TOKENS, REQUESTS)" >&2; exit 2; }
done
AIPERF=${AIPERF:-aiperf}
K=${K:-20}
RATE=${RATE:-100}
PACING=()
PROMPT_ARGS=(--prompt-input-tokens-mean 24 --prompt-input-tokens-stddev 0)
[ "$RATE" != 0 ] && PACING=(--request-rate "$RATE" --request-rate-mode constant)
export PYTHONSAFEPATH=1 HF_HUB_OFFLINE=1
DATA=$(mktemp -d "${TMPDIR:-/tmp}/inferscale-aiperf.XXXX")
# The server's own view of the same requests (its TTFT and TPOT histograms), read from /metrics around each run.
export INFERSCALE_METRICS_TOKEN=aiperf-metrics-$RANDOM$RANDOM
TOKENIZER=$(.venv/bin/python -c "from inferscale.models.loader import load_model; print(load_model().tokenizer.name_or_path)")
# What "maya" remembers (the PUT body) and, unless aiperf makes them up, the questions asked (one JSON line each).
.venv/bin/python -m inferscale.bench.aiperfinputs --tokenizer "$TOKENIZER" --k "$K" --prompts "${PROMPTS:-synthetic}" \
  ${LOCOMO:+--locomo "$LOCOMO"} "$DATA"
[ -s "$DATA/questions.jsonl" ] && PROMPT_ARGS=(--custom-dataset-type single_turn --input-file "$DATA/questions.jsonl")
.venv/bin/python -c "
import json, sys; from inferscale.server.auth import hash_key
json.dump({'aiperf': {'keys': [hash_key('isk-aiperf')]}}, open(sys.argv[1], 'w'))" "$DATA/tenants.json"
.venv/bin/inferscale serve --port "$PORT" --data-dir "$DATA" --tenants-file "$DATA/tenants.json" >"$DATA/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null && break; sleep 1; done
curl -sSf -X PUT -H "Authorization: Bearer isk-aiperf" -H "Content-Type: application/json" --max-time 1800 \
  --data-binary "@$DATA/memories.json" "http://127.0.0.1:$PORT/v1/memories/maya" >/dev/null
server_view() {  # server_view MODE BEFORE.json AFTER.json: the histograms' averages over the requests between
  .venv/bin/python - "$@" <<'PY'
import json, sys
mode, before, after = sys.argv[1], json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
avg = lambda name: ((after[name + "_sum"] - before.get(name + "_sum", 0))
                    / max(after[name + "_count"] - before.get(name + "_count", 0), 1) * 1e3)
ttft, tpot = avg("gen_ai_server_time_to_first_token_seconds"), avg("gen_ai_server_time_per_output_token_seconds")
print(f"server, mode {mode} (the same requests, warm-ups included): TTFT avg {ttft:.1f} ms, TPOT avg {tpot:.1f} ms; "
      f"prefill + one decode step = {ttft + tpot:.1f} ms")
PY
}
scrape() {  # scrape MODE OUT.json: the TTFT/TPOT histograms' sums and counts for MODE
  curl -sf -H "Authorization: Bearer $INFERSCALE_METRICS_TOKEN" "http://127.0.0.1:$PORT/metrics" | .venv/bin/python -c "
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = {}
for fam in text_string_to_metric_families(sys.stdin.read()):
    for s in fam.samples:
        if s.labels.get('inferscale_mode') == sys.argv[1] and s.name.endswith(('_sum', '_count')):
            out[s.name] = out.get(s.name, 0) + s.value
json.dump(out, open(sys.argv[2], 'w'))" "$1" "$2"
}
for MODE in ${MODES:-kv text}; do
  for C in $CONCURRENCY; do
    echo "== aiperf, mode $MODE, k=$K, concurrency $C, $OUTPUT_TOKENS output tokens"
    RUN="$MODE-c$C"
    scrape "$MODE" "$DATA/metrics-$RUN-before.json"
    # aiperf itself runs without HF_HUB_OFFLINE: in offline mode its record processor resolves the tokenizer through
    # the hub cache (snapshot_download), which refuses a local directory; online, a local directory loads as it is.
    env -u HF_HUB_OFFLINE "$AIPERF" profile --model gemma-3-270m --url "http://127.0.0.1:$PORT" --endpoint-type chat \
      --streaming --api-key isk-aiperf --tokenizer "$TOKENIZER" --concurrency "$C" "${PACING[@]}" \
      --request-count "$REQUESTS" --warmup-request-count 2 "${PROMPT_ARGS[@]}" \
      --prompt-output-tokens-mean "$OUTPUT_TOKENS" --prompt-output-tokens-stddev 0 \
      --extra-inputs "{\"user\": \"maya\", \"inferscale\": {\"k\": $K, \"mode\": \"$MODE\"}, \"ignore_eos\": true, \"min_tokens\": $OUTPUT_TOKENS}" \
      --ui-type simple --no-server-metrics --output-artifact-dir "$DATA/aiperf-$RUN" 2>&1 \
      | grep -v -E "^[0-9:.]+ +(INFO|WARNING|DEBUG|NOTICE)"
    scrape "$MODE" "$DATA/metrics-$RUN-after.json"
    server_view "$MODE" "$DATA/metrics-$RUN-before.json" "$DATA/metrics-$RUN-after.json"
  done
done
# One line a run from aiperf's own export, the 16-stream one beside concurrency 1's (inferscale/bench/aiperfsummary.py)
.venv/bin/python -m inferscale.bench.aiperfsummary "$DATA" ${MODES:-kv text}
echo "artifacts and server log: $DATA"
