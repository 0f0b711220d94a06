"""N requests of random tokens offline, all at once, through Tandem's engine: each step's prefill tokens, decode rows
and seconds (session 37; session 36's chat_steps.py for random shapes). Says where a saturated served run's time goes,
without the server.

    PYTHONPATH=CHECKOUT python random_steps.py DTYPE PROMPT OUTPUT [N]
"""

import collections
import random
import statistics
import sys
import time

import torch

from common.engine.llm import LLM
from common.engine.scheduler_output import SchedulerOutput
from common.sampling.params import SamplingParams

DTYPE, PROMPT, OUTPUT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
N = int(sys.argv[4]) if len(sys.argv) > 4 else 48
torch.set_num_threads(2)
rng = random.Random(0)
llm = LLM(dtype=DTYPE)
prompts = [[rng.randrange(1000, 40000) for _ in range(PROMPT)] for _ in range(N)]
params = [SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True) for _ in range(N)]
steps: list[tuple[int, int, float]] = []
engine = llm.engine
inner = engine.runner.execute


def timed(scheduled: SchedulerOutput) -> object:
    start = time.perf_counter()
    out = inner(scheduled)
    prefill = sum(max(0, min(c.start + c.num_tokens, c.request.num_prompt_tokens) - c.start)
                  for c in scheduled.chunks)
    steps.append((prefill, scheduled.num_tokens - prefill, time.perf_counter() - start))
    return out


llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm
setattr(engine.runner, "execute", timed)  # noqa: B010
start = time.perf_counter()
llm.generate(prompts, params)
wall = time.perf_counter() - start
kinds: dict[str, list[tuple[int, int, float]]] = collections.defaultdict(list)
for s in steps:
    kinds["prefill only" if s[1] == 0 else "decode only" if s[0] == 0 else "mixed"].append(s)
print(f"{N} requests, {sum(map(len, prompts))} prompt tokens, {sum(p.max_tokens for p in params)} output tokens; "
      f"wall {wall:.1f} s, {sum(p.max_tokens for p in params) / wall:.1f} output tok/s; {len(steps)} steps, "
      f"{sum(s[2] for s in steps):.1f} s in steps")
for kind, ss in kinds.items():
    print(f"  {kind}: {len(ss)} steps, {sum(s[2] for s in ss):.1f} s; prefill tokens {sum(s[0] for s in ss)}, "
          f"decode rows {sum(s[1] for s in ss)}; median step {statistics.median(s[2] for s in ss) * 1e3:.0f} ms")
dec = [s for s in kinds["decode only"]]
by_batch: dict[int, list[float]] = collections.defaultdict(list)
for s in dec:
    by_batch[s[1] // 8 * 8].append(s[2])
for b in sorted(by_batch):
    median = statistics.median(by_batch[b]) * 1e3
    print(f"    decode rows {b}-{b + 7}: {len(by_batch[b])} steps, median {median:.1f} ms")
