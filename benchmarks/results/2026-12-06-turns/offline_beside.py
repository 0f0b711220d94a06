"""Tandem's prefill step (the offline engine on cpu 0: 70 new tokens over a 400-token cached history) with the other
core idle, decoding (the offline engine in another process on cpu 1) or copying memory, alternating blocks of 8
(each background process is stopped with SIGSTOP outside its blocks; session 35).

    PYTHONPATH=CHECKOUT python offline_beside.py
"""

import os
import random
import signal
import statistics
import subprocess
import sys
import time

import torch

from common.engine.llm import LLM
from common.sampling.params import SamplingParams

DECODING = """
import os, random
os.sched_setaffinity(0, {1})
import torch
torch.set_num_threads(1)
from common.engine.llm import LLM
from common.sampling.params import SamplingParams
rng = random.Random(1)
llm = LLM(dtype="bfloat16")
print("ready", flush=True)
while True:
    llm.generate([[rng.randrange(1000, 40000) for _ in range(300)]],
                 SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
"""
MEMORY = """
import os
os.sched_setaffinity(0, {1})
import torch
torch.set_num_threads(1)
x = torch.randn(64 * 1024 * 1024 // 2, dtype=torch.bfloat16)
y = torch.empty_like(x)
print("ready", flush=True)
while True:
    y.copy_(x)
"""


def main() -> None:
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    llm = LLM(dtype="bfloat16")
    rng = random.Random(0)
    history = [rng.randrange(1000, 40000) for _ in range(400)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def step_ms() -> float:
        start = time.perf_counter()
        llm.generate([history + [rng.randrange(1000, 40000) for _ in range(70)]], one)
        return (time.perf_counter() - start) * 1e3

    for _ in range(5):
        step_ms()
    results: dict[str, list[float]] = {"idle": [], "decoding": [], "memory": []}
    procs = {name: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for name, code in (("decoding", DECODING), ("memory", MEMORY))}
    for proc in procs.values():
        assert proc.stdout is not None
        proc.stdout.readline()
        os.kill(proc.pid, signal.SIGSTOP)  # until its block
    try:
        for r in range(4):
            for mode in list(results) if r % 2 == 0 else list(results)[::-1]:
                if mode in procs:
                    os.kill(procs[mode].pid, signal.SIGCONT)
                    time.sleep(1.0)
                results[mode] += [step_ms() for _ in range(8)]
                if mode in procs:
                    os.kill(procs[mode].pid, signal.SIGSTOP)
    finally:
        for proc in procs.values():
            proc.kill()
    for mode, values in results.items():
        values = sorted(values)
        print(f"{mode}: prefill step ms p50 {statistics.median(values):.1f}, p10 {values[len(values) // 10]:.1f}, "
              f"p90 {values[9 * len(values) // 10]:.1f}")


if __name__ == "__main__":
    main()
