"""Offline A/B of vLLM's engine and Tandem's (one or more versions), alternating, on a list of requests (session 29).

    python benchmarks/results/2026-12-06-served-cpu/offline_requests.py MODEL_DIR SPECS ROUNDS [TANDEMS]

SPECS: comma-separated, each ``BATCHxPROMPTxOUTPUT`` (random-token prompts, EOS ignored) or ``mixed`` (the first
48 rows of benchmarks/data/mixed_lengths.jsonl, as vLLM's client sends the mixed workload: their prompt lengths by
the model's tokenizer, their output lengths). TANDEMS: ``;``-separated Tandem workers, each ``+``-separated
``KEY=VALUE`` settings of its environment; ``WT=DIR`` runs the Tandem checkout in DIR (a git worktree of another
commit), e.g. ``"WT=/tmp/base;WT=/work/main"``. ``NO_VLLM=1`` in the environment leaves vLLM out.

Every worker stays up on cores 0,1 (``AB_DTYPE`` in the environment, fp32 unless set; vLLM with its server's
2,048-token steps); the driver sends each spec to each worker in turn, the order rotating every round, 1 s apart
(vLLM's OpenMP threads spin-wait after its runs). Ratios are paired with the first worker's run of the same round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

_READ = """
import json, os, random, sys, time
DTYPE = os.environ.get("AB_DTYPE", "float32")
"""
VLLM_WORKER = _READ + """
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
def main():
    llm = LLM(model=sys.argv[1], dtype=DTYPE, max_model_len=4096, seed=0, max_num_seqs=128,
              max_num_batched_tokens=2048)
    rng = random.Random(1)
    print("ready", flush=True)
    for line in sys.stdin:
        reqs = json.loads(line)
        p = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(n)]) for n, _ in reqs]
        sp = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in reqs]
        t = time.perf_counter()
        llm.generate(p, sp, use_tqdm=False)
        print(f"{1000 * (time.perf_counter() - t):.1f}", flush=True)
if __name__ == "__main__":
    main()
"""
TANDEM_WORKER = _READ + """
sys.path.insert(0, sys.argv[1])
from common.engine.llm import LLM
from common.sampling.params import SamplingParams
llm = LLM(dtype=DTYPE)
rng = random.Random(1)
llm.generate([[5] * 64], SamplingParams(max_tokens=2, ignore_eos=True))
print("ready", flush=True)
for line in sys.stdin:
    reqs = json.loads(line)
    p = [[rng.randrange(1000, 40000) for _ in range(n)] for n, _ in reqs]
    sp = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in reqs]
    t = time.perf_counter()
    llm.generate(p, sp)
    print(f"{1000 * (time.perf_counter() - t):.1f}", flush=True)
"""


def start(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(["taskset", "-c", "0,1", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0,1",
                                 **env})
    assert proc.stdout is not None
    while (line := proc.stdout.readline().strip()) != "ready":
        if not line and proc.poll() is not None:
            sys.exit(f"{argv[0]} exited before it was ready")
    return proc


def timed(proc: subprocess.Popen[str], reqs: list[list[int]]) -> float:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(reqs) + "\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def requests(spec: str, model: Path) -> list[list[int]]:
    """[prompt length, output length] of each request of ``spec``."""
    if spec != "mixed":
        batch, prompt, output = map(int, spec.split("x"))
        return [[prompt, output]] * batch
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    lines = (REPO / "benchmarks/data/mixed_lengths.jsonl").read_text().splitlines()[:48]
    rows = [json.loads(line) for line in lines]
    return [[len(tokenizer.encode(r["prompt"], add_special_tokens=False).ids), r["output_tokens"]] for r in rows]


def main() -> None:
    model, specs, rounds = Path(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3])
    tandems = sys.argv[4].split(";") if len(sys.argv) > 4 else [""]
    procs: dict[str, subprocess.Popen[str]] = {}
    if os.environ.get("NO_VLLM") != "1":  # first and alone: it compiles at start
        procs["vllm"] = start([str(REPO / ".peers/vllm/bin/python"), "-c", VLLM_WORKER, str(model)], {})
    for variant in tandems:
        env = dict(kv.split("=", 1) for kv in variant.split("+") if kv)
        checkout = env.pop("WT", str(REPO))
        procs["tandem" + (f" ({variant})" if variant else "")] = start(
            [str(REPO / ".venv/bin/python"), "-c", TANDEM_WORKER, checkout], {**env, "PYTHONPATH": checkout})
    names = list(procs)
    for spec in specs:
        reqs = requests(spec, model)
        print(f"== {spec}: {len(reqs)} requests, {sum(r[0] for r in reqs)} prompt tokens, "
              f"{sum(r[1] for r in reqs)} output tokens", flush=True)
        times: dict[str, list[float]] = {n: [] for n in names}
        for proc in procs.values():
            timed(proc, reqs)  # warm-up
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                time.sleep(1.0)
                times[name].append(timed(procs[name], reqs))
            print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.0f} ms" for n in names), flush=True)
        for name in names:
            ratios = sorted(b / a for a, b in zip(times[names[0]], times[name], strict=True))
            print(f"{name}: median {statistics.median(times[name]):.0f} ms; / {names[0]} paired "
                  f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]")
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
