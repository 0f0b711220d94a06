"""Offline throughput: Tandem's colocated engine against Hugging Face ``generate``, same workload, same run.

    python -m benchmarks.bench_offline [--dtypes float32,bfloat16] [--threads N] [--quick] [--skip-hf]
                                       [--compile [dense|forward]] [--settings 512:512,2048:512]

Workload (fixed seed): 64 prompts of exactly 128 token ids drawn uniformly from [100, vocab), each
generating 128 new tokens, greedy, EOS ignored, so every request yields exactly 128 tokens (8192 in all).
Throughput is output tokens over the whole wall time, prefill included. Tandem gets every request up
front and runs its continuous-batching scheduler under a few token budgets; the baseline is
``AutoModelForCausalLM.generate`` in static batches of 16 (equal-length prompts: no padding). Each
system gets a small warm-up first. Compile time of the opt-in ``torch.compile`` row is reported
apart from its throughput: ``dense`` compiles the norms and MLPs of every layer, ``forward`` the whole
model forward (impractical today: the attention backend loops over sequences in Python and reads
host-side metadata, so it graph-breaks and recompiles step after step).

Slow baselines run only as many batches as ``--hf-budget-s`` allows (at least one); all batches have
the same shape, so the rate of those batches stands for the rest, and the table says so. Each row also
reports the process's CPU time: on a shared machine, wall time alone hides how much of it we got.
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from benchmarks.machine import load_average, machine_description
from benchmarks.step_timer import StepProfile, StepTimer, print_profile
from common.attention.torch_backend import TorchAttentionBackend
from common.config.engine_config import CacheConfig, SchedulerConfig
from common.engine.engine_core import ColocatedEngine
from common.model.layers import RMSNorm, SwiGLUMLP
from common.model.loader import load_model, resolve_dtype
from common.sampling.params import SamplingParams

if TYPE_CHECKING:
    from common.model.llama import LlamaDecoderLayer, LlamaForCausalLM

BLOCK_SIZE = 16



class CompileScope(enum.Enum):
    DENSE = "dense"  # RMSNorm and SwiGLU MLP modules: token-wise, one dynamic graph each
    FORWARD = "forward"  # the whole model forward, attention included


def compile_model(model: LlamaForCausalLM, scope: CompileScope) -> None:
    if scope is CompileScope.FORWARD:
        setattr(model, "forward", torch.compile(model.forward, dynamic=True))  # noqa: B010
        return
    for module in model.modules():
        if isinstance(module, RMSNorm | SwiGLUMLP):
            module.compile(dynamic=True)


@dataclass(frozen=True)
class Workload:
    num_prompts: int = 64
    prompt_len: int = 128
    output_len: int = 128
    seed: int = 0

    @property
    def total_output_tokens(self) -> int:
        return self.num_prompts * self.output_len

    def prompts(self, vocab_size: int) -> list[list[int]]:
        # Ids below 100 are special and byte tokens in most vocabularies; tiny test vocabularies keep half.
        low = min(100, vocab_size // 2)
        generator = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(low, vocab_size, (self.num_prompts, self.prompt_len), generator=generator)
        return ids.tolist()


@dataclass(frozen=True)
class EngineSetting:
    max_num_batched_tokens: int
    max_prefill_chunk: int | None

    @property
    def label(self) -> str:
        return f"budget {self.max_num_batched_tokens}, chunk {self.max_prefill_chunk or 'none'}"


@dataclass(frozen=True)
class Result:
    """One row of the table."""

    system: str
    dtype: str
    setting: str
    output_tokens: int
    seconds: float
    # CPU time of the process over the same span: cpu_seconds / seconds far below the thread count means
    # other work on the machine took the cores, and the row understates the system.
    cpu_seconds: float = 0.0
    # Wall time until every request had its first token, and the output tokens produced by then.
    first_tokens_s: float | None = None
    tokens_at_first: int = 0
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Rate after the last prompt's first token: decode only, no prefill in the window."""
        if self.first_tokens_s is None or self.seconds <= self.first_tokens_s:
            return None
        return (self.output_tokens - self.tokens_at_first) / (self.seconds - self.first_tokens_s)


def run_tandem(model_dir: Path, dtype: str, workload: Workload, setting: EngineSetting,
               compile_scope: CompileScope | None = None, compiled_decode: bool = True) -> tuple[Result, StepProfile]:
    """Serve the workload with the colocated engine; returns its row and the decode-step profile.
    ``compiled_decode=False`` decodes through the torch backend's PyTorch path instead of the CPU kernel."""
    model = load_model(model_dir, dtype=dtype)
    note = ""
    if not compiled_decode:
        backend = cast("LlamaDecoderLayer", model.layers[0]).self_attn.backend  # one instance for all layers
        assert isinstance(backend, TorchAttentionBackend), "the PyTorch-path row needs the torch backend"
        backend.compiled_decode = False
        note = "decode attention: PyTorch path (TANDEM_CPU_KERNELS=0)"
    if compile_scope is not None:
        compile_model(model, compile_scope)
    # The whole workload fits in the cache (no preemption), sized to it rather than the default KV memory.
    blocks_per_seq = math.ceil((workload.prompt_len + workload.output_len) / BLOCK_SIZE)
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=(workload.num_prompts + 2) * blocks_per_seq + 16)
    scheduler = SchedulerConfig(max_num_seqs=workload.num_prompts,
                                max_num_batched_tokens=setting.max_num_batched_tokens,
                                max_prefill_chunk=setting.max_prefill_chunk)
    engine = ColocatedEngine(model, cache, scheduler)
    greedy = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    vocab = model.config.vocab_size

    # Warm-up: a prefill and decode steps of other prompts (compiles, when compiling).
    start = time.perf_counter()
    warm = Workload(num_prompts=2, prompt_len=workload.prompt_len, output_len=4, seed=workload.seed + 1)
    for i, prompt in enumerate(warm.prompts(vocab)):
        engine.add_request(f"warm-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    if compile_scope is not None:
        note = f"{compile_scope.value}; compile + warm-up {time.perf_counter() - start:.0f} s (not in the wall time)"

    timer = StepTimer(engine, workload.num_prompts)
    started: set[str] = set()
    tokens = tokens_at_first = 0
    first_tokens_s: float | None = None
    start, cpu_start = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(workload.prompts(vocab)):
        engine.add_request(str(i), prompt, greedy)
    while engine.has_unfinished():
        step_start = time.perf_counter()
        outputs = engine.step()
        timer.end_step(time.perf_counter() - step_start)
        for out in outputs:
            tokens += len(out.new_token_ids)
            started.add(out.request_id)
        if first_tokens_s is None and len(started) == workload.num_prompts:
            first_tokens_s, tokens_at_first = time.perf_counter() - start, tokens
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    assert tokens == workload.total_output_tokens, f"{tokens} output tokens, expected {workload.total_output_tokens}"
    if engine.scheduler.num_preemptions:
        note = f"{note}; {engine.scheduler.num_preemptions} preemptions".lstrip("; ")
    system = ("Tandem + torch.compile" if compile_scope is not None
              else "Tandem" if compiled_decode else "Tandem (PyTorch decode path)")
    result = Result(system, dtype, setting.label, tokens, seconds, cpu_seconds, first_tokens_s, tokens_at_first, note)
    return result, timer.profile


def run_hf(model_dir: Path, dtype: str, workload: Workload, batch_size: int = 16,
           budget_s: float | None = None) -> Result:
    """Hugging Face ``generate`` in static batches; stops after the batch that spends ``budget_s``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(dtype)).eval()
    # No EOS: every row generates exactly output_len tokens, as Tandem's ignore_eos does.
    model.generation_config.eos_token_id = None
    kwargs = {"do_sample": False, "max_new_tokens": workload.output_len, "min_new_tokens": workload.output_len,
              "pad_token_id": 0}
    prompts = torch.tensor(workload.prompts(model.config.vocab_size))
    batches = prompts.split(batch_size)
    with torch.inference_mode():
        model.generate(batches[0][:2], attention_mask=torch.ones_like(batches[0][:2]),
                       **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        tokens = done = 0
        start, cpu_start = time.perf_counter(), time.process_time()
        for batch in batches:
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)
            assert out.shape == (batch.shape[0], batch.shape[1] + workload.output_len), out.shape
            tokens += out[:, batch.shape[1]:].numel()
            done += 1
            if budget_s is not None and time.perf_counter() - start > budget_s:
                break
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    note = "" if done == len(batches) else (f"measured {done} of {len(batches)} batches (--hf-budget-s), "
                                            "rate of those batches")
    return Result("HF generate", dtype, f"static batches of {batch_size}", tokens, seconds, cpu_seconds, note=note)


def print_table(results: list[Result], headline: dict[str, Result]) -> None:
    print("| system | dtype | setting | output tokens | wall (s) | cores busy | tok/s | tok/CPU-s "
          "| all first tokens at (s) | decode tok/s | note |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        best = " **(best)**" if headline.get(r.dtype) is r else ""
        first = f"{r.first_tokens_s:.1f}" if r.first_tokens_s is not None else "-"
        decode = f"{r.decode_tokens_per_s:.1f}" if r.decode_tokens_per_s is not None else "-"
        rate = f"**{r.tokens_per_s:.1f}**" if r.output_tokens else "-"
        busy = f"{r.cpu_seconds / r.seconds:.2f}" if r.seconds > 0 else "-"
        per_cpu = f"{r.output_tokens / r.cpu_seconds:.1f}" if r.cpu_seconds > 0 else "-"
        print(f"| {r.system}{best} | {r.dtype} | {r.setting} | {r.output_tokens} | {r.seconds:.1f} | {busy} "
              f"| {rate} | {per_cpu} | {first} | {decode} | {r.note} |", flush=True)


def write_json(path: Path, model: str, workload: Workload, results: list[Result],
               best: dict[str, tuple[Result, StepProfile, EngineSetting]], single: StepProfile | None) -> None:
    profiles = {dtype: profile for dtype, (_, profile, _) in best.items()}
    if single is not None:
        profiles["batch 1"] = single
    path.write_text(json.dumps({
        "model": model, "threads": torch.get_num_threads(), "workload": asdict(workload),
        "results": [{**asdict(r), "tokens_per_s": r.tokens_per_s, "decode_tokens_per_s": r.decode_tokens_per_s,
                     "best": best.get(r.dtype, (None,))[0] is r} for r in results],
        "profiles": {key: {"batch": profile.batch, "ms_per_step": 1e3 * profile.seconds_per_step,
                           "parts_ms": {name: 1e3 * sec for name, sec in profile.breakdown()},
                           "non_matmul_share": profile.non_matmul_share}
                     for key, profile in profiles.items()},
    }, indent=2))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="a HF directory or the bundled model")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32,bfloat16")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch CPU threads")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--settings", default="512:512,2048:512",
                        help="Tandem scheduler settings, max_num_batched_tokens:max_prefill_chunk (0 = none)")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--hf-budget-s", type=float, default=60.0,
                        help="HF stops after the batch that passes this many seconds")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--compile", nargs="?", const="dense", default=None, choices=[s.value for s in CompileScope],
                        help="add a torch.compile row per dtype: dense (norms + MLPs, default) or forward "
                             "(whole model; takes far too long today)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 prompts -> 32 tokens")
    parser.add_argument("--pytorch-decode", action="store_true",
                        help="add a row decoding through the PyTorch path instead of the compiled CPU kernel")
    parser.add_argument("--no-batch1-profile", action="store_true",
                        help="skip the single-request run that profiles the batch-1 decode step")
    parser.add_argument("--json", dest="json_path", help="also write the rows and profiles here as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_prompts, args.output_len = 16, 32
    return args


def main(argv: list[str] | None = None) -> None:
    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import resolve_model

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model, load_settings(ModelSettings).home)
    workload = Workload(args.num_prompts, args.prompt_len, args.output_len)
    settings = [EngineSetting(int(budget), int(chunk) or None)
                for budget, chunk in (s.split(":") for s in args.settings.split(","))]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]

    print(f"# Offline throughput — {model_dir.name}\n")
    for line in machine_description(torch.get_num_threads()):
        print(f"- {line}")
    print(f"\nWorkload: {workload.num_prompts} prompts x {workload.prompt_len} random token ids -> "
          f"{workload.output_len} new tokens each, greedy, EOS ignored ({workload.total_output_tokens} "
          "output tokens); tok/s = output tokens / wall time incl. prefill.\n", flush=True)

    results: list[Result] = []

    def add(result: Result) -> None:
        results.append(result)
        print(f"done: {result.system} {result.dtype} {result.setting}: {result.tokens_per_s:.1f} tok/s",
              file=sys.stderr, flush=True)

    # The fastest Tandem run of each dtype: the headline, its decode profile and its setting.
    best: dict[str, tuple[Result, StepProfile, EngineSetting]] = {}
    for dtype in dtypes:
        for setting in settings:
            result, profile = run_tandem(model_dir, dtype, workload, setting)
            add(result)
            if dtype not in best or result.tokens_per_s > best[dtype][0].tokens_per_s:
                best[dtype] = result, profile, setting
        if args.pytorch_decode:
            add(run_tandem(model_dir, dtype, workload, best[dtype][2], compiled_decode=False)[0])
        if args.compile:
            setting = best[dtype][2]
            try:
                add(run_tandem(model_dir, dtype, workload, setting, CompileScope(args.compile))[0])
            except Exception as exc:  # report any compiler failure as a row, not a crash
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                add(Result("Tandem + torch.compile", dtype, setting.label, 0, 0.0,
                           note=f"{args.compile}; compile: failed ({reason})"))
        if not args.skip_hf:
            add(run_hf(model_dir, dtype, workload, args.hf_batch_size, args.hf_budget_s))

    # One request alone through the same engine and setting: the batch-1 decode step, split the same way.
    profiled = "bfloat16" if "bfloat16" in best else next(iter(best), None)
    single = None
    if profiled is not None and not args.no_batch1_profile:
        alone = Workload(1, workload.prompt_len, workload.output_len, workload.seed)
        single = run_tandem(model_dir, profiled, alone, best[profiled][2])[1]
    print_table(results, {dtype: entry[0] for dtype, entry in best.items()})
    if args.json_path:
        write_json(Path(args.json_path), model_dir.name, workload, results, best, single)
    print("\nPeers (vLLM-CPU, llama.cpp) on the same prompts: `tandem bench run` (benchmarks/suite.py).")
    print(f"\nLoad average at the end (1/5/15 min): {load_average()}. 'cores busy' = process CPU time / wall "
          f"time; well below the thread count ({torch.get_num_threads()}) means other work took the cores during "
          "that row. 'tok/CPU-s' = output tokens per CPU second: with --threads 1 it estimates the rate on an idle "
          "core; with more threads it counts spin-waiting too.")
    if profiled is not None:
        result, profile, _ = best[profiled]
        print_profile(f"Tandem {result.dtype}, {result.setting}", profile)
        if single is not None:
            print_profile(f"Tandem {result.dtype}, {result.setting}, one request (batch 1)", single)


if __name__ == "__main__":
    main()
