"""Sliding-window KV memory: peak KV blocks held with blocks before the window freed early, and without.

    python -m benchmarks.bench_sliding_window [--window 64] [--prompt 128] [--tokens 512] [--seqs 4]
                                              [--block-size 16] [--threads N] [--json F] [--no-window-free]
                                              [--prompts 128,512,2048 [--chunk 128]]

A random-weight Mistral (every layer windowed, ``sliding_window=--window``) is saved by transformers as the
tests do and generates ``--tokens`` greedy tokens for each of ``--seqs`` prompts of ``--prompt`` tokens in one
colocated engine. Each mode reports the peak blocks in use (sampled after every step), the blocks the whole
sequences would need, and tokens/s. ``--no-window-free`` runs only the mode that keeps every block (the
engine's KVCacheManager.window set to None). Issue 36's goal: KV memory per long sequence bounded by the window
(ceil(window / block_size) + 1 blocks while decoding), not by its length. With the window, admission takes only a
prompt's first chunk and each chunk grows the table as the blocks behind the window are freed, so a long prompt
holds about the window and one chunk (Scheduler.peak_blocks), not its length.

``--prompts`` sweeps prompt lengths instead: one sequence each, ``--tokens`` generated (16 by default there),
prefill chunks of ``--chunk`` tokens, and reports the peak blocks held against the prompt length, with and without
early freeing (without it, the whole prompt is allocated at admission, as without a window).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.machine import cpu_summary


def make_model(directory: Path, window: int, max_len: int) -> Path:
    """A small random-weight Mistral with ``sliding_window=window`` saved in the hub's layout."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                                        sliding_window=window, tie_word_embeddings=False)
    transformers.MistralForCausalLM(config).to(torch.float32).save_pretrained(directory)
    return directory


def run(model_dir: Path, prompt: int, tokens: int, seqs: int, block_size: int, free_early: bool,
        chunk: int | None = None) -> dict[str, Any]:
    from common.config.engine_config import CacheConfig, SchedulerConfig
    from common.engine.engine_core import ColocatedEngine
    from common.model.loader import load_model
    from common.sampling.params import SamplingParams

    model = load_model(model_dir, "float32", "cpu")
    need = -(-(prompt + tokens) // block_size)  # the whole sequence's blocks
    scheduler = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=max(256, prompt))
    if chunk is not None:
        scheduler = dataclasses.replace(scheduler, max_prefill_chunk=chunk)
    engine = ColocatedEngine(model, CacheConfig(block_size=block_size, num_blocks=need * seqs + 4), scheduler)
    if not free_early:
        engine.kv.window = None
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(f"r{i}", torch.randint(3, 512, (prompt,), generator=gen).tolist(), params)
    peak = peak_decode = generated = 0
    start = time.perf_counter()
    while engine.scheduler.has_work():
        for out in engine.step():
            generated += len(out.new_token_ids)
        peak = max(peak, engine.kv.num_used_blocks)
        if all(r.num_computed_tokens >= prompt for r in engine.scheduler.running) and not engine.scheduler.waiting:
            peak_decode = max(peak_decode, engine.kv.num_used_blocks)  # every prompt in: the decode phase
        engine.kv.check_integrity()
    seconds = time.perf_counter() - start
    assert engine.kv.num_used_blocks == 0, "KV blocks leaked"
    held_peak = engine.kv.pool.peak_used_blocks  # within a step too: a chunk's blocks before those behind it go
    engine.close()
    return {"free_early": free_early, "peak_blocks": peak, "held_peak_blocks": held_peak,
            "peak_decode_blocks": peak_decode,
            "whole_sequence_blocks": need * seqs, "generated": generated, "seconds": round(seconds, 3),
            "tokens_per_s": round(generated / seconds, 1)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-window-free", action="store_true", help="only the mode that keeps every block")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--prompts", type=str, default=None, help="comma-separated prompt lengths to sweep")
    parser.add_argument("--chunk", type=int, default=128, help="prefill chunk of the --prompts sweep")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompts is not None:
        return sweep(args, [int(p) for p in args.prompts.split(",")])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp), args.window, args.prompt + args.tokens + 8)
        modes = [False] if args.no_window_free else [True, False]
        results = [run(model_dir, args.prompt, args.tokens, args.seqs, args.block_size, m) for m in modes]
    report = {"machine": cpu_summary(), "window": args.window, "block_size": args.block_size,
              "bound_per_seq": -(-args.window // args.block_size) + 1, "runs": results}
    for r in results:
        print(f"free_early={r['free_early']!s:5}  peak blocks {r['peak_blocks']:5}  "
              f"while decoding {r['peak_decode_blocks']:5}  (whole sequences: {r['whole_sequence_blocks']})  "
              f"{r['tokens_per_s']} tokens/s")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return report


def sweep(args: argparse.Namespace, prompts: list[int]) -> dict[str, Any]:
    """Peak blocks held by one sequence against its prompt's length, with and without early freeing."""
    tokens = 16 if args.tokens == 512 else args.tokens  # the default is the decode run's
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp), args.window, max(prompts) + tokens + 8)
        for prompt in prompts:
            freed, kept = (run(model_dir, prompt, tokens, 1, args.block_size, m, args.chunk) for m in (True, False))
            rows.append({"prompt": prompt, "peak_free_early": freed["held_peak_blocks"],
                         "peak_kept": kept["held_peak_blocks"],
                         "whole_sequence_blocks": kept["whole_sequence_blocks"]})
    report = {"machine": cpu_summary(), "window": args.window, "block_size": args.block_size, "chunk": args.chunk,
              "tokens": tokens, "sweep": rows}
    print(f"window {args.window}, blocks of {args.block_size}, chunks of {args.chunk}, {tokens} tokens generated")
    print("| prompt | peak blocks, freed early | peak blocks, kept | whole sequence |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['prompt']} | {r['peak_free_early']} | {r['peak_kept']} | {r['whole_sequence_blocks']} |")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
