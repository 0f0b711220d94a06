#!/usr/bin/env bash
# The GPU lease: run on a lent GPU machine as it is (its own python3, no network), with gpu-bundle/ carried
# beside the working tree (`make gpu-bundle` here). Steps, budgets and files: scripts/gpu_lease.py, docs/gpu.md.
#
#   bash scripts/gpu-lease.sh OUT [DEADLINE_S]    (default 500 s; PYTHON=... picks another interpreter)
#
# OUT gets gpu-lease.json and gpu-lease.md (rewritten after every step), lease.log, pytest.log, junit.xml;
# model weights and installed wheels go to a scratch folder outside it. Exit 0 once the report is written.
cd "$(dirname "$0")/.." || exit 1
exec "${PYTHON:-python3}" scripts/gpu_lease.py "$@"
