#!/usr/bin/env bash
# The GPU check: on a fresh CUDA machine, install what Tandem's GPU paths need, run the `gpu`-marked tests
# and the GPU measurements (benchmarks/gpu_check.py), and print one table. Budget: under 8 minutes.
#
#   bash scripts/gpu-check.sh [--dry-run] [--out DIR]
#
# --dry-run lists the steps on any machine and exits 0. Without a CUDA device it exits 77 saying so.
# Results: DIR/gpu-check.json and DIR/gpu-check.md (table), DIR/pytest-gpu.log, DIR/junit.xml,
# DIR/kv-ipc.json; DIR defaults to gpu-check-results/<UTC timestamp>.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
OUT="gpu-check-results/$(date -u +%Y%m%dT%H%M%SZ)"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --out) OUT="$2"; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

VENV=${GPU_VENV:-.venv-gpu}
PY="$VENV/bin/python"
STEPS=(
  "1. detect CUDA: nvidia-smi lists a GPU (else exit 77)"
  "2. install (<= 3 min): python -m venv $VENV; pip install the CUDA torch build (PyPI's Linux wheel), triton, and -e '.[gpu,dev]' (flashinfer-python); generate the protobuf stubs"
  "3. gpu tests (<= 2 min): pytest -m gpu tests/kernels tests/kv_transfer (Triton vs torch reference, FlashInfer vs Triton, CUDA IPC KV transfer between two processes on one GPU)"
  "4. measurements (<= 3 min): python -m benchmarks.gpu_check: HBM copy bandwidth; paged decode (batch 64, 4k ctx) and extend, Triton / FlashInfer vs torch and vs copy bandwidth; prefill attention; end-to-end tokens/s (bundled model, random-weight Llama-3-8B-shaped bf16); CUDA-graph decode steps; KV transfer over CUDA IPC"
  "5. report: $OUT/gpu-check.json + $OUT/gpu-check.md, the table printed last"
)

if [[ $DRY_RUN == 1 ]]; then
  echo "gpu-check steps (dry run, nothing is installed or run):"
  printf '  %s\n' "${STEPS[@]}"
  exit 0
fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
  echo "gpu-check: no CUDA device on this machine (nvidia-smi lists no GPU); nothing to check" >&2
  exit 77
fi

START=$(date +%s)
mkdir -p "$OUT"
elapsed() { echo "$(( $(date +%s) - START ))s"; }
echo "== 1. CUDA: $(nvidia-smi -L | head -1)"

echo "== 2. install into $VENV ($(elapsed))"
if [[ ! -x "$PY" ]]; then
  python3 -m venv "$VENV"
fi
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch triton  # PyPI's Linux torch wheel is the CUDA build
"$PY" -m pip install -q -e '.[gpu,dev]'
PYTHON="$PY" bash scripts/gen-protos.sh
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA'; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"

echo "== 3. gpu tests ($(elapsed))"
set +e
timeout 150 "$PY" -m pytest -q -m gpu tests/kernels tests/kv_transfer -p no:cacheprovider \
  --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest-gpu.log" | tail -25
TESTS_RC=${PIPESTATUS[0]}

echo "== 4. measurements ($(elapsed))"
timeout 240 "$PY" -m benchmarks.gpu_check --out "$OUT" > "$OUT/gpu-check.log" 2>&1
BENCH_RC=$?
set -e

echo "== 5. report ($(elapsed)): $OUT"
echo "gpu tests: $(tail -1 "$OUT/pytest-gpu.log") (exit $TESTS_RC)"
if [[ -f "$OUT/gpu-check.md" ]]; then
  cat "$OUT/gpu-check.md"
else
  echo "measurements did not finish (exit $BENCH_RC); last lines:"; tail -20 "$OUT/gpu-check.log"
fi
[[ $TESTS_RC == 0 && $BENCH_RC == 0 ]]
