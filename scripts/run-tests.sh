#!/usr/bin/env bash
# The test suite as `make test` and CI run it: lint, type check, then pytest (every marker, the real
# model included). pytest's exit code 5 ("no tests collected") counts as failure only if nothing ran.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

"$VENV/bin/ruff" check . || exit 1
"$VENV/bin/mypy" common kv_transfer prefill_service decode_service gateway tandem_cli benchmarks || exit 1
"$VENV/bin/python" -m pytest --durations=25 "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
    echo "pytest collected no tests for this selection" >&2
    exit 0
fi
exit $rc
