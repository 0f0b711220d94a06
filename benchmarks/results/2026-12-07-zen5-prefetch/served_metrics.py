"""One ``tandem serve colocated`` on both cores, vLLM's client on one workload at one rate REPEATS times, and the
engine's own counters over each run (steps, seconds in steps, prefill and decode tokens): how much of a served run
the engine's steps are (session 38).

    PYTHONPATH=CHECKOUT python served_metrics.py WORKLOAD RATE [REPEATS]    # e.g. shared-prefix inf 2
"""

import dataclasses
import math
import re
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks import serve_peer
from benchmarks.peers.registry import find_peer
from benchmarks.peers.vllm_server import run_vllm_client
from common.config.settings import ModelSettings, load_settings
from common.model.model_store import resolve_model
from tandem_cli.launcher import ColocatedTopology, Launcher

workload, rate = sys.argv[1], float(sys.argv[2])
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 2
settings = load_settings(ModelSettings, {"model": None, "dtype": "bfloat16"})
model_dir = resolve_model(settings.model, settings.home, progress=False)
client, why = find_peer("vllm", serve_peer.REPO)
assert client is not None, why
chosen = serve_peer.client_workloads(48)[workload]
log = Path(tempfile.mkdtemp(prefix="served-metrics-"))


def counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(url + "/metrics", timeout=10).read().decode().splitlines():
        m = re.match(r"(tandem:engine_steps?\w*)(\{[^}]*\})? ([0-9.e+-]+)", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    metrics_port = sock.getsockname()[1]
topology = ColocatedTopology(replicas=1, free_ports=True, cpus=(0, 1), serve_http=True,
                             model_args=("--model", str(model_dir), "--dtype", "bfloat16"),
                             node_args=("--kv-cache-memory-gb", "1", "--metrics-port", str(metrics_port)))
metrics_url = f"http://127.0.0.1:{metrics_port}"
start = time.monotonic()
with Launcher(topology, log_dir=log) as launcher:
    url = f"http://127.0.0.1:{launcher.specs[0].http_port}"
    print(f"ready in {time.monotonic() - start:.1f} s at {url}", flush=True)
    warm = dataclasses.replace(chosen, name="warm-up", num_prompts=12, ttft_slo_ms=1e9, tpot_slo_ms=1e9)
    run_vllm_client(client.python, url, model_dir.name, model_dir, warm, math.inf, log / "warm.json", seed=999)
    for i in range(repeats):
        before = counters(metrics_url)
        r = run_vllm_client(client.python, url, model_dir.name, model_dir, chosen, rate, log / f"r{i}.json", seed=i)
        after = counters(metrics_url)
        print(f"run {i}: {r['output_throughput']:.1f} output tok/s over {r['duration']:.2f} s, TTFT p50 / p99 "
              f"{r['p50_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} ms, TPOT p50 {r['p50_tpot_ms']:.1f} ms", flush=True)
        print("   ", {k.removeprefix("tandem:"): round(after[k] - before.get(k, 0.0), 3) for k in after}, flush=True)
