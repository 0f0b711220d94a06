"""Two deployments (run_up.py) from two checkouts, up side by side on the same cores, the same request shape sent
to each in alternating blocks of 15, one at a time: a ~99-token message after a ~500-token history both prefix
caches hold (session 34). Prints the TTFT p50 so far after each round, then each system's p10 / p50 / p90.

    python hops.py OLD_CHECKOUT NEW_CHECKOUT DTYPE ROUNDS [GATEWAY_ARG ...]    # e.g. --local-prefill-max-tokens 0
"""

import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

trees = {"old": sys.argv[1], "new": sys.argv[2]}
dtype, rounds, gateway_args = sys.argv[3], int(sys.argv[4]), sys.argv[5:]
here = Path(__file__).resolve().parent
procs = {}
for name, tree in trees.items():
    procs[name] = subprocess.Popen([sys.executable, str(here / "run_up.py"), dtype, f"/tmp/hops-logs-{name}",
                                    *gateway_args], cwd=tree, env=dict(os.environ, PYTHONPATH=tree),
                                   stdout=subprocess.PIPE, text=True)
try:
    stubs = {}
    for name, proc in procs.items():
        assert proc.stdout is not None
        channel = grpc.insecure_channel(proc.stdout.readline().strip())
        grpc.channel_ready_future(channel).result(timeout=300)
        stubs[name] = generate_pb2_grpc.TandemStub(channel)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "orange", "window", "music",
             "table", "green", "light"]
    history = " ".join(rng.choice(words) for _ in range(500))

    def ttft_ms(stub: generate_pb2_grpc.TandemStub, i: int) -> float:
        message = " ".join(rng.choice(words) for _ in range(90)) + f" #{i}"
        start = time.perf_counter()
        call = stub.Generate(generate_pb2.GenerateRequest(text=history + message, sampling=common_pb2.SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True)), timeout=300)
        next(call)
        took = (time.perf_counter() - start) * 1e3
        for _ in call:
            pass
        return took

    for name in trees:  # the history cached, the kernels built
        for i in range(5):
            ttft_ms(stubs[name], -i)
    ttft: dict[str, list[float]] = {n: [] for n in trees}
    for r in range(rounds):
        for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            for i in range(15):
                ttft[name].append(ttft_ms(stubs[name], r * 1000 + i))
                time.sleep(0.05)
        print(r, {n: round(statistics.median(v), 1) for n, v in ttft.items()}, flush=True)
    for name, values in ttft.items():
        v = sorted(values)
        print(name, "n", len(v), f"p10 {v[len(v) // 10]:.1f} p50 {statistics.median(v):.1f} "
              f"p90 {v[9 * len(v) // 10]:.1f} mean {statistics.mean(v):.1f}")
    print(f"new/old p50 {statistics.median(ttft['new']) / statistics.median(ttft['old']):.3f}")
finally:
    for proc in procs.values():
        proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
