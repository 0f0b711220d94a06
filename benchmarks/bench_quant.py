"""Quantized weights: batch-1 decode, the offline workload and quality for each mode, beside llama.cpp.

    python -m benchmarks.bench_quant [--model M] [--dtype D] [--threads N] [--modes none,int8,int4[,w8a8]]
                                     [--gguf FILE] [--quick] [--json OUT]

For each ``--quantization`` mode, in one process, one after another on the same machine:

- batch-1 decode: one prompt of 32 random token ids, 128 greedy tokens (EOS ignored); the rate counts
  the tokens after the first over the time after the first; best of 3 prompts;
- weight bytes streamed per decode step (every matrix a step multiplies: the projections and the LM head
  in their packed form, norms; not the embedding table, of which a step reads one row per token) and the
  bandwidth that rate implies;
- the offline workload (64 prompts x 128 tokens -> 128 new tokens; ``--quick``: 16 x 64 -> 32): output
  tokens over wall time, as in the offline section;
- quality: perplexity on ``tests/quant/data/perplexity.txt`` through one forward (the prefill path) and
  teacher-forced decode steps (the decode path: int8-rounded activations with the default CPU kernels),
  and greedy agreement with the unquantized weights on the first 64 tokens of 10 prompts
  (``benchmarks.quant_quality``), always in fp32.

llama.cpp (``.peers/llamacpp``, ``make bench-peers``) runs the same GGUF file with the same threads in the
same run: the same batch-1 prompts, and the offline prompts one at a time (its Python API does not batch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Set
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_offline import Workload
from benchmarks.machine import machine_description
from benchmarks.quant_quality import PROMPTS, TEXT_PATH, agreement, decode_perplexity, greedy_tokens, perplexity
from common.config.engine_config import CacheConfig, SchedulerConfig
from common.engine.engine_core import ColocatedEngine
from common.kernels.isa import best_isa, cpu_flags
from common.model.linear import Linear
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.sampling.params import SamplingParams

REPO = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
DECODE = {False: (3, 32, 128), True: (2, 32, 32)}  # quick -> (prompts, prompt tokens, new tokens)
OFFLINE = {False: (64, 128, 128), True: (16, 64, 32)}
AGREEMENT_TOKENS = 64
PEER_TIMEOUT_S = 900.0
LLAMACPP_OFFLINE_BUDGET_S = {False: 60.0, True: 10.0}
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")


@dataclass
class ModeResult:
    mode: str
    dtype: str
    weight_bytes: int  # everything the model holds
    streamed_bytes: int  # read by one decode step
    decode_tokens_per_s: float
    offline_tokens_per_s: float
    perplexity: float | None = None
    decode_perplexity: float | None = None
    token_match: float | None = None
    prefix_tokens: float | None = None

    @property
    def streamed_gb_per_s(self) -> float:
        return self.streamed_bytes * self.decode_tokens_per_s / 1e9


def streamed_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of every weight one decode step reads: all modules but the embedding lookup table (a tied
    LM head reads the whole matrix: the head counts it)."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            total += module.weight_bytes  # float or packed, bias included
        elif name != "embed_tokens":
            total += sum(p.nbytes for p in module.parameters(recurse=False))
    return total


def _engine(model: Any, num_seqs: int, tokens_per_seq: int) -> ColocatedEngine:
    blocks = (num_seqs + 2) * math.ceil(tokens_per_seq / BLOCK_SIZE) + 16
    return ColocatedEngine(model, CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks),
                           SchedulerConfig(max_num_seqs=max(num_seqs, 1), max_num_batched_tokens=2048,
                                           max_prefill_chunk=512))


def decode_rate(model: Any, prompts: list[list[int]], n: int) -> float:
    """Best batch-1 decode rate over the prompts (tokens after the first / time after the first)."""
    engine = _engine(model, 1, len(prompts[0]) + n)
    best = 0.0
    for i, prompt in enumerate([prompts[0][:8], *prompts]):  # a short warm-up first
        engine.add_request(f"b1-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        count, first = 0, 0.0
        while engine.has_unfinished():
            for out in engine.step():
                count += len(out.new_token_ids)
                if first == 0.0 and count:
                    first = time.perf_counter()
        if i > 0:
            best = max(best, (count - 1) / (time.perf_counter() - first))
    return best


def offline_rate(model: Any, workload: Workload) -> float:
    engine = _engine(model, workload.num_prompts, workload.prompt_len + workload.output_len)
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    warm = Workload(2, workload.prompt_len, 4, seed=workload.seed + 1)
    for i, prompt in enumerate(warm.prompts(model.config.vocab_size)):
        engine.add_request(f"warm-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    tokens = 0
    start = time.perf_counter()
    for i, prompt in enumerate(workload.prompts(model.config.vocab_size)):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    assert tokens == workload.total_output_tokens
    return tokens / (time.perf_counter() - start)


def run_mode(model_dir: Path, mode: str, dtype: str, quick: bool, reference_tokens: list[list[int]] | None,
             text_ids: list[int], prompt_ids: list[list[int]]) -> tuple[ModeResult, list[list[int]]]:
    model = load_model(model_dir, dtype=dtype, quantization=mode)
    n_prompts, prompt_len, n_new = DECODE[quick]
    b1 = Workload(n_prompts, prompt_len, n_new, seed=7).prompts(model.config.vocab_size)
    result = ModeResult(mode, dtype, model.weight_bytes, streamed_bytes(model), decode_rate(model, b1, n_new),
                        offline_rate(model, Workload(*OFFLINE[quick])))
    del model
    # Quality in fp32 whatever the speed dtype: the figures then describe the weights, not bf16 rounding.
    qmodel = load_model(model_dir, dtype="float32", quantization=mode)
    result.perplexity = perplexity(qmodel, text_ids)
    result.decode_perplexity = decode_perplexity(qmodel, text_ids)
    tokens = greedy_tokens(_engine(qmodel, len(prompt_ids), 64 + AGREEMENT_TOKENS), prompt_ids, AGREEMENT_TOKENS)
    if reference_tokens is not None:
        agree = agreement(reference_tokens, tokens)
        result.token_match, result.prefix_tokens = agree.token_match, agree.prefix_tokens
    return result, tokens


def run_llamacpp(python: Path, gguf: Path, threads: int, quick: bool, vocab: int) -> dict[str, Any]:
    """Batch-1 decode (this section's prompts) and the offline workload (the peer script), same threads."""
    from benchmarks.peers import run_peer, write_requests

    n_prompts, prompt_len, n_new = DECODE[quick]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory(prefix="tandem-quant-") as tmp:
        requests, out = Path(tmp) / "b1.json", Path(tmp) / "b1-result.json"
        write_requests(requests, Workload(n_prompts, prompt_len, n_new, seed=7).prompts(vocab), n_new)
        script = Path(__file__).resolve().parent / "peers" / "llamacpp_decode.py"
        subprocess.run([str(python), str(script), "--requests", str(requests), "--model", str(gguf),
                        "--threads", str(threads), "--out", str(out)], env=env, check=True, timeout=PEER_TIMEOUT_S,
                       capture_output=True)
        decode = json.loads(out.read_text())
        workload = Workload(*OFFLINE[quick])
        offline_requests = Path(tmp) / "offline.json"
        write_requests(offline_requests, workload.prompts(vocab), workload.output_len)
        offline = run_peer("llamacpp", python, offline_requests, Path(tmp) / "offline-result.json", gguf, threads,
                           "Q4_1", LLAMACPP_OFFLINE_BUDGET_S[quick], PEER_TIMEOUT_S)
    return {"system": decode["system"], "decode_tokens_per_s": decode["decode_tokens_per_s"],
            "offline_tokens_per_s": offline["tokens_per_s"], "offline_note": offline.get("note", "")}


def report_lines(data: dict[str, Any]) -> list[str]:
    """The section's Markdown from its JSON (``tandem bench report`` can rebuild it from the file alone)."""
    modes = data["modes"]
    peer = data.get("llamacpp")
    none = next((r for r in modes if r["mode"] == "none"), None)

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a and b else "-"

    def vs_none(r: dict[str, Any], key: str) -> str:
        return ratio(r[key], none[key] if none else None)

    lines = [f"- CPU flags: {' '.join(data['simd_flags']) or 'none of AVX2/AVX-512'}; Tandem's quantized kernels: "
             f"{data['kernels']}; {data['threads']} threads (Tandem and llama.cpp alike)", "",
             "| mode | dtype | weights held (MB) | streamed per step (MB) | batch-1 decode tok/s | vs none "
             "| vs llama.cpp | GB/s streamed | offline tok/s | vs none | perplexity | vs none "
             "| decode-path perplexity | vs none | greedy token match | identical prefix (of 64) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ppl_cells(r: dict[str, Any], key: str) -> str:
        value, ref = r.get(key), none.get(key) if none else None
        return (f"{value:.3f} | {100 * (value / ref - 1):+.1f}%" if value and ref else
                f"{value:.3f} | -" if value else "- | -")

    for r in modes:
        match = f"{100 * r['token_match']:.1f}%" if r["token_match"] is not None else "-"
        prefix = f"{r['prefix_tokens']:.1f}" if r["prefix_tokens"] is not None else "-"
        lines.append(
            f"| {r['mode']} | {r['dtype']} | {r['weight_bytes'] / 1e6:.0f} | {r['streamed_bytes'] / 1e6:.0f} "
            f"| **{r['decode_tokens_per_s']:.1f}** | {vs_none(r, 'decode_tokens_per_s')} "
            f"| {ratio(r['decode_tokens_per_s'], peer and peer['decode_tokens_per_s'])} "
            f"| {r['streamed_gb_per_s']:.1f} | {r['offline_tokens_per_s']:.1f} | {vs_none(r, 'offline_tokens_per_s')} "
            f"| {ppl_cells(r, 'perplexity')} | {ppl_cells(r, 'decode_perplexity')} | {match} | {prefix} |")
    if peer is not None:
        lines.append(f"| {peer['system']} | Q4_1 (GGUF) | - | - | **{peer['decode_tokens_per_s']:.1f}** | - | 1.00x "
                     f"| - | {peer['offline_tokens_per_s']:.1f} | - | - | - | - | - | - | - |")
        lines += ["", f"llama.cpp offline: {peer['offline_note']}"]
    else:
        lines += ["", f"llama.cpp: {data['llamacpp_note']}"]
    lines += ["", "Modes: int8 = weight-only, one scale per output channel (GGUF Q8_0 blocks as published); "
              "int4 = 4-bit groups of 32 (a GGUF's Q4_0/Q4_1 blocks as published; LM head int8 / Q8_0); "
              "w8a8 = int8 weights x per-token int8 activations. Decode steps of int8/int4 round the activations to "
              "int8 blocks of 32 (the tandem_a8 kernels, as llama.cpp does). Perplexity and agreement in fp32; weights "
              "streamed per step exclude the embedding table (one row per token is read)."]
    return lines


# CPU flags with an int8 dot-product instruction. Without one, oneDNN's int8 GEMM behind w8a8
# (torch._int_mm) crawls: on a 2-core AVX2 EPYC its offline workload ran 18 minutes without finishing.
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def default_modes(flags: Set[str]) -> str:
    """The modes a plain run measures: w8a8 only where the CPU multiplies int8 natively."""
    return "none,int8,int4" + (",w8a8" if flags & INT8_DOT_FLAGS else "")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--modes", default="", help="[none,int8,int4, and w8a8 where the CPU has VNNI]")
    parser.add_argument("--gguf", default="", help="llama.cpp's weights [the bundled GGUF for the bundled model]")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", dest="json_path", default="")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.peers import PeerError, find_peer
    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import gguf_source, resolve_model
    from common.tokenizer import Tokenizer

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = load_settings(ModelSettings, {"model": args.model})
    model_dir = resolve_model(settings.model, settings.home, progress=True)
    tokenizer = Tokenizer(model_dir)
    text_ids = tokenizer.encode(TEXT_PATH.read_text())
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    modes = [m.strip() for m in (args.modes or default_modes(cpu_flags())).split(",") if m.strip()]
    if "none" in modes:  # the reference of the agreement column comes first
        modes.remove("none")
        modes.insert(0, "none")
    results: list[ModeResult] = []
    reference: list[list[int]] | None = None
    for mode in modes:
        print(f"quantization {mode} ...", file=sys.stderr, flush=True)
        result, tokens = run_mode(model_dir, mode, args.dtype, args.quick, reference, text_ids, prompt_ids)
        reference = tokens if mode == "none" else reference
        results.append(result)
        print(f"  {mode}: batch-1 {result.decode_tokens_per_s:.1f} tok/s, offline {result.offline_tokens_per_s:.1f} "
              f"tok/s, perplexity {result.perplexity:.3f}", file=sys.stderr, flush=True)
    gguf = Path(args.gguf) if args.gguf else gguf_source(model_dir)
    peer: dict[str, Any] | None = None
    python, note = find_peer("llamacpp", REPO)
    if gguf is None:
        note = "no GGUF file for this model (--gguf)"
    elif python is not None:
        try:
            peer = run_llamacpp(python.python, gguf, args.threads, args.quick, load_model_vocab(model_dir))
        except (PeerError, subprocess.SubprocessError, OSError, ValueError) as exc:
            note = f"failed: {exc}"[:400]
    flags = cpu_flags()
    payload = {"threads": args.threads, "simd_flags": [f for f in SIMD_FLAGS if f in flags], "kernels": best_isa(),
               "modes": [{**asdict(r), "streamed_gb_per_s": r.streamed_gb_per_s} for r in results],
               "llamacpp": peer, "llamacpp_note": note if peer is None else "",
               "decode_workload": DECODE[args.quick], "offline_workload": OFFLINE[args.quick]}
    print("## Quantized weights\n")
    print("\n".join([*(f"- {line}" for line in machine_description(args.threads)), *report_lines(payload)]))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(payload, indent=2))
    return 0


def load_model_vocab(model_dir: Path) -> int:
    from common.config.model_config import ModelConfig

    return ModelConfig.from_pretrained(model_dir).vocab_size


if __name__ == "__main__":
    sys.exit(main())
