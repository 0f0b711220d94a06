"""A prefill node's TTFT with its decode node idle, and with the decode node decoding one long stream (session 35).

One disaggregated deployment (1 prefill + 1 decode node, a core each, every prompt to the prefill node), a
400-token history both hold, then a 70-token message, one request at a time (TTFT of 2-token answers);
alternating blocks of 6 requests with the decode node idle and with it decoding a 300-token prompt's
``LONG`` tokens (another client thread, restarted as each ends).

    PYTHONPATH=CHECKOUT python beside_decoding.py LONG [CPUS]   # CPUS: pin the gateway (every thread) there
"""

import dataclasses
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from benchmarks.bench_serve import SYSTEMS, deployment
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

system = dataclasses.replace(SYSTEMS["disaggregated"], name="disaggregated+shared", kv_offload="shared")
rng = random.Random(0)


def request(ids: list[int], n: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True))


with deployment(system, ("--dtype", "bfloat16"), 1, 1, (0, 1), Path("/tmp/beside-decoding-logs"),
                pool_args=("--num-blocks", "226"),
                role_pool_args={"prefill": ("--num-blocks", "226")}) as (t, _where):
    channel = grpc.insecure_channel(next(iter(t.values()))[0])
    grpc.channel_ready_future(channel).result(timeout=300)
    stub = generate_pb2_grpc.TandemStub(channel)
    if len(sys.argv) > 2:
        for pid in subprocess.run(["pgrep", "-f", "serve gateway"], capture_output=True, text=True).stdout.split():
            subprocess.run(["taskset", "-a", "-cp", sys.argv[2], pid], check=True, capture_output=True)
    history = [rng.randrange(1000, 40000) for _ in range(400)]

    def ttft_ms() -> float:
        start = time.perf_counter()
        for _ in stub.Generate(request(history + [rng.randrange(1000, 40000) for _ in range(70)], 2), timeout=60):
            return (time.perf_counter() - start) * 1e3
        raise RuntimeError("no token")

    def decoding(stop: threading.Event) -> None:
        while not stop.is_set():
            for _ in stub.Generate(request([rng.randrange(1000, 40000) for _ in range(300)], int(sys.argv[1])),
                                   timeout=120):
                if stop.is_set():
                    break

    for _ in range(5):
        ttft_ms()
    results: dict[str, list[float]] = {"idle decode node": [], "decode node decoding": []}
    for r in range(4):
        for mode in list(results) if r % 2 == 0 else list(results)[::-1]:
            stop, thread = threading.Event(), None
            if mode == "decode node decoding":
                thread = threading.Thread(target=decoding, args=(stop,))
                thread.start()
                time.sleep(1.5)
            for _ in range(6):
                results[mode].append(ttft_ms())
                time.sleep(0.3)
            stop.set()
            if thread is not None:
                thread.join()
            time.sleep(1)
    for mode, values in results.items():
        print(mode, "TTFT p50", round(statistics.median(values), 1), "ms;", sorted(round(v) for v in values))
