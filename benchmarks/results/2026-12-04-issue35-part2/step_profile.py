"""Batch-1 decode steps of the bundled model under cProfile, in one tree: `cd TREE && python step_profile.py MODEL_DIR`.

Prints the function-call count of 64 decode steps and the functions with the most own time: how much Python
a step runs around its one C++ call, compared between trees independently of the host's speed."""
import cProfile
import io
import pstats
import sys

sys.path.insert(0, ".")
import torch

from common.config.engine_config import CacheConfig, SchedulerConfig
from common.engine.engine_core import ColocatedEngine
from common.model.loader import load_model
from common.sampling.params import SamplingParams

model = load_model(sys.argv[1], dtype="float32")
engine = ColocatedEngine(model, CacheConfig(block_size=16, num_blocks=64),
                         SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048, max_prefill_chunk=512))
prompt = torch.randint(10, 40000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
engine.add_request("w", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
while engine.has_unfinished():
    engine.step()
engine.add_request("a", prompt[::-1], SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True))
engine.step()  # the prefill
profile = cProfile.Profile()
profile.enable()
steps = 0
while engine.has_unfinished():
    engine.step()
    steps += 1
profile.disable()
out = io.StringIO()
stats = pstats.Stats(profile, stream=out)
print("steps", steps, "calls", stats.total_calls)  # type: ignore[attr-defined]  # not in typeshed's stub
stats.sort_stats("tottime").print_stats(12)
print(out.getvalue())
