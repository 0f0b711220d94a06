"""llama.cpp offline throughput on a request file. Run by the llama.cpp peer venv's Python, not Tandem's.

    <peer python> llamacpp_offline.py --requests FILE --model GGUF --threads N [--budget-s S] --out FILE

Imports only the standard library and llama-cpp-python (the peer venv has no Tandem). Its Python API
serves one sequence at a time, so prompts run one after another: the KV cache is reset, the prompt's
token ids are evaluated, then ``Llama.generate`` yields greedy tokens until exactly ``output_len`` have
come out. ``generate`` never stops at EOS itself (``create_completion`` does), so EOS is ignored as in
the other systems. Prompts stop once ``--budget-s`` is spent (at least one runs); every prompt has the
same shape, so the rate of those measured stands for the rest, and the result says how many ran.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

N_BATCH = 512  # prompt tokens per llama_decode call: a whole 128-token prompt in one


def read_requests(path: Path) -> tuple[list[list[int]], int]:
    """(prompts as token ids, output_len) from the file Tandem's ``write_requests`` wrote."""
    raw = json.loads(Path(path).read_text())
    return [[int(t) for t in prompt] for prompt in raw["prompts"]], int(raw["output_len"])


def generate_exactly(llm: Any, prompt: list[int], n: int) -> int:
    """Greedy-decode ``n`` tokens after ``prompt`` from an empty cache; returns how many came out."""
    # reset() empties the cache, so generate() cannot reuse a prefix left by the previous prompt.
    llm.reset()
    count = 0
    for _token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        count += 1
        if count == n:
            break  # closes the generator: the nth token is sampled but never evaluated, as in vLLM and Tandem
    return count


def run(args: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp
    from llama_cpp import Llama

    prompts, output_len = read_requests(args.requests)
    start = time.perf_counter()
    llm = Llama(model_path=str(args.model), n_ctx=max(map(len, prompts)) + output_len + 1, n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=N_BATCH, logits_all=False, verbose=False, seed=0)
    init_seconds = time.perf_counter() - start
    generate_exactly(llm, prompts[0][::-1], 4)  # warm-up

    load_at_start = os.getloadavg()[0]  # other work on the machine shows here, not in the rate
    tokens = measured = 0
    start = time.perf_counter()
    for prompt in prompts:
        tokens += generate_exactly(llm, prompt, output_len)
        measured += 1
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            break
    seconds = time.perf_counter() - start
    if tokens != measured * output_len:
        raise RuntimeError(f"llama.cpp produced {tokens} output tokens over {measured} prompts, "
                           f"expected {measured * output_len}")
    partial = "" if measured == len(prompts) else (f"; measured {measured} of {len(prompts)} prompts "
                                                   "(--budget-s), rate of those")
    return {
        "system": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
        "dtype": "Q4_1",
        "setting": "one prompt at a time (the Python API does not batch sequences)",
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "init_seconds": init_seconds,
        "prompts_measured": measured,
        "prompts_total": len(prompts),
        "note": (f"weights Q4_1 as bundled ({Path(args.model).name}); Tandem and vLLM run them dequantized "
                 f"in bf16; {args.threads} threads; load average at start {load_at_start:.1f}{partial}"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=Path, required=True, help='JSON {"prompts": [[ids]], "output_len": n}')
    parser.add_argument("--model", type=Path, required=True, help="a GGUF file")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--dtype", default=None, help="ignored: the GGUF file fixes the weights' type")
    parser.add_argument("--budget-s", type=float, default=None, help="stop after the prompt that passes this")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['system']}: {result['tokens_per_s']:.1f} tok/s ({result['output_tokens']} tokens from "
          f"{result['prompts_measured']} of {result['prompts_total']} prompts in {result['seconds']:.1f} s)")


if __name__ == "__main__":
    main()
