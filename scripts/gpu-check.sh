#!/usr/bin/env bash
# GPU data-path check: run on a CUDA machine from the repository root; writes JSON for the README.
#
#   bash scripts/gpu-check.sh [--dry-run] [--out DIR]
#
# Needs: an NVIDIA GPU with a driver (nvidia-smi), Python >= 3.11, and either network access to the Python package
# index or a virtual environment that already holds a CUDA build of torch (CUDA torch wheels ship triton). Nothing
# comes from a model hub: the TTFT model is random-weight and Llama-3-8B-shaped (~16 GB of bf16 on the GPU), the
# tokenizer is the embedded default model's. TensorRT-LLM is optional: its step runs only where
# `import tensorrt_llm` works (it cannot be installed on the CPU machines): the installed release against the
# pinned connector contract, then the smoke test (the connector, and the engine seam `serve --engine trtllm` runs).
#
# Steps (each under its own time limit, 475 s in all: the whole run fits in 10 minutes on an H100/H200):
#   1. install     CUDA torch + triton if torch has no CUDA; pip install -e ".[test]" if inferscale does not import
#   2. kernels     tests/kernels compiled (TRITON_INTERPRET=0): Triton == torch reference on the GPU
#   3. engine      tests/kernels/test_engine_cuda.py: the engine on CUDA takes the Triton path, kv == text
#   4. ttft        inferscale bench ttft --random-weights llama3-8b --device cuda --k 5,20,50 (goal: text/kv >= 6 at 50)
#   5. trtllm      where tensorrt_llm imports: tests/trtllm/test_connector_contract.py (the installed release is a
#                  supported row), then scripts/trtllm_smoke.py (connector fills pages; TrtllmBackend answers)
# Output: $OUT/gpu-check.json (step status and seconds, the TTFT summary) + ttft-llama3-8b.json + trtllm-smoke.json.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error

DRY=0
OUT_DIR=${OUT:-gpu-check-out}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT_DIR=$2; shift ;;
    -h|--help) sed -n 2,20p "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

STEPS=(install kernels engine ttft trtllm)
declare -A LIMIT=([install]=75 [kernels]=45 [engine]=45 [ttft]=200 [trtllm]=110)
declare -A CMD=(
  # A CPU build of torch satisfies "torch>=2.4", so it is removed first; the editable install is redone where the
  # checkout moved (its path finder points at the old absolute path).
  [install]="$PY -c 'import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null || { $PY -m pip uninstall -y -q torch; $PY -m pip install -q 'torch>=2.4' 'triton>=3.2'; } ; $PY -c 'import inferscale.kernels.inject' 2>/dev/null || $PY -m pip install -q --no-build-isolation -e '.[test]'"
  [kernels]="TRITON_INTERPRET=0 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_inject.py"
  [engine]="TRITON_INTERPRET=0 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_engine_cuda.py"
  [ttft]="$PY -m inferscale.cli bench ttft --random-weights llama3-8b --device cuda --dtype bfloat16 --k 5,20,50 --repeats 3 --json '$OUT_DIR/ttft-llama3-8b.json'"
  [trtllm]="$PY -c 'import tensorrt_llm' >/dev/null 2>&1 || { echo 'tensorrt_llm not importable: smoke test skipped'; exit 77; }; $PY -m pytest -q -p no:cacheprovider tests/trtllm/test_connector_contract.py -k installed && $PY scripts/trtllm_smoke.py '$OUT_DIR/trtllm-smoke.json'"
)

if [ "$DRY" = 1 ]; then
  echo "gpu-check (dry run): python=$PY out=$OUT_DIR"
  for s in "${STEPS[@]}"; do printf '%-8s limit %4ss  %s\n' "$s" "${LIMIT[$s]}" "${CMD[$s]}"; done
  exit 0
fi

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu-check: no nvidia-smi: this script needs a CUDA machine (use --dry-run to see the steps)" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
GPU=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)
RESULTS=()
for s in "${STEPS[@]}"; do
  echo "== $s (limit ${LIMIT[$s]}s)"
  start=$(date +%s)
  timeout "${LIMIT[$s]}" bash -c "${CMD[$s]}" 2>&1 | tee "$OUT_DIR/$s.log" | tail -25
  rc=${PIPESTATUS[0]}
  secs=$(( $(date +%s) - start ))
  case $rc in 0) status=pass ;; 77) status=skipped ;; 124) status=timeout ;; *) status=fail ;; esac
  echo "== $s: $status (${secs}s)"
  RESULTS+=("{\"step\": \"$s\", \"status\": \"$status\", \"rc\": $rc, \"seconds\": $secs}")
done

# One JSON for the README: the steps, the GPU, and the TTFT summary when the bench ran.
STEPS_JSON=$(IFS=,; echo "[${RESULTS[*]}]")
GPU="$GPU" STEPS_JSON="$STEPS_JSON" OUT_DIR="$OUT_DIR" $PY - <<'EOF'
import json, os
from pathlib import Path

out = Path(os.environ["OUT_DIR"])
doc = {"gpu": os.environ["GPU"], "steps": json.loads(os.environ["STEPS_JSON"])}
for name, key in (("ttft-llama3-8b.json", "ttft"), ("trtllm-smoke.json", "trtllm")):
    if (out / name).is_file():
        doc[key] = json.loads((out / name).read_text())
if "ttft" in doc:
    rows = doc["ttft"]["rows"]
    doc["ttft_text_over_kv"] = {r["k"]: round(r["ttft_text_ms"] / r["ttft_kv_ms"], 2) for r in rows}
    doc["ttft_goal_6x_at_k50_met"] = any(r["k"] == 50 and r["ttft_text_ms"] >= 6 * r["ttft_kv_ms"] for r in rows)
(out / "gpu-check.json").write_text(json.dumps(doc, indent=2))
print(json.dumps({k: v for k, v in doc.items() if k not in ("ttft", "trtllm")}, indent=2))
EOF
grep -q '"status": "fail"\|"status": "timeout"' "$OUT_DIR/gpu-check.json" && exit 1 || exit 0
