"""Where a served Tandem system's CPU goes (session 29): each thread's CPU seconds and the engine's step counters
over one run of vLLM's client.

    python benchmarks/results/2026-12-06-served-cpu/thread_cpu.py SYSTEM RATE [NUM_PROMPTS] [WORKLOAD]

SYSTEM is a ``--peer-systems`` entry (``colocated``, ``colocated/TANDEM_X=V``); the engine's /metrics are read
from port 9477, so give the variant ``TANDEM_METRICS_PORT=9477`` (``colocated/TANDEM_METRICS_PORT=9477``).
The server is started as ``tandem bench serve --peer`` starts it (cores 0,1, fp32, 1 GiB of KV), warmed up with
4 requests, then driven by ``vllm bench serve`` from .peers/vllm; /proc gives every thread's user + system time
before and after, /metrics the engine's steps and their seconds.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from benchmarks.peers.vllm_server import run_vllm_client  # noqa: E402
from benchmarks.serve_peer import client_workloads, tandem_server  # noqa: E402

MODEL = Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct"
PEER_PYTHON = REPO / ".peers/vllm/bin/python"
METRICS_URL = "http://127.0.0.1:9477/metrics"
STEP_SERIES = ("engine_steps_total", "engine_step_seconds_total", "engine_step_prefill_tokens_total",
               "engine_step_decode_tokens_total")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``."""
    out: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def step_counters() -> dict[str, float]:
    text = urllib.request.urlopen(METRICS_URL, timeout=10).read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        for name in STEP_SERIES:
            if name in line and not line.startswith("#"):
                found[name] = found.get(name, 0.0) + float(line.split()[-1])
    return found


def main() -> None:
    system, rate = sys.argv[1], float(sys.argv[2])
    num_prompts = int(sys.argv[3]) if len(sys.argv) > 3 else 48
    workload = client_workloads(num_prompts)[sys.argv[4] if len(sys.argv) > 4 else "random-384-128"]
    logs = Path("/tmp/tandem-thread-cpu")
    logs.mkdir(exist_ok=True)
    with tandem_server(system, MODEL, "float32", "none", (0, 1), logs) as (url, _ready):
        port = url.rsplit(":", 1)[1]
        pid = int(os.popen(f"ss -ltnp 'sport = :{port}'").read().split("pid=")[1].split(",")[0])
        run_vllm_client(PEER_PYTHON, url, MODEL.name, MODEL, client_workloads(4)[workload.name], float("inf"),
                        logs / "warm.json", seed=100000)
        cpu0, steps0, t0 = thread_cpu(pid), step_counters(), time.monotonic()
        result = run_vllm_client(PEER_PYTHON, url, MODEL.name, MODEL, workload, rate, logs / "run.json")
        cpu1, steps1, wall = thread_cpu(pid), step_counters(), time.monotonic() - t0
    print(f"{system} {workload.name} at {rate:g} req/s: output {result['output_throughput']:.1f} tok/s, "
          f"TTFT p50 {result['median_ttft_ms']:.0f} ms, TPOT p50 {result['median_tpot_ms']:.1f} ms; "
          f"{wall:.1f} s from before the client's start to after its end")
    for tid, seconds in sorted(cpu1.items(), key=lambda kv: -(kv[1] - cpu0.get(kv[0], 0.0))):
        used = seconds - cpu0.get(tid, 0.0)
        if used > 0.05:
            role = "main (asyncio: gRPC, HTTP, output processing)" if tid == pid else "engine or OpenMP worker"
            print(f"  thread {tid}: {used:6.2f} CPU s ({100 * used / wall:5.1f}% of a core) {role}")
    delta = {k: steps1.get(k, 0.0) - steps0.get(k, 0.0) for k in STEP_SERIES}
    if delta["engine_steps_total"]:
        print(f"  engine: {delta['engine_steps_total']:.0f} steps, {delta['engine_step_seconds_total']:.1f} s, "
              f"mean {1000 * delta['engine_step_seconds_total'] / delta['engine_steps_total']:.1f} ms; "
              f"{delta['engine_step_prefill_tokens_total']:.0f} prefill + "
              f"{delta['engine_step_decode_tokens_total']:.0f} decode tokens")


if __name__ == "__main__":
    main()
