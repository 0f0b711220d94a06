"""One peer system on the offline workload, for the suite: writes the prompts, runs the peer in its own venv.

    python -m benchmarks.peer_section --peer vllm|llamacpp --python PEER_PYTHON --model HF_DIR [--gguf FILE]
                                      [--dtype bfloat16] [--threads N] [--quick] --json OUT

The prompts are the offline section's (``benchmarks.bench_offline.Workload``, same seed and sizes), so the
peer's row sits beside Tandem's and Hugging Face's in one table. The peer script runs under the peer's
own interpreter (its venv holds its pinned torch and libraries, not Tandem); this process only hands it a
JSON file of token ids and reads a JSON result back: nothing is pickled across.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_offline import Workload
from benchmarks.peers import run_peer, write_requests
from benchmarks.suite import OFFLINE_FULL, OFFLINE_QUICK
from common.config.model_config import ModelConfig

# llama-cpp-python decodes one sequence at a time: it gets this long, then its rate stands for the rest.
BUDGET_S = {False: 60.0, True: 10.0}
TIMEOUT_S = 900.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--peer", required=True, choices=["vllm", "llamacpp"])
    parser.add_argument("--python", required=True, help="the peer venv's interpreter")
    parser.add_argument("--model", required=True, help="Hugging Face directory (vLLM; the vocabulary size)")
    parser.add_argument("--gguf", default="", help="GGUF file (llama.cpp)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", dest="json_path", required=True)
    args = parser.parse_args(argv)

    num_prompts, prompt_len, output_len = OFFLINE_QUICK if args.quick else OFFLINE_FULL
    workload = Workload(num_prompts, prompt_len, output_len)
    prompts = workload.prompts(ModelConfig.from_pretrained(Path(args.model)).vocab_size)
    model_path = args.gguf if args.peer == "llamacpp" else args.model
    if not model_path:
        parser.error(f"--{'gguf' if args.peer == 'llamacpp' else 'model'} is required for {args.peer}")
    with tempfile.TemporaryDirectory(prefix="tandem-peer-") as tmp:
        request_file = Path(tmp) / "requests.json"
        write_requests(request_file, prompts, output_len)
        print(f"{args.peer}: {num_prompts} prompts x {prompt_len} -> {output_len}, {args.threads} threads",
              file=sys.stderr, flush=True)
        result = run_peer(args.peer, Path(args.python), request_file, Path(tmp) / "result.json", Path(model_path),
                          args.threads, args.dtype, BUDGET_S[args.quick], TIMEOUT_S)
    result["workload"] = {"num_prompts": num_prompts, "prompt_len": prompt_len, "output_len": output_len}
    Path(args.json_path).write_text(json.dumps(result, indent=2))
    print(f"| {result['system']} | {result['dtype']} | {result['setting']} | {result['tokens_per_s']:.1f} tok/s "
          f"| init {result['init_seconds']:.0f} s | {result.get('note', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
