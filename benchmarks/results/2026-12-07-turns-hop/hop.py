"""One request at a time, the same shape every time, disaggregated+shared and colocated+shared up side by side on
the same two cores (session 35's idle_ab.py setup): a 528-token history (cached after the warm-up) plus NEW random
tokens, 8 output tokens, the systems alternating request by request; prints each system's client TTFT p10 / p50 /
p90 and the median of the per-request ratios (session 40). With TANDEM_TRACE_CONSOLE=1 every service prints its
spans into LOGDIR (spans_hop.py reads them); PIN_GW=CORES pins the gateway (every thread) to those cores.

    PYTHONPATH=CHECKOUT python hop.py REQUESTS NEW
"""

from __future__ import annotations

import dataclasses
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from benchmarks.bench_serve import SYSTEMS, deployment
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

MODEL_ARGS = ("--dtype", "bfloat16")
POOL = ("--num-blocks", "173", "--kv-offload-gb", "2")
ROLES = {"prefill": ("--num-blocks", "120"), "decode": ("--num-blocks", "226")}


def generate(stub: generate_pb2_grpc.TandemStub, ids: list[int], n: int) -> float:
    """The client's TTFT (ms) of one greedy request."""
    start, ttft = time.perf_counter(), 0.0
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=ids), stream=generate_pb2.StreamOptions(include_token_ids=True),
        sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    for _ in stub.Generate(request, timeout=300):
        ttft = ttft or (time.perf_counter() - start) * 1e3
    return ttft


def main(num_requests: int, new: int) -> None:
    log = Path(os.environ.get("LOGDIR", "/tmp/hop-logs"))
    log.mkdir(parents=True, exist_ok=True)
    dis = dataclasses.replace(SYSTEMS["disaggregated"], name="disaggregated+shared", kv_offload="shared")
    col = dataclasses.replace(SYSTEMS["colocated"], name="colocated+shared", kv_offload="shared")
    rng = random.Random(0)
    lending = os.environ.get("CPU_LENDING", "1") == "1"  # session 41: CPU_LENDING=0 for the deployment before it
    with deployment(dis, MODEL_ARGS, 1, 1, (0, 1), log, pool_args=POOL, role_pool_args=ROLES,
                    cpu_lending=lending) as (t_dis, p1), \
            deployment(col, MODEL_ARGS, 1, 1, (0, 1), log, pool_args=POOL) as (t_col, p2):
        print(p1, "|", p2, flush=True)
        if cores := os.environ.get("PIN_GW"):
            pids = subprocess.run(["pgrep", "-f", "--", "--prefill "], capture_output=True, text=True).stdout.split()
            for pid in pids:
                subprocess.run(["taskset", "-a", "-cp", cores, pid], capture_output=True, check=False)
            print("gateway", pids, "pinned to", cores, flush=True)
        stubs = {}
        for name, targets in (("dis", t_dis), ("col", t_col)):
            channel = grpc.insecure_channel(next(iter(targets.values()))[0])
            grpc.channel_ready_future(channel).result(timeout=300)
            stubs[name] = generate_pb2_grpc.TandemStub(channel)
        history = [rng.randrange(1000, 40000) for _ in range(528)]
        for stub in stubs.values():  # kernels built, the history cached
            for _ in range(3):
                generate(stub, [*history, *(rng.randrange(1000, 40000) for _ in range(new))], 4)
        ttft: dict[str, list[float]] = {"dis": [], "col": []}
        for i in range(num_requests):
            message = [rng.randrange(1000, 40000) for _ in range(new)]
            for name in (("dis", "col") if i % 2 == 0 else ("col", "dis")):
                ttft[name].append(generate(stubs[name], [*history, *message], 8))
                time.sleep(0.3)
    for name, values in ttft.items():
        v = sorted(values)
        print(name, "p10 / p50 / p90", round(v[len(v) // 10], 2), round(statistics.median(v), 2),
              round(v[9 * len(v) // 10], 2))
    print("paired median dis/col", round(statistics.median(a / b for a, b in zip(ttft["dis"], ttft["col"],
                                                                                 strict=True)), 4))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
