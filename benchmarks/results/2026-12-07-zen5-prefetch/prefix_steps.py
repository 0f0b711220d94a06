"""N shared-prefix requests offline, all at once, through Tandem's engine (session 38): the first steps' prefill
tokens, decode rows and ms, and the decode-only steps' median. The shared-prefix workload at saturation without
the server.

    PYTHONPATH=CHECKOUT python prefix_steps.py DTYPE PREFIX SUFFIX OUTPUT [N]    # e.g. bfloat16 512 64 64
"""

import random
import statistics
import sys
import time

import torch

from common.engine.llm import LLM
from common.engine.scheduler_output import SchedulerOutput
from common.sampling.params import SamplingParams

DTYPE, PREFIX, SUFFIX, OUTPUT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
N = int(sys.argv[5]) if len(sys.argv) > 5 else 48
torch.set_num_threads(2)
rng = random.Random(0)
llm = LLM(dtype=DTYPE)
prefix = [rng.randrange(1000, 40000) for _ in range(PREFIX)]
prompts = [prefix + [rng.randrange(1000, 40000) for _ in range(SUFFIX)] for _ in range(N)]
params = [SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True) for _ in range(N)]
steps: list[tuple[int, int, float, int]] = []  # prefill tokens, decode rows, seconds, chunks
engine = llm.engine
inner = engine.runner.execute


def timed(scheduled: SchedulerOutput) -> object:
    start = time.perf_counter()
    out = inner(scheduled)
    prefill = sum(max(0, min(c.start + c.num_tokens, c.request.num_prompt_tokens) - c.start)
                  for c in scheduled.chunks)
    steps.append((prefill, scheduled.num_tokens - prefill, time.perf_counter() - start, len(scheduled.chunks)))
    return out


llm.generate([[5] * 40, [6] * 40], SamplingParams(max_tokens=4))  # warm
setattr(engine.runner, "execute", timed)  # noqa: B010
start = time.perf_counter()
llm.generate(prompts, params)
wall = time.perf_counter() - start
print(f"{N} requests, wall {wall:.2f} s, {N * OUTPUT / wall:.1f} output tok/s; {len(steps)} steps, "
      f"{sum(s[2] for s in steps):.2f} s in steps")
for i, s in enumerate(steps[:4]):
    print(f"  step {i}: prefill {s[0]}, decode {s[1]}, chunks {s[3]}, {s[2] * 1e3:.1f} ms")
decode = [s for s in steps if s[0] == 0]
print(f"  decode-only {len(decode)} steps {sum(s[2] for s in decode):.2f} s, "
      f"median {statistics.median(s[2] for s in decode) * 1e3:.1f} ms")
