"""Offline prefill steps with everything in the main thread (session 33; see offline_threads.py).

    TANDEM_EXP_STEPLOG=1 python offline_threads_main.py CHECKOUT PROMPT_LEN BATCH OUTPUT_LEN
"""

import random
import sys
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
t = time.perf_counter()
llm.generate([rand(n) for _ in range(b)], SamplingParams(max_tokens=o, ignore_eos=True))
print(f"{b}x{n}->{o}: {1000 * (time.perf_counter() - t):.0f} ms", file=sys.stderr)
