"""A prefill node's TTFT with its decode node idle or decoding one long stream, with the gateway and this client
left to the scheduler or either or both pinned to the decode node's core (session 37; session 35's
beside_decoding.py, extended).

One disaggregated deployment (1 prefill + 1 decode node, a core each, every prompt to the prefill node), a
400-token history both hold, then a 70-token message, one request at a time (TTFT of 2-token answers); rounds of
blocks of 6 requests (decode node idle / decoding x each of PINS: none, gateway, client, both on the decode core),
the blocks' order reversing each round. Pinning is `taskset -a -cp` on every thread of the gateway and of this
process; unpinned is both cores.

    PYTHONPATH=CHECKOUT python beside_pinned.py LONG [ROUNDS] [PINS]    # PINS: e.g. none,both (default all four)
"""

import dataclasses
import os
import random
import re
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
LONG = int(sys.argv[1])
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
PINS = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none", "gateway", "client", "both"]


def request(ids: list[int], n: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True))


def pin(pids: list[str], cpus: str) -> None:
    for pid in pids:
        subprocess.run(["taskset", "-a", "-cp", cpus, pid], check=True, capture_output=True)


with deployment(system, ("--dtype", "bfloat16"), 1, 1, (0, 1), Path("/tmp/beside-pinned-logs"),
                pool_args=("--num-blocks", "226"),
                role_pool_args={"prefill": ("--num-blocks", "226")}) as (t, where):
    print("placement:", where, flush=True)
    decode_cpu = re.search(r"decode\S* \[cpu (\d+)\]", where)
    assert decode_cpu is not None, where
    channel = grpc.insecure_channel(next(iter(t.values()))[0])
    grpc.channel_ready_future(channel).result(timeout=300)
    stub = generate_pb2_grpc.TandemStub(channel)
    gateway = subprocess.run(["pgrep", "-f", "serve gateway"], capture_output=True, text=True).stdout.split()
    client = [str(os.getpid())]
    history = [rng.randrange(1000, 40000) for _ in range(400)]

    def ttft_ms() -> float:
        start = time.perf_counter()
        for _ in stub.Generate(request(history + [rng.randrange(1000, 40000) for _ in range(70)], 2), timeout=60):
            return (time.perf_counter() - start) * 1e3
        raise RuntimeError("no token")

    def decoding(stop: threading.Event) -> None:
        while not stop.is_set():
            for _ in stub.Generate(request([rng.randrange(1000, 40000) for _ in range(300)], LONG), timeout=120):
                if stop.is_set():
                    break

    for _ in range(5):
        ttft_ms()
    modes = [(d, p) for p in PINS for d in ("idle", "decoding")]
    results: dict[tuple[str, str], list[float]] = {m: [] for m in modes}
    for r in range(ROUNDS):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            pin(gateway, decode_cpu.group(1) if mode[1] in ("gateway", "both") else "0,1")
            pin(client, decode_cpu.group(1) if mode[1] in ("client", "both") else "0,1")
            stop, thread = threading.Event(), None
            if mode[0] == "decoding":
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
        print(f"decode node {mode[0]}, pinned to its core: {mode[1]}: TTFT p50 {statistics.median(values):.1f} ms;",
              sorted(round(v) for v in values), flush=True)
