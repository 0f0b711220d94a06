"""A full queue's prefill, offline, alternating Tandem checkouts in fresh processes (session 32).

    python benchmarks/results/2026-12-06-fused-rounding/prefill_ab.py WORKTREE [WORKTREE ...]

Each round starts one process per checkout in turn (cores 0,1; ``AB_DTYPE``, bf16 unless set), which warms up and
then prefills ``AB_N`` random prompts of ``AB_LEN`` tokens (48 x 384 unless set) ``AB_RUNS`` times (4), one
output token each; prints each run's milliseconds. Three rounds.
"""

from __future__ import annotations

import os
import subprocess
import sys

WORKER = """
import os, random, sys, time
sys.path.insert(0, sys.argv[1])
from common.engine.llm import LLM
from common.sampling.params import SamplingParams
llm = LLM(dtype=os.environ.get("AB_DTYPE", "bfloat16"))
rng = random.Random(1)
llm.generate([[5] * 64], SamplingParams(max_tokens=2, ignore_eos=True))
n, length = int(os.environ.get("AB_N", "48")), int(os.environ.get("AB_LEN", "384"))
for _ in range(int(os.environ.get("AB_RUNS", "4"))):
    prompts = [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(n)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    print(f"{1000 * (time.perf_counter() - t):.0f}", flush=True)
"""


def main(trees: list[str]) -> None:
    for r in range(3):
        for tree in trees:
            out = subprocess.run(["taskset", "-c", "0,1", sys.executable, "-c", WORKER, tree], capture_output=True,
                                 text=True, check=True, env={**os.environ, "PYTHONPATH": tree}).stdout.split()
            print(f"round {r} {tree}: {' '.join(out)} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
