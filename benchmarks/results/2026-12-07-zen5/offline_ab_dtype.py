"""Offline A/B of vLLM's and Tandem's engines (not their servers), alternating in one time window (session 28's
script with the dtype as an argument, session 37).

    python benchmarks/results/2026-12-07-zen5/offline_ab_dtype.py MODEL_DIR 1x384x1,1x1500x1 5 [GAP_S] [DTYPE]

Each shape is BATCHxPROMPTxOUTPUT: that many random-token prompts generated together, EOS ignored. Two worker
processes (vLLM's ``LLM`` from .peers/vllm, Tandem's ``LLM`` from .venv, both on cores 0,1, DTYPE (default
float32), 2,048-token steps for vLLM as its server has) stay up; the driver sends each shape to one then the other
(the order flips every repetition) and prints the medians and the median of the paired ratios. GAP_S (default
1 s) is slept before each run: vLLM's OpenMP threads spin-wait after its runs, and without the gap Tandem's next run
shares the cores with them (a 384-token prefill read 1.3-1.4x vLLM's without it, 1.03x with it).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

VLLM_WORKER = """
import os, random, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
def main():
    llm = LLM(model=sys.argv[1], dtype=sys.argv[2], max_model_len=4096, seed=0, max_num_seqs=128,
              max_num_batched_tokens=2048)
    rng = random.Random(1)
    print("ready", flush=True)
    for line in sys.stdin:
        b, n, out = map(int, line.split())
        p = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(n)]) for _ in range(b)]
        t = time.perf_counter()
        llm.generate(p, SamplingParams(max_tokens=out, ignore_eos=True), use_tqdm=False)
        print(f"{1000 * (time.perf_counter() - t):.1f}", flush=True)
if __name__ == "__main__":
    main()
"""

TANDEM_WORKER = """
import random, sys, time
sys.path.insert(0, sys.argv[1])
from common.engine.llm import LLM
from common.sampling.params import SamplingParams
llm = LLM(dtype=sys.argv[2])
rng = random.Random(1)
llm.generate([[5] * 64], SamplingParams(max_tokens=2, ignore_eos=True))
print("ready", flush=True)
for line in sys.stdin:
    b, n, out = map(int, line.split())
    p = [[rng.randrange(1000, 40000) for _ in range(n)] for _ in range(b)]
    t = time.perf_counter()
    llm.generate(p, SamplingParams(max_tokens=out, ignore_eos=True))
    print(f"{1000 * (time.perf_counter() - t):.1f}", flush=True)
"""


def start(argv: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(["taskset", "-c", "0,1", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0,1"})
    assert proc.stdout is not None
    while (line := proc.stdout.readline().strip()) != "ready":
        if not line and proc.poll() is not None:
            sys.exit(f"{argv[0]} exited before it was ready")
    return proc


def timed(proc: subprocess.Popen[str], shape: tuple[int, ...]) -> float:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(" ".join(map(str, shape)) + "\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def main() -> None:
    model = sys.argv[1]
    shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[2].split(",")]
    reps = int(sys.argv[3])
    gap_s = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0
    # vLLM first and alone (it compiles at start); Tandem measures its kernels at start on idle cores.
    dtype = sys.argv[5] if len(sys.argv) > 5 else "float32"
    procs = {"vllm": start([str(REPO / ".peers/vllm/bin/python"), "-c", VLLM_WORKER, model, dtype])}
    procs["tandem"] = start([str(REPO / ".venv/bin/python"), "-c", TANDEM_WORKER, str(REPO), dtype])
    times: dict[tuple[tuple[int, ...], str], list[float]] = {}
    for shape in shapes:
        for proc in procs.values():
            timed(proc, shape)  # warm-up
        for r in range(reps):
            for name in ("vllm", "tandem") if r % 2 == 0 else ("tandem", "vllm"):
                time.sleep(gap_s)
                times.setdefault((shape, name), []).append(timed(procs[name], shape))
    for shape in shapes:
        v, t = times[(shape, "vllm")], times[(shape, "tandem")]
        ratios = sorted(b / a for a, b in zip(v, t, strict=True))
        print(f"{'x'.join(map(str, shape))}: vLLM {statistics.median(v):.1f} ms, Tandem {statistics.median(t):.1f} ms, "
              f"Tandem / vLLM (paired) {statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]")
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
