"""A prefill step (SmolLM2, bf16, the offline engine: NEW tokens after a 512-token cached history, 1 output token) on
one thread, and on two with the second on the other core, as a prefill node that borrows its decode node's core
runs it (session 41). MODE: ``pin1``: the process on one CPU when torch loads (libgomp counts 1 CPU and
throttles its workers' spin to 100 rounds: they sleep between kernels), ``pin2``: on both, then the main thread
narrowed to CPU 0 (what ``CoreBorrower.adopt`` does); the worker starts with both CPUs in its mask either way.

    PYTHONPATH=CHECKOUT [GOMP_SPINCOUNT=30000] python offline_lend.py pin1|pin2 [NEW]
"""

import os
import random
import statistics
import sys
import time

MODE = sys.argv[1]
NEW = int(sys.argv[2]) if len(sys.argv) > 2 else 100
os.sched_setaffinity(0, {0} if MODE == "pin1" else {0, 1})
import torch  # noqa: E402 - libgomp counts the CPUs when it loads

from common.engine.llm import LLM  # noqa: E402
from common.sampling.params import SamplingParams  # noqa: E402

os.sched_setaffinity(0, {0})
torch.set_num_threads(1)
llm = LLM(dtype="bfloat16")
os.sched_setaffinity(0, {0, 1})  # the worker thread starts with both CPUs in its mask
torch.set_num_threads(2)
x = torch.randn(1024, 1024)
(x @ x).sum()
os.sched_setaffinity(0, {0})
rng = random.Random(0)
history = [rng.randrange(1000, 40000) for _ in range(512)]


def step_ms(threads: int) -> float:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    llm.generate([history + [rng.randrange(1000, 40000) for _ in range(NEW)]],
                 SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    elapsed = (time.perf_counter() - start) * 1e3
    torch.set_num_threads(1)
    return elapsed


for t in (1, 2):
    step_ms(t)
    step_ms(t)
for t in (1, 2, 1, 2):
    v = sorted(step_ms(t) for _ in range(10))
    print(f"{MODE} GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '-')} threads {t} new {NEW}: "
          f"p50 {statistics.median(v):.1f} ms, min {v[0]:.1f}", flush=True)
