"""Where a decode step goes at several batch sizes, ~550 tokens of context each (session 36): the chat
workload's saturated steady state, offline, through Tandem's engine with benchmarks.step_timer.

    PYTHONPATH=CHECKOUT python decode_profile.py DTYPE BATCHES [CONTEXT]    # BATCHES: e.g. 1,4,8,12,24,48
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

DTYPE, BATCHES = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
CONTEXT = int(sys.argv[3]) if len(sys.argv) > 3 else 550
torch.set_num_threads(2)
rng = random.Random(0)
for batch in BATCHES:  # a model each: a StepTimer wraps the model's methods
    model = load_model(Path.home() / ".cache/tandem/models" / DEFAULT_MODEL, dtype=getattr(torch, DTYPE))
    engine = ColocatedEngine(model, CacheConfig(block_size=16, num_blocks=batch * (CONTEXT // 16 + 4) + 16),
                             SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=2048))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(1000, 40000) for _ in range(CONTEXT)], greedy)
    timer = StepTimer(engine, batch)
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        timer.end_step(time.perf_counter() - start)
    p = timer.profile
    parts = ", ".join(f"{name.split(' (')[0]} {s * 1e3:.1f}" for name, s in p.breakdown())
    print(f"batch {batch}: {p.seconds_per_step * 1e3:.1f} ms a step ({p.num_steps} steps): {parts}", flush=True)
    engine.close()
