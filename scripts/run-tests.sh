#!/usr/bin/env bash
# The test suite as `make test` and CI run it: ruff, then mypy (in the background) beside pytest (every
# marker, the real model included) on two pytest-xdist workers, one per core of the CI machine (a third
# gave no gain and pushed the longest test past its timeout; TANDEM_TEST_WORKERS changes the count, 0 runs
# in this process).
# pytest's exit code 5 ("no tests collected") counts as failure only if nothing ran.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The suite starts hundreds of Python processes (nodes, ranks, CLIs, benchmark sections). Where the
# environment sets PYTHONDONTWRITEBYTECODE (these machines do) and the venv was installed --no-compile,
# each of them compiled torch's and Tandem's sources anew: a clean clone's suite took 1,879 CPU-s of tests
# where the same suite with bytecode on disk took 1,142. Bytecode is written once, for what is imported.
unset PYTHONDONTWRITEBYTECODE
WORKERS=${TANDEM_TEST_WORKERS:-2}

"$VENV/bin/ruff" check . || exit 1
mypy_log=$(mktemp)
"$VENV/bin/mypy" common kv_transfer prefill_service decode_service gateway tandem_cli benchmarks scripts/gpu_*.py \
    >"$mypy_log" 2>&1 &
mypy_pid=$!
xdist=()
[[ $WORKERS != 0 ]] && xdist=(-n "$WORKERS" --dist worksteal)
"$VENV/bin/python" -m pytest "${xdist[@]}" --durations=25 "$@"
rc=$?
[[ $rc -eq 5 ]] && { echo "pytest collected no tests for this selection" >&2; rc=0; }
wait "$mypy_pid"
mypy_rc=$?
cat "$mypy_log"
rm -f "$mypy_log"
[[ $mypy_rc -ne 0 ]] && { echo "mypy failed" >&2; exit 1; }
exit $rc
