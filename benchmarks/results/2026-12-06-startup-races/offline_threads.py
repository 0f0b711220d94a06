"""Offline prefill steps with the model built in the main thread and the engine stepped in another (session 33).

    TANDEM_EXP_STEPLOG=1 python offline_threads.py CHECKOUT PROMPT_LEN BATCH OUTPUT_LEN pause|nopause

``pause``: the main thread lets its libgomp team go (``omp_pause_resource_all``) before the other thread steps.
The step log (experiment-hooks.diff) gives each step's CPU time over its wall time.
"""

import ctypes
import random
import sys
import threading
import time

sys.path.insert(0, sys.argv[1])
from common.engine.llm import LLM
from common.sampling.params import SamplingParams

n, b, o = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(dtype="bfloat16")
rng = random.Random(0)


def rand(k: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(k)]


llm.generate([rand(64)], SamplingParams(max_tokens=2, ignore_eos=True))
if sys.argv[5] == "pause":
    with open("/proc/self/maps") as maps:
        gomp = next(line.split()[-1] for line in maps if "libgomp" in line)
    print("pause ->", ctypes.CDLL(gomp).omp_pause_resource_all(1), file=sys.stderr)


def work() -> None:
    t = time.perf_counter()
    llm.generate([rand(n) for _ in range(b)], SamplingParams(max_tokens=o, ignore_eos=True))
    print(f"{b}x{n}->{o}: {1000 * (time.perf_counter() - t):.0f} ms", file=sys.stderr)


th = threading.Thread(target=work)
th.start()
th.join()
