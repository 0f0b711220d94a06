"""Disaggregated+shared vs colocated+shared up side by side on the same two cores, one request at a time (no
contention): conversations of 3 turns (a 128-token system prompt, 60-140-token messages, 40-token answers,
1 s between turns), the systems alternating by conversation; prints TTFT p50 of turns 2-3 so far after each
conversation, then p10 / p50 / p90 (session 35). With TANDEM_TRACE_CONSOLE=1 every service prints its spans
into the log folder (the breakdown: ../2026-12-06-decode-prefetch/spans.py).

    PYTHONPATH=CHECKOUT python idle_ab.py CONVERSATIONS [conditional]   # conditional: that system in place
"""
import dataclasses
import os
import random
import statistics
import sys
import time
from pathlib import Path

import grpc

from benchmarks.bench_serve import SYSTEMS, deployment
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

model_args = ("--dtype", "bfloat16")
log = Path("/tmp/idle-ab-logs")
log.mkdir(parents=True, exist_ok=True)
kind = "conditional" if len(sys.argv) > 2 and sys.argv[2] == "conditional" else "disaggregated"
dis = dataclasses.replace(SYSTEMS[kind], name=f"{kind}+shared", kv_offload="shared")
col = dataclasses.replace(SYSTEMS["colocated"], name="colocated+shared", kv_offload="shared")
pool = ("--num-blocks", "173", "--kv-offload-gb", "2")
roles = {"prefill": ("--num-blocks", os.environ.get("PREFILL_BLOCKS", "120")), "decode": ("--num-blocks", "226")}
conversations = int(sys.argv[1])
rng = random.Random(0)


def generate(stub: generate_pb2_grpc.TandemStub, ids: list[int], n: int) -> tuple[float, list[int]]:
    """TTFT (ms) and the tokens of one greedy request."""
    start, ttft, out = time.perf_counter(), 0.0, []
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=ids), stream=generate_pb2.StreamOptions(include_token_ids=True),
        sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    for response in stub.Generate(request, timeout=300):
        ttft = ttft or (time.perf_counter() - start) * 1e3
        out += list(response.token_ids)
    return ttft, out


with deployment(dis, model_args, 1, 1, (0, 1), log, pool_args=pool, role_pool_args=roles) as (t_dis, p1), \
        deployment(col, model_args, 1, 1, (0, 1), log, pool_args=pool) as (t_col, p2):
    print(p1, "|", p2, flush=True)
    stubs = {}
    for name, targets in (("dis", t_dis), ("col", t_col)):
        channel = grpc.insecure_channel(next(iter(targets.values()))[0])
        grpc.channel_ready_future(channel).result(timeout=300)
        stubs[name] = generate_pb2_grpc.TandemStub(channel)
    system = [rng.randrange(1000, 40000) for _ in range(128)]
    for stub in stubs.values():  # the kernels built, the system prompt cached
        generate(stub, [*system, 5, 6, 7], 4)
    ttft: dict[str, list[float]] = {"dis": [], "col": []}
    for c in range(conversations):
        messages = [[rng.randrange(1000, 40000) for _ in range(rng.randint(60, 140))] for _ in range(3)]
        for name in (("dis", "col") if c % 2 == 0 else ("col", "dis")):
            prompt = system + messages[0]
            for turn in range(3):
                took, out = generate(stubs[name], prompt, 40)
                if turn > 0:
                    ttft[name].append(took)
                prompt = prompt + out + (messages[turn + 1] if turn < 2 else [])
                time.sleep(1.0)
        print(c, {k: round(statistics.median(v), 1) for k, v in ttft.items() if v}, flush=True)
    for name, values in ttft.items():
        values = sorted(values)
        print(name, "p10 / p50 / p90", round(values[len(values) // 10], 1), round(statistics.median(values), 1),
              round(values[9 * len(values) // 10], 1))
