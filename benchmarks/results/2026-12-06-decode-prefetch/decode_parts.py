"""The one-call decode step's parts (projections, attention, the rest), ms per step, for 48 x 384-token prompts
decoding 128 tokens, from the step's own profile (session 31). WT=<checkout> times another checkout.

    taskset -c 0,1 python benchmarks/results/2026-12-06-decode-prefetch/decode_parts.py
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("WT", str(Path(__file__).resolve().parents[3])))

from common.engine.llm import LLM
from common.sampling.params import SamplingParams

BATCH, PROMPT, SHORT, LONG = 48, 384, 8, 128


def main() -> None:
    llm = LLM(dtype=os.environ.get("AB_DTYPE", "bfloat16"))
    step = llm.engine.runner.model.decode_step
    assert step is not None, "no one-call decode step for this model here"
    rng = random.Random(1)

    def run(max_tokens: int) -> tuple[float, tuple[float, float, float]]:
        prompts = [[rng.randrange(1000, 40000) for _ in range(PROMPT)] for _ in range(BATCH)]
        step.times()
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - start, step.times()

    run(SHORT)
    step.profile(True)
    n = LONG - SHORT
    for _ in range(int(os.environ.get("ROUNDS", "3"))):
        (short, ts), (long, tl) = run(SHORT), run(LONG)
        parts = [(b - a) / n * 1000 for a, b in zip(ts, tl, strict=True)]
        print(f"step {(long - short) / n * 1000:.1f} ms: matmul {parts[0]:.1f} attention {parts[1]:.1f} "
              f"rest {parts[2]:.1f}", flush=True)


if __name__ == "__main__":
    main()
