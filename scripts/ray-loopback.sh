#!/usr/bin/env bash
# `ray ARGS...` for a Ray cluster on one box that listens on loopback only: each `ray start` here is given
# `--node-ip-address 127.0.0.1`, but Ray replaces a loopback address with the machine's interface address
# (and its servers then listen on every interface); this keeps 127.0.0.1, and every Ray server binds it.
# The tests' three-raylet cluster (tests/e2e/test_ray.py) starts this way; docs/multi-machine.md.
#   scripts/ray-loopback.sh start --head --node-ip-address 127.0.0.1 --port 6379 --resources '{"host_a": 1}'
#   scripts/ray-loopback.sh start --address 127.0.0.1:6379 --node-ip-address 127.0.0.1 --resources '{"host_b": 1}'
set -euo pipefail
PYTHON=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
export RAY_USAGE_STATS_ENABLED=0
exec "$PYTHON" -c "import sys, ray._private.services as s
s.node_ip_address_from_perspective = lambda *a, **k: '127.0.0.1'
from ray.scripts.scripts import main
sys.argv[0] = 'ray'
sys.exit(main())" "$@"
