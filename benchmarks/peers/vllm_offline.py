"""vLLM-CPU offline throughput on a request file. Run by the vLLM peer venv's Python, not Tandem's.

    <peer python> vllm_offline.py --requests FILE --model HF_DIR --threads N --dtype bfloat16 --out FILE

Imports only the standard library and vLLM (the peer venv has no Tandem). Every prompt goes to one
``LLM.generate`` call, so vLLM's scheduler batches them as it likes; greedy, exactly ``output_len`` tokens
each with EOS ignored, and no detokenization (Tandem's offline benchmark returns token ids too).
Throughput is output tokens over the wall time of that call, prefill included; engine start-up
(weight loading, compilation, KV cache allocation) is reported apart as ``init_seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

KV_CACHE_GIB = 2  # ample: 64 sequences x 256 tokens of SmolLM2 in bf16 is 0.4 GB


def read_requests(path: Path) -> tuple[list[list[int]], int]:
    """(prompts as token ids, output_len) from the file Tandem's ``write_requests`` wrote."""
    raw = json.loads(Path(path).read_text())
    return [[int(t) for t in prompt] for prompt in raw["prompts"]], int(raw["output_len"])


def cpu_bind_list(threads: int) -> str:
    """The first ``threads`` CPUs this process may use, as VLLM_CPU_OMP_THREADS_BIND takes them ("0,1")."""
    return ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0))[:threads])


def configure_environment(threads: int) -> None:
    # Before vLLM is imported. "auto" binding reserves a core for the engine's scheduler process, which
    # on a 2-core machine leaves 1 thread; an explicit list gives vLLM the same N cores as everyone else.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind_list(threads))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts, output_len = read_requests(args.requests)
    configure_environment(args.threads)
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=str(args.model), dtype=args.dtype, max_model_len=max(map(len, prompts)) + output_len,
              max_num_seqs=max(len(prompts), 2), seed=0)
    init_seconds = time.perf_counter() - start

    def greedy(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    def as_inputs(batch: list[list[int]]) -> list[Any]:
        return [{"prompt_token_ids": p} for p in batch]

    # Warm-up on other prompts (the same ones could hit vLLM's prefix cache in the measured run).
    warm = [p[::-1] for p in prompts[:2]]
    llm.generate(as_inputs(warm), greedy(4), use_tqdm=False)

    load_at_start = os.getloadavg()[0]  # other work on the machine shows here, not in the rate
    start = time.perf_counter()
    outputs = llm.generate(as_inputs(prompts), greedy(output_len), use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    expected = len(prompts) * output_len
    if tokens != expected:
        raise RuntimeError(f"vLLM produced {tokens} output tokens, expected {expected}")
    return {
        "system": f"vLLM-CPU {vllm.__version__}",
        "dtype": args.dtype,
        "setting": f"LLM.generate, all {len(prompts)} prompts at once (max_num_seqs {max(len(prompts), 2)})",
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "init_seconds": init_seconds,
        "prompts_measured": len(prompts),
        "prompts_total": len(prompts),
        "note": (f"VLLM_CPU_OMP_THREADS_BIND={os.environ['VLLM_CPU_OMP_THREADS_BIND']}, KV cache "
                 f"{os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB; init (load + compile) not in the wall time; "
                 f"load average at start {load_at_start:.1f}"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=Path, required=True, help='JSON {"prompts": [[ids]], "output_len": n}')
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face model directory")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--budget-s", type=float, default=None, help="ignored: vLLM runs every prompt in one batch")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['system']} {result['dtype']}: {result['tokens_per_s']:.1f} tok/s "
          f"({result['output_tokens']} tokens in {result['seconds']:.1f} s; init {result['init_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
