"""Where a one-prompt prefill step goes (session 37): prompts of T random tokens one at a time through Tandem's engine
(2,048-token steps, 512-token chunks: a prompt over 512 tokens takes several steps), every step timed by
benchmarks.step_timer's wrappers: linear layers, attention, the rest of the model, LM head, sampler, runner, scheduler.

    PYTHONPATH=CHECKOUT python prefill_profile.py T [DTYPE]
"""

import random
import sys
import time
from pathlib import Path

import torch

from benchmarks.step_timer import StepTimer
from common.config.engine_config import CacheConfig, SchedulerConfig
from common.engine.engine_core import ColocatedEngine
from common.model.loader import load_model
from common.model.model_store import DEFAULT_MODEL
from common.sampling.params import SamplingParams


class EveryStep(StepTimer):
    """StepTimer counting every step (its own counts only full-batch decode steps)."""

    def end_step(self, seconds: float) -> None:
        self._full_decode = True
        super().end_step(seconds)


T, DTYPE = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
torch.set_num_threads(2)
rng = random.Random(0)
model = load_model(Path.home() / ".cache/tandem/models" / DEFAULT_MODEL, dtype=getattr(torch, DTYPE))
engine = ColocatedEngine(model, CacheConfig(block_size=16, num_blocks=T // 16 * 4 + 64),
                         SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max(2048, T)))
greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def one(i: int, timer: EveryStep | None) -> None:
    engine.add_request(str(i), [rng.randrange(1000, 40000) for _ in range(T)], greedy)
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        if timer is not None:
            timer.end_step(time.perf_counter() - start)


for i in range(3):
    one(i, None)
timer = EveryStep(engine, 1)
for i in range(3, 9):
    one(i, timer)
p = timer.profile
parts = ", ".join(f"{name.split(' (')[0]} {s * 1e3:.1f}" for name, s in p.breakdown())
print(f"T={T} {DTYPE}: {p.seconds_per_step * 1e3:.1f} ms a step ({p.num_steps} steps): {parts}")
engine.close()
