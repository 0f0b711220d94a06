#!/usr/bin/env bash
# `make test-stress`: the whole test suite RUNS times in a row (default 3) beside a process that keeps one
# core busy (stress-ng --cpu 1 where it is installed, else a Python busy loop), as a CI machine shared with
# other jobs would be. Every run must pass: a test that depends on timing or on a port chosen before its
# server binds it fails here first. Each run's log: stress-logs/run-N.log.
set -uo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
mkdir -p stress-logs
if command -v stress-ng >/dev/null 2>&1; then
    stress-ng --cpu 1 --quiet &
else
    python3 -c 'while True: pass' &
fi
burner=$!
trap 'kill $burner 2>/dev/null' EXIT
failed=0
for run in $(seq 1 "$RUNS"); do
    start=$(date +%s)
    if bash scripts/run-tests.sh -p no:cacheprovider >"stress-logs/run-$run.log" 2>&1; then result=passed; else
        result=FAILED; failed=$((failed + 1)); fi
    echo "run $run/$RUNS under load: $result in $(( $(date +%s) - start )) s ($(tail -n 1 "stress-logs/run-$run.log"))"
done
exit $((failed > 0))
