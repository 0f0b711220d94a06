"""Speculative decoding at batch 1: decode tokens/s with and without speculation, same run, per proposer.

    python -m benchmarks.bench_speculative [--dtype bfloat16] [--threads 1] [--max-tokens 128] [--repeats 3]
                                           [--configs "ngram:k=4:n=1-4,layers:k=4:L=8"] [--quick] [--no-profile]

Ten chat prompts (``benchmarks.spec_prompts``): six input-grounded ones (rewrite or summarise a given
passage, correct an email, edit given code), whose answers copy much of the prompt, and four open-ended
ones. Each is generated greedily (EOS on, at most ``--max-tokens`` tokens), one request at a time, by
a plain engine and by one engine per speculative configuration. Runs are interleaved (every configuration
of one prompt back to back, then the next prompt, then the next repeat) so machine noise hits all
configurations alike, and each prompt's time is the median over repeats.

Decode tok/s excludes the prefill: (tokens - 1) / (time of the last token - time of the first token).
A category's rate is its tokens over its summed decode times; speedup is the baseline's decode time over
the configuration's, same prompts. Tokens/step (decode tokens per engine step) does not depend on timing:
the speedup is about tokens/step over the relative cost of a verifying step.

"identical" counts prompts whose speculative output equals the baseline's token for token. Greedy
verification is exact, but the forward that verifies k drafts computes k + 1 query rows (the extend
attention path) where plain decoding computes one (the decode path), and the two round differently; in
bf16, where the target's two best logits tie to bf16 resolution, the runs can pick different tokens and
then continue differently. Every such case is listed with the target's logits at the first differing
token. In float32 (``--dtype float32``) the outputs are identical.

Acceptance rate: accepted drafts / proposed drafts. Accepted/verify: mean drafts accepted per verifying
step (that step also emits one token of its own); drafts/verify: mean drafts per verifying step. Draft
and verify ms: the model runner's proposing time and forward + sampling / verification time, per decode
step. The profile section splits a decode step further, over one more (interleaved) pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.machine import machine_description
from benchmarks.spec_profile import print_profile, profile
from benchmarks.spec_prompts import PROMPTS, BenchPrompt
from benchmarks.spec_run import BenchConfig, Run, generate, make_engine
from common.config.engine_config import SpeculativeMethod
from common.model.loader import load_model
from common.sampling.params import SamplingParams
from common.tokenizer import Tokenizer

if TYPE_CHECKING:
    from common.model.llama import LlamaForCausalLM

DEFAULT_CONFIGS = ("ngram:k=4:n=1-4,ngram:k=8:n=1-4,ngram:k=16:n=1-4,ngram:k=16:n=1-8,ngram:k=16:n=1-4:fixed,"
                   "layers:k=4:L=8,layers:k=4:L=15,layers:k=2:L=15:fixed,draft:k=4:q=int4,draft:k=8:q=int4")


@dataclass
class Cell:
    """One configuration over one category of prompts: per prompt, the runs of every repeat."""

    runs: dict[str, list[Run]] = field(default_factory=dict)

    def median_seconds(self, name: str) -> float:
        return statistics.median(r.decode_seconds for r in self.runs[name])

    def total(self, attr: str) -> float:
        # Counters are the same in every repeat (greedy): take the first repeat's.
        return sum(getattr(runs[0], attr) for runs in self.runs.values())

    def decode_tokens(self) -> int:
        return sum(len(runs[0].tokens) - 1 for runs in self.runs.values())

    def decode_seconds(self) -> float:
        return sum(self.median_seconds(name) for name in self.runs)


def run_all(model: LlamaForCausalLM, tokenizer: Tokenizer, configs: list[BenchConfig], prompts: list[BenchPrompt],
            max_tokens: int, repeats: int, progress: Callable[[str], None],
            model_dir: Path | None = None) -> tuple[dict[tuple[str, bool], Cell], dict[str, list[int]]]:
    """Cells keyed by (config label, grounded); and the baseline's tokens per prompt."""
    encoded = {p.name: tokenizer.encode_chat([{"role": "user", "content": p.content}]) for p in prompts}
    max_len = max(len(ids) for ids in encoded.values()) + max_tokens + 32
    engines = {c.label: make_engine(model, c, max_len, model_dir) for c in configs}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    eos = tokenizer.eos_token_ids
    for engine in engines.values():  # warm-up: allocator, rotary tables, code paths
        generate(engine, encoded[prompts[0].name], SamplingParams(temperature=0.0, max_tokens=8), eos)
    cells: dict[tuple[str, bool], Cell] = {}
    for repeat in range(repeats):
        for prompt in prompts:
            for config in configs:
                run = generate(engines[config.label], encoded[prompt.name], params, eos)
                cell = cells.setdefault((config.label, prompt.grounded), Cell())
                cell.runs.setdefault(prompt.name, []).append(run)
            progress(f"repeat {repeat + 1}/{repeats}: {prompt.name} ({len(encoded[prompt.name])} prompt tokens)")
    baseline = configs[0].label
    reference = {p.name: cells[(baseline, p.grounded)].runs[p.name][0].tokens for p in prompts}
    return cells, reference


def table_rows(configs: list[BenchConfig], cells: dict[tuple[str, bool], Cell], reference: dict[str, list[int]],
               baseline: str) -> list[dict[str, Any]]:
    """One row per (prompt category, configuration): the figures of the table, also written as JSON."""
    rows = []
    for grounded in sorted({g for _, g in cells}, reverse=True):
        base = cells[(baseline, grounded)]
        for config in configs:
            cell = cells[(config.label, grounded)]
            seconds, tokens = cell.decode_seconds(), cell.decode_tokens()
            steps = max(cell.total("decode_steps"), 1)
            verifies = cell.total("num_verify_steps")
            drafts, accepted = cell.total("num_drafts"), cell.total("num_accepted")
            rows.append({
                "category": "input-grounded" if grounded else "open-ended", "config": config.label,
                "speculative": config.speculative is not None,
                "decode_tokens_per_s": tokens / seconds, "speedup": base.decode_seconds() / seconds,
                "tokens_per_step": tokens / steps, "acceptance": accepted / drafts if drafts else None,
                "accepted_per_verify": accepted / verifies if verifies else None,
                "drafts_per_verify": drafts / verifies if verifies else None,
                "draft_ms_per_step": 1e3 * cell.total("draft_seconds") / steps if config.speculative else None,
                "verify_ms_per_step": 1e3 * cell.total("forward_seconds") / steps,
                "identical": sum(runs[0].tokens == reference[name] for name, runs in cell.runs.items()),
                "prompts": len(cell.runs),
            })
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| prompts | configuration | decode tok/s | speedup | tokens/step | acceptance | accepted/verify "
          "| drafts/verify | draft ms/step | verify ms/step | identical |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rate = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        per_verify = ("- | -" if r["accepted_per_verify"] is None
                      else f"{r['accepted_per_verify']:.2f} | {r['drafts_per_verify']:.2f}")
        draft_ms = "-" if r["draft_ms_per_step"] is None else f"{r['draft_ms_per_step']:.2f}"
        print(f"| {r['category']} | {r['config']} | {r['decode_tokens_per_s']:.1f} | {r['speedup']:.2f}x "
              f"| {r['tokens_per_step']:.2f} | {rate} | {per_verify} | {draft_ms} | {r['verify_ms_per_step']:.2f} "
              f"| {r['identical']}/{r['prompts']} |", flush=True)


def print_per_prompt(configs: list[BenchConfig], cells: dict[tuple[str, bool], Cell], prompts: list[BenchPrompt],
                     baseline: str) -> None:
    print("\nPer prompt: decode tok/s (speedup over the baseline)\n")
    print("| prompt | tokens | " + " | ".join(c.label for c in configs) + " |")
    print("|---|---:|" + "---:|" * len(configs))
    for prompt in prompts:
        base = cells[(baseline, prompt.grounded)]
        tokens = len(base.runs[prompt.name][0].tokens) - 1
        row = []
        for config in configs:
            cell = cells[(config.label, prompt.grounded)]
            seconds = cell.median_seconds(prompt.name)
            rate = (len(cell.runs[prompt.name][0].tokens) - 1) / seconds
            row.append(f"{rate:.1f}" if config.label == baseline
                       else f"{rate:.1f} ({base.median_seconds(prompt.name) / seconds:.2f}x)")
        print(f"| {prompt.name} | {tokens} | " + " | ".join(row) + " |")


def print_divergences(model: LlamaForCausalLM, tokenizer: Tokenizer, configs: list[BenchConfig],
                      cells: dict[tuple[str, bool], Cell], reference: dict[str, list[int]],
                      prompts: list[BenchPrompt]) -> None:
    """For outputs that differ from the baseline: where, and how close the target's two candidates were there.

    The gap is measured by a plain (cache-less) forward over the prompt and the baseline's tokens so far;
    a gap within the dtype's rounding means both kernels' answers are the target's greedy choice.
    """
    from common.attention.metadata import AttentionMetadata

    rows = []
    for config in configs[1:]:
        for prompt in prompts:
            got = cells[(config.label, prompt.grounded)].runs[prompt.name][0].tokens
            want = reference[prompt.name]
            if got == want:
                continue
            i = next((j for j in range(min(len(got), len(want))) if got[j] != want[j]), min(len(got), len(want)))
            if i == len(got) or i == len(want):
                rows.append((config.label, prompt.name, i, "one output is a prefix of the other"))
                continue
            ids = tokenizer.encode_chat([{"role": "user", "content": prompt.content}]) + want[:i]
            with torch.inference_mode():
                hidden = model(torch.tensor(ids), torch.arange(len(ids)), AttentionMetadata.build([len(ids)], [0]))
                logits = model.compute_logits(hidden[-1:])[0]
            gap = float(logits[want[i]] - logits[got[i]])
            rows.append((config.label, prompt.name, i, f"{logits[want[i]]:.4f} vs {logits[got[i]]:.4f} "
                                                       f"(gap {gap:+.4f})"))
    if not rows:
        return
    print("\n## Outputs that differ from the baseline\n")
    print("First differing token, and the target's logits (plain forward, same dtype) for the baseline's token "
          "vs the speculative run's token there:\n")
    print("| configuration | prompt | token | logits: baseline's vs speculative's token |")
    print("|---|---|---:|---|")
    for label, name, i, note in rows:
        print(f"| {label} | {name} | {i} | {note} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="a HF directory or the bundled model")
    parser.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="runs per prompt and configuration (median)")
    parser.add_argument("--configs", default=None,
                        help="comma-separated: ngram:k=K:n=MIN-MAX[:fixed], layers:k=K:L=LAYERS[:fixed], "
                        "draft:k=K:q=QUANT[:m=MODEL][:fixed] "
                        f"(default {DEFAULT_CONFIGS})")
    parser.add_argument("--prompts", default="", help="comma-separated prompt names (default: all)")
    parser.add_argument("--no-profile", action="store_true", help="skip the per-step profile pass")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 32 tokens, 2 configs")
    parser.add_argument("--json", dest="json_path", help="also write the table's figures here as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.max_tokens = 1, 32
        args.configs = args.configs or "ngram:k=4:n=1-4,layers:k=2:L=8"
    args.configs = args.configs or DEFAULT_CONFIGS
    return args


def main(argv: list[str] | None = None) -> None:
    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import resolve_model

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model, load_settings(ModelSettings).home)
    model = load_model(model_dir, dtype=args.dtype)
    tokenizer = Tokenizer(model_dir)
    configs = [BenchConfig("no speculation", None)] + [BenchConfig.parse(c) for c in args.configs.split(",") if c]
    wanted = {n for n in args.prompts.split(",") if n}
    prompts = [p for p in PROMPTS if not wanted or p.name in wanted]

    print(f"# Speculative decoding at batch 1 — {model_dir.name}, {args.dtype}\n")
    for line in machine_description(torch.get_num_threads()):
        print(f"- {line}")
    print(f"\nGreedy, EOS on, at most {args.max_tokens} tokens per prompt; {len(prompts)} chat prompts "
          f"({sum(p.grounded for p in prompts)} input-grounded); median of {args.repeats} interleaved repeats. "
          "Decode tok/s excludes the prefill.\n", flush=True)
    cells, reference = run_all(model, tokenizer, configs, prompts, args.max_tokens, args.repeats,
                               lambda line: print(line, file=sys.stderr, flush=True), model_dir=model_dir)
    rows = table_rows(configs, cells, reference, configs[0].label)
    print_table(rows)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "model": model_dir.name, "dtype": args.dtype, "threads": args.threads, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "prompts": [p.name for p in prompts], "rows": rows}, indent=2))
    print_per_prompt(configs, cells, prompts, configs[0].label)
    print_divergences(model, tokenizer, configs, cells, reference, prompts)
    if not args.no_profile:
        # The baseline and the first configuration of each proposer, over the grounded prompts.
        chosen = [configs[0]]
        for method in (SpeculativeMethod.NGRAM, SpeculativeMethod.DRAFT_LAYERS, SpeculativeMethod.DRAFT_MODEL):
            chosen += [c for c in configs if c.speculative and c.speculative.method is method][:1]
        grounded = [p for p in prompts if p.grounded] or prompts
        print_profile(profile(model, tokenizer, chosen, grounded, args.max_tokens, model_dir),
                      f"{len(grounded)} input-grounded prompts")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
