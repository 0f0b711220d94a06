"""One long prompt's prefill step in the engine, beside running decodes, offline (session 32).

    python benchmarks/results/2026-12-06-fused-rounding/long_prompt_step.py

Eight 100-token requests start decoding (60 tokens each), then a ~1,400-token prompt arrives; prints the step times
until its first token (one step each: the backlog budget takes it whole), for a new prompt length each round and for
a length seen before. bf16, the process's default threads (pin it: ``taskset -c 0,1``).
"""

from __future__ import annotations

import random
import time

from common.engine.llm import LLM
from common.sampling.params import SamplingParams


def main() -> None:
    llm = LLM(dtype="bfloat16")
    eng = llm.engine
    rng = random.Random(1)
    llm.generate([[5] * 64], SamplingParams(max_tokens=2, ignore_eos=True))
    ids = iter(range(10**9))

    def run(doc_len: int, n_chats: int) -> list[int]:
        for _ in range(n_chats):
            eng.add_request(f"c{next(ids)}", [rng.randrange(1000, 40000) for _ in range(100)],
                            SamplingParams(max_tokens=60, ignore_eos=True))
        for _ in range(5):
            eng.step()  # the chats are decoding now
        doc = f"d{next(ids)}"
        eng.add_request(doc, [rng.randrange(1000, 40000) for _ in range(doc_len)],
                        SamplingParams(max_tokens=1, ignore_eos=True))
        times = []
        while True:
            t = time.perf_counter()
            outs = eng.step()
            times.append(round(1000 * (time.perf_counter() - t)))
            if any(o.request_id == doc for o in outs):
                break
        while eng.has_unfinished():
            eng.step()
        return times

    for r in range(4):
        print(f"new lengths: {run(1400 + 37 * r, 8)} {run(1300 + 41 * r, 8)} ms; 1,400 again: {run(1400, 8)} ms",
              flush=True)


if __name__ == "__main__":
    main()
