"""llama.cpp batch-1 decode rate on a request file. Run by the llama.cpp peer venv's Python, not Tandem's.

    <peer python> llamacpp_decode.py --requests FILE --model GGUF --threads N --out FILE

Imports only the standard library and llama-cpp-python. For each prompt (token ids): reset the cache,
evaluate the prompt, greedy-decode exactly ``output_len`` tokens; the decode rate counts the tokens after
the first over the time after the first (the prompt's evaluation is not in it), as Tandem's row does.
The best of the prompts' rates is reported (all prompts have the same shape; the best is the least
disturbed by other work on the machine), with the median beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def decode_rate(llm: Any, prompt: list[int], n: int) -> float:
    llm.reset()
    count, first = 0, 0.0
    for _token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        count += 1
        if count == 1:
            first = time.perf_counter()
        if count == n:
            break
    return (count - 1) / (time.perf_counter() - first)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import llama_cpp
    from llama_cpp import Llama

    raw = json.loads(args.requests.read_text())
    prompts, n = [[int(t) for t in p] for p in raw["prompts"]], int(raw["output_len"])
    llm = Llama(model_path=str(args.model), n_ctx=max(map(len, prompts)) + n + 1, n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=512, logits_all=False, verbose=False, seed=0)
    decode_rate(llm, prompts[0], 8)  # warm-up
    rates = [decode_rate(llm, prompt, n) for prompt in prompts]
    result = {"system": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})", "threads": args.threads,
              "decode_tokens_per_s": max(rates), "median_tokens_per_s": statistics.median(rates),
              "output_len": n, "prompts": len(prompts)}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['system']}: batch-1 decode {max(rates):.1f} tok/s (median {statistics.median(rates):.1f})")


if __name__ == "__main__":
    main()
