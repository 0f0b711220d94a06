"""`tandem serve colocated` from two checkouts, started one after the other and alternating (each start runs its
own start-up races), time to first token of two request shapes (session 34): a ~99-token turn over a 496-token
history cached on the server, and a fresh ~384-token prompt. One request at a time, max_tokens 1, greedy.

    python ab_colo.py base=CHECKOUT,main=CHECKOUT STARTS THREADS DTYPE OUT.json
"""

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

trees = dict(t.split("=") for t in sys.argv[1].split(","))
starts, threads, dtype, out_path = int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5])
rng = random.Random(0)
words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "orange", "window", "music", "table",
         "green", "light"]
history = " ".join(rng.choice(words) for _ in range(500))
res: dict[str, dict[str, list[float]]] = {n: {"turn": [], "fresh": []} for n in trees}
for s in range(starts):
    for name, tree in list(trees.items()) if s % 2 == 0 else list(trees.items())[::-1]:
        port = 50411
        with open(out_path.with_name(f"ab-{name}-{s}.log"), "w") as log:
            server = subprocess.Popen([sys.executable, "-m", "tandem_cli.cli", "serve", "colocated", "--port",
                                       str(port), "--http-port", "0", "--dtype", dtype, "--threads", threads],
                                      cwd=tree, env=dict(os.environ, PYTHONPATH=tree), stdout=log,
                                      stderr=subprocess.STDOUT)
        try:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            grpc.channel_ready_future(channel).result(timeout=300)
            stub = generate_pb2_grpc.TandemStub(channel)

            def ttft_ms(text: str, stub: generate_pb2_grpc.TandemStub = stub) -> float:
                start = time.perf_counter()
                list(stub.Generate(generate_pb2.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(
                    max_tokens=1, temperature=0.0, ignore_eos=True)), timeout=300))
                return (time.perf_counter() - start) * 1e3

            for i in range(3):
                ttft_ms(history + f" warm {i}")
            for i in range(12):
                message = " ".join(rng.choice(words) for _ in range(90))
                res[name]["turn"].append(ttft_ms(f"{history}{message} #{s}-{i}"))
                res[name]["fresh"].append(ttft_ms(f"{s}-{i} " + " ".join(rng.choice(words) for _ in range(380))))
            print(s, name, {k: round(statistics.median(v[-12:]), 1) for k, v in res[name].items()}, flush=True)
            channel.close()
        finally:
            server.terminate()
            server.wait(30)
first, second = trees
for shape in ("turn", "fresh"):
    a, b = (statistics.median(res[n][shape]) for n in (first, second))
    print(shape, f"TTFT p50 {first} {a:.1f} ms, {second} {b:.1f} ms: {second}/{first} {b / a:.3f}")
out_path.write_text(json.dumps(res, indent=1))
