"""One local deployment (1 prefill + 1 decode node and a gateway, free ports, no HTTP API) from the checkout on
PYTHONPATH; prints the gateway's target once every service is healthy, then serves until terminated (session 34).

    PYTHONPATH=CHECKOUT python run_up.py DTYPE LOG_DIR [GATEWAY_ARG ...]
"""

import signal
import sys
import time
from pathlib import Path

from tandem_cli.launcher import Launcher, Topology

dtype, log_dir = sys.argv[1], Path(sys.argv[2])
log_dir.mkdir(parents=True, exist_ok=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
topology = Topology(free_ports=True, http_port=None, model_args=("--dtype", dtype), gateway_args=tuple(sys.argv[3:]))
with Launcher(topology, log_dir=log_dir) as launcher:
    launcher.wait_healthy(600)
    print(next(s.target for s in launcher.specs if s.role == "gateway"), flush=True)
    while True:
        time.sleep(1)
