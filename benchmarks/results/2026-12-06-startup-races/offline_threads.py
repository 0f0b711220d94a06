"""Offline prefill steps with the model built and stepped in different threads (session 33).

    TANDEM_EXP_STEPLOG=1 python offline_threads.py CHECKOUT PROMPT_LEN BATCH OUTPUT_LEN MODE

MODE: ``main`` (built and stepped in the main thread), ``thread`` (built in the main thread, stepped in another),
``thread-pause`` (the same after the main thread lets its libgomp team go: ``omp_pause_resource_all``), ``same``
(built and stepped in one thread that is not the main one). The step log (experiment-hooks.diff) gives each
step's CPU time over its wall time.
"""

import ctypes
import random
import sys
import threading
import time

sys.path.insert(0, sys.argv[1])
n, b, o, mode = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]


def build() -> object:
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    llm = LLM(dtype="bfloat16")
    llm.generate([[5] * 64], SamplingParams(max_tokens=2, ignore_eos=True))
    return llm


def run(llm: object) -> None:
    from common.sampling.params import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for _ in range(b)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=o, ignore_eos=True))  # type: ignore[attr-defined]
    print(f"{b}x{n}->{o} ({mode}): {1000 * (time.perf_counter() - t):.0f} ms", file=sys.stderr)


def in_thread(fn: object) -> None:
    th = threading.Thread(target=fn)  # type: ignore[arg-type]
    th.start()
    th.join()


if mode == "same":
    in_thread(lambda: run(build()))
else:
    model = build()
    if mode == "thread-pause":
        with open("/proc/self/maps") as maps:
            gomp = next(line.split()[-1] for line in maps if "libgomp" in line)
        print("pause ->", ctypes.CDLL(gomp).omp_pause_resource_all(1), file=sys.stderr)
    if mode == "main":
        run(model)
    else:
        in_thread(lambda: run(model))
