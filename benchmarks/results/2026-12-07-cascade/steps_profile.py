"""N requests offline, all at once, through Tandem's engine: every step's parts (benchmarks.step_timer's wrappers),
summed by kind of step: prefill only, mixed (prefill chunks beside decode rows), decode only (session 39). SHARED=n
puts the same n random tokens before every prompt (the shared-prefix workload without the server).

    PYTHONPATH=CHECKOUT python steps_profile.py DTYPE PROMPT OUTPUT [N]          # e.g. bfloat16 1024 64 48
    SHARED=512 PYTHONPATH=CHECKOUT python steps_profile.py bfloat16 64 64 48
"""

import collections
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.step_timer import StepProfile, StepTimer
from common.engine.llm import LLM
from common.sampling.params import SamplingParams

DTYPE, PROMPT, OUTPUT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
N = int(sys.argv[4]) if len(sys.argv) > 4 else 48
SHARED = int(os.environ.get("SHARED", "0"))
torch.set_num_threads(2)
rng = random.Random(0)
llm = LLM(dtype=DTYPE)
engine = llm.engine
shared = [rng.randrange(1000, 40000) for _ in range(SHARED)]
prompts = [shared + [rng.randrange(1000, 40000) for _ in range(PROMPT)] for _ in range(N)]
params = [SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True) for _ in range(N)]
llm.generate([[rng.randrange(1000, 40000) for _ in range(PROMPT)] for _ in range(2)], SamplingParams(max_tokens=4))
profiles: dict[str, StepProfile] = collections.defaultdict(lambda: StepProfile(0))
tokens: collections.Counter[str] = collections.Counter()


class ByKind(StepTimer):
    """StepTimer summing every step, by its kind."""

    kind = ""

    def _wrap(self, part: str, fn: Callable[..., Any], classify: bool = False) -> Callable[..., Any]:
        inner = super()._wrap(part, fn, False)
        if not classify:
            return inner

        def timed(*args: Any, **kwargs: Any) -> Any:
            s = args[0]
            prefill = sum(max(0, min(c.start + c.num_tokens, c.request.num_prompt_tokens) - c.start) for c in s.chunks)
            decode = s.num_tokens - prefill
            self.kind = "prefill only" if decode == 0 else "decode only" if prefill == 0 else "mixed"
            tokens[self.kind + " prefill"] += prefill
            tokens[self.kind + " decode"] += decode
            return inner(*args, **kwargs)

        return timed

    def end_step(self, seconds: float) -> None:
        p = profiles[self.kind]
        p.num_steps += 1
        p.seconds["step"] += seconds
        for part, spent in self._current.items():
            p.seconds[part] += spent
        self._current.clear()


timer = ByKind(engine, 0)
engine_step = engine.step


def step() -> Any:
    start = time.perf_counter()
    out = engine_step()
    timer.end_step(time.perf_counter() - start)
    return out


setattr(engine, "step", step)  # noqa: B010
start = time.perf_counter()
llm.generate(prompts, params)
wall = time.perf_counter() - start
print(f"{N} x ({SHARED} shared + {PROMPT}) -> {OUTPUT} {DTYPE}: wall {wall:.2f} s, "
      f"{N * OUTPUT / wall:.1f} output tok/s")
for kind, p in profiles.items():
    parts = ", ".join(f"{name.split(' (')[0]} {s * p.num_steps:.2f}" for name, s in p.breakdown())
    print(f"  {kind}: {p.num_steps} steps {p.seconds['step']:.2f} s (prefill tokens {tokens[kind + ' prefill']}, "
          f"decode rows {tokens[kind + ' decode']}): {parts}")
