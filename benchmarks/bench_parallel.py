"""Tensor and pipeline parallel layouts on this machine: tokens/s and the per-step collective cost.

    python -m benchmarks.bench_parallel [--model M] [--dtype D] [--layouts 1x1 3x1 1x2 ...] [--quick]
                                        [--collectives] [--json FILE]

Each layout TxP (T tensor-parallel ranks, P pipeline stages; ``3x1-gloo``: gloo instead of the
shared-memory all-reduce) runs the offline engine (``LLM(tensor_parallel_size=T, pipeline_parallel_size=P)``)
on the same prompts: batch-1 decode (one prompt, greedy, 64 new tokens) and a batch of 8 (8 prompts x 64
tokens), after a warm-up generation. Reported per layout: tokens/s of both, the step time, the slowest
rank's time inside collectives per step (all-reduces and pipeline hand-offs, measured in the ranks) and its
share of the step, weight bytes per rank, and whether the greedy tokens equal 1x1's (fp32: they must).
``--collectives`` adds the per-call all-reduce latency table (benchmarks/bench_collectives.py) at T = 2, 3.

On a machine with fewer cores than ranks the ranks share cores (one thread each): a layout then cannot be
faster than 1x1, and the figures show what the parallel machinery costs, not what it gains on a host with
a core per rank (or a GPU per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_LAYOUTS = ("1x1", "2x1", "3x1", "3x1-gloo", "1x2", "3x2")
NEW_TOKENS = 64


def parse_layout(text: str) -> tuple[int, int, str]:
    """``TxP`` or ``TxP-gloo`` -> (T, P, collective)."""
    body, _, collective = text.partition("-")
    try:
        t, p = (int(x) for x in body.split("x"))
    except ValueError:
        raise ValueError(f"layout {text!r}: expected TxP (e.g. 3x1) or TxP-gloo") from None
    if collective not in ("", "gloo", "shm"):
        raise ValueError(f"layout {text!r}: the collective is shm or gloo")
    return t, p, collective or "shm"


def _prompts(llm: Any) -> list[list[int]]:
    texts = ["Explain how a bicycle works.", "Write a short poem about the sea.", "What is the capital of Peru?",
             "List three uses of copper.", "Describe a sunrise in the mountains.", "How do vaccines work?",
             "Give me a recipe for pancakes.", "Why is the sky blue?"]
    return [llm.encode(t, chat=True) for t in texts]


def run_layout(model_dir: Path, dtype: str, layout: str, quick: bool) -> dict[str, Any]:
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    t, p, collective = parse_layout(layout)
    params = SamplingParams(temperature=0.0, max_tokens=16 if quick else NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    with LLM(model_dir, dtype=dtype, tensor_parallel_size=t, pipeline_parallel_size=p,
             parallel_collective=collective) as llm:
        started_s = time.perf_counter() - start
        prompts = _prompts(llm)
        llm.generate(prompts[:1], params)  # warm-up (kernels, first-touch pages)
        runner = llm.engine.runner
        out: dict[str, Any] = {"layout": layout, "tensor_parallel_size": t, "pipeline_parallel_size": p,
                               "collective": collective if t > 1 else "-", "start_s": started_s,
                               "weight_bytes_per_rank": getattr(runner, "weight_bytes", llm.model.weight_bytes)
                               / (t * p)}
        for name, batch in (("batch1", prompts[:1]), ("batch8", prompts)):
            before = _counters(runner)
            t0 = time.perf_counter()
            done = llm.generate(batch, params)
            elapsed = time.perf_counter() - t0
            after = _counters(runner)
            steps = after["steps"] - before["steps"]
            tokens = sum(len(c.token_ids) for c in done)
            out[name] = {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
                         "steps": steps, "step_ms": 1000 * elapsed / steps if steps else None,
                         "collective_ms_per_step": (1000 * (after["collective"] - before["collective"]) / steps
                                                    if steps and t * p > 1 else 0.0),
                         "token_ids": [c.token_ids for c in done]}
            coll = out[name]["collective_ms_per_step"]
            out[name]["collective_share"] = coll / out[name]["step_ms"] if out[name]["step_ms"] else 0.0
    return out


def _counters(runner: Any) -> dict[str, float]:
    return {"steps": runner.num_steps, "collective": getattr(runner, "collective_seconds", 0.0)}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Parallel layouts ({result['model']}, {result['dtype']}, {result['cores']} cores; "
             f"{NEW_TOKENS if not result['quick'] else 16} new tokens per prompt, greedy)", ""]
    lines += [f"- {line}" for line in result["machine"]]
    lines += [f"- CPU flags: {' '.join(result['cpu_flags']) or 'unknown'}", "",
              "| layout (TxP) | all-reduce | batch-1 tok/s | step ms | collectives ms/step (share) | "
              "batch-8 tok/s | step ms | collectives ms/step (share) | MB weights/rank | greedy = 1x1 |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["layouts"]:
        b1, b8 = r["batch1"], r["batch8"]
        lines.append(f"| {r['layout']} | {r['collective']} | {b1['tokens_per_s']:.1f} | {b1['step_ms']:.1f} | "
                     f"{b1['collective_ms_per_step']:.1f} ({b1['collective_share']:.0%}) | {b8['tokens_per_s']:.1f} | "
                     f"{b8['step_ms']:.1f} | {b8['collective_ms_per_step']:.1f} ({b8['collective_share']:.0%}) | "
                     f"{r['weight_bytes_per_rank'] / 1e6:.0f} | {'yes' if r['equal_to_1x1'] else '**no**'} |")
    for layout, why in result.get("skipped", {}).items():
        lines.append(f"\n{layout}: skipped, {why}")
    if result.get("collectives"):
        from benchmarks.bench_collectives import markdown as collectives_markdown

        lines += ["", collectives_markdown(result["collectives"])]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.bench_kv_transfer import cpu_flags
    from benchmarks.machine import machine_description
    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import resolve_model

    settings = load_settings(ModelSettings, {"model": args.model})
    model_dir = resolve_model(settings.model, settings.home, progress=True)
    from common.config.model_config import ModelConfig
    from common.parallel.layout import ParallelLayout

    config = ModelConfig.from_pretrained(model_dir)
    layouts = ["1x1"] + [x for x in args.layouts if x != "1x1"]
    skipped: dict[str, str] = {}
    for layout in layouts:
        t, p, _ = parse_layout(layout)  # every name checked before the first layout runs
        try:
            ParallelLayout(t, p).validate(config)
        except ValueError as exc:  # a layout this model cannot take (a tiny test model's 4 heads and T=3)
            skipped[layout] = str(exc)
    results = []
    for layout in layouts:
        if layout in skipped:
            print(f"[parallel] {layout}: skipped ({skipped[layout]})", file=sys.stderr, flush=True)
            continue
        print(f"[parallel] {layout} ...", file=sys.stderr, flush=True)
        results.append(run_layout(model_dir, args.dtype, layout, args.quick))
    base = results[0]
    for r in results:
        r["equal_to_1x1"] = all(r[b]["token_ids"] == base[b]["token_ids"] for b in ("batch1", "batch8"))
    result: dict[str, Any] = {"benchmark": "parallel", "model": model_dir.name, "dtype": args.dtype,
                              "quick": args.quick, "cores": len(os.sched_getaffinity(0)), "cpu_flags": cpu_flags(),
                              "machine": machine_description(1), "layouts": results, "skipped": skipped}
    if args.collectives:
        from benchmarks.bench_collectives import run as run_collectives

        result["collectives"] = run_collectives(argparse.Namespace(world_size=[2, 3], iters=50 if args.quick else 200,
                                                                   max_bytes=4 << 20, out=None,
                                                                   print_table=False))
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="local Hugging Face directory or the bundled model's name [TANDEM_MODEL]")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="float32: greedy tokens must equal 1x1's exactly [float32]")
    p.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS),
                   help=f"TxP[-gloo] [{' '.join(DEFAULT_LAYOUTS)}]")
    p.add_argument("--quick", action="store_true", help="16 new tokens instead of 64")
    p.add_argument("--collectives", action="store_true", help="also the per-call all-reduce latency (gloo vs shm)")
    p.add_argument("--json", help="write the result here")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    try:
        run(parser.parse_args(argv))
    except ValueError as exc:
        print(f"bench parallel: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
