"""The ``tandem`` command line: ``tandem model prepare``, ``tandem generate``.

Flags and ``TANDEM_*`` environment variables fill the same settings fields (common.config.settings);
a flag that is given wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from common.config.settings import ModelSettings, load_settings


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (flags override TANDEM_* environment variables)")
    g.add_argument("--model", help="local Hugging Face directory or the bundled model's name "
                   "[TANDEM_MODEL, default SmolLM2-135M-Instruct]")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="[TANDEM_DTYPE, auto]")
    g.add_argument("--device", help="torch device [TANDEM_DEVICE, cpu]")
    g.add_argument("--attention-backend", dest="attention_backend", help="torch | triton | flash_attn "
                   "[TANDEM_ATTENTION_BACKEND, torch]")
    g.add_argument("--home", type=Path, help="Tandem's cache directory [TANDEM_HOME, ~/.cache/tandem]")
    g.add_argument("--threads", dest="num_threads", type=int, help="torch threads [TANDEM_NUM_THREADS]")


def _model_settings(args: argparse.Namespace) -> ModelSettings:
    keys = ("model", "dtype", "device", "attention_backend", "home", "num_threads")
    return load_settings(ModelSettings, {k: getattr(args, k, None) for k in keys})


def cmd_model_prepare(args: argparse.Namespace) -> int:
    from common.model.model_store import prepare_default_model

    settings = _model_settings(args)
    path = prepare_default_model(settings.home, progress=True)
    print(path)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    settings = _model_settings(args)
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    llm = LLM(settings.model, dtype=settings.dtype, device=settings.device,
              attention_backend=settings.attention_backend)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    prompt_ids = llm.encode(args.prompt, chat=args.chat)
    if not args.chat:
        sys.stdout.write(args.prompt)
    start = time.perf_counter()
    first: float | None = None
    count = 0
    for delta in llm.stream([prompt_ids], params):
        first = first or time.perf_counter()
        count += len(delta.token_ids)
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    decode_rate = (count - 1) / (end - first) if first and count > 1 else 0.0
    print(f"[{count} tokens, prompt {len(prompt_ids)} tokens, time to first token "
          f"{((first or end) - start) * 1000:.0f} ms, decode {decode_rate:.1f} tokens/s, "
          f"dtype {next(llm.model.parameters()).dtype}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    prepare = model_sub.add_parser("prepare", help="convert the bundled SmolLM2 GGUF into Tandem's cache")
    _add_model_flags(prepare)
    prepare.set_defaults(func=cmd_model_prepare)

    gen = sub.add_parser("generate", help="stream a generation offline (no server)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    _add_model_flags(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: Any = args.func(args)
    except ValueError as exc:  # caller mistakes: say what and exit 2, no traceback
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    return int(result)


if __name__ == "__main__":
    sys.exit(main())
