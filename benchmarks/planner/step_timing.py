"""Timed engine steps for the planner's cost model, and the KV transfer cost per token, on this machine.

A colocated engine (the real scheduler and model runner, node-default batch limits) is driven through
a small grid: D sequences decoding at context L (D in 1/6/16, L in 64/320), each with pure decode steps
and with a new P-token prompt prefilled beside the decodes (P in 32/128/512), plus the prefill steps that
set each case up and one 1536-token prompt (or the model's context) in 512-token chunks. Each step is
timed from schedule to update (what a node's step costs) and described by its ``StepShape``; each probe
runs twice and the faster is kept: about 35 samples from 60 steps, ~45 s with SmolLM2-135M on one core.
KV transfer: a KV-sized tensor sent over a gloo pair group between two threads of this process
(loopback TCP, as between two nodes on one host), the median of a few rounds divided by its tokens.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from benchmarks.planner.cost_model import StepSample, StepShape

if TYPE_CHECKING:
    from common.engine.engine_core import EngineCore
    from common.model.llama import LlamaForCausalLM

DECODE_BATCHES = (1, 6, 16)
DECODE_CONTEXTS = (64, 320)
PREFILL_PROBES = (32, 128, 512)
LONG_PROMPT = 1536


def time_steps(model: LlamaForCausalLM, max_num_batched_tokens: int = 2048, max_prefill_chunk: int = 512,
               progress: bool = True) -> list[StepSample]:
    """Timed steps over the grid above (the first few, warm-up, not kept)."""
    from common.config.engine_config import CacheConfig, SchedulerConfig
    from common.engine.engine_core import ColocatedEngine
    from common.sampling.params import SamplingParams

    # The long prompt shrinks to a small model's context; the grid itself needs ~900 tokens.
    long_prompt = min(LONG_PROMPT, model.config.max_position_embeddings - 2)
    longest = max(long_prompt + 2, max(DECODE_CONTEXTS) + 64 + max(PREFILL_PROBES))
    if longest > model.config.max_position_embeddings:
        raise ValueError(f"the cost model's timed steps need a {longest}-token context; the model has "
                         f"{model.config.max_position_embeddings}")
    block = 16
    blocks = (max(DECODE_BATCHES) + 2) * (longest // block + 2) + 64
    engine = ColocatedEngine(model, CacheConfig(block_size=block, num_blocks=blocks, enable_prefix_caching=False),
                             SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=max_num_batched_tokens,
                                             max_prefill_chunk=max_prefill_chunk))
    vocab = model.config.vocab_size
    ids = iter(range(10**9))

    def prompt(n: int) -> list[int]:
        start = next(ids) * 7919
        return [(start + 31 * i) % (vocab - 2) + 1 for i in range(n)]

    def add(n: int, max_tokens: int) -> str:
        rid = f"plan-{next(ids)}"
        engine.add_request(rid, prompt(n), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return rid

    samples: list[StepSample] = []
    add(256, 4)  # warm-up: the first steps load kernels and allocate
    while engine.has_unfinished():
        _timed_step(engine)
    started = time.perf_counter()
    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            decoding = [add(context, 10_000) for _ in range(batch)]
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
                    engine.scheduler.waiting:
                samples.append(_timed_step(engine))
            # Each shape twice, the faster kept: on a shared machine interference only ever slows a step.
            samples.append(min((_timed_step(engine) for _ in range(2)), key=lambda s: s.seconds))
            for p in PREFILL_PROBES:
                probes = []
                for _ in range(2):
                    add(p, 1)  # ends at its first token: the step is P prefill tokens beside the decodes
                    probes.append(_timed_step(engine))
                samples.append(min(probes, key=lambda s: s.seconds))
            for rid in decoding:
                engine.abort(rid)
            if progress:
                print(f"[plan] timed {len(samples)} steps ({time.perf_counter() - started:.0f} s)",
                      file=sys.stderr, flush=True)
    add(long_prompt, 1)
    while engine.has_unfinished():
        samples.append(_timed_step(engine))
    return samples


def _timed_step(engine: EngineCore) -> StepSample:
    """``EngineCore.step`` (schedule -> run -> update) with its time and the shape of what it ran."""
    started = time.perf_counter()
    scheduled = engine.scheduler.schedule()
    shape = StepShape.of((c.start, c.num_tokens, c.start >= c.request.num_prompt_tokens) for c in scheduled.chunks)
    sampled = engine.runner.execute(scheduled) if not scheduled.is_empty else None
    for out in engine.scheduler.update(scheduled, sampled):
        if out.finished:
            engine.runner.forget(out.request_id)
    return StepSample(shape, time.perf_counter() - started)


def kv_transfer_per_token_s(bytes_per_token: int, tokens: int = 512, rounds: int = 5) -> float:
    """Seconds per token to send ``tokens`` tokens' KV between two gloo ranks over loopback."""
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    numel = bytes_per_token * tokens // 2
    times: list[float] = []
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            client = store if r == 0 else dist.TCPStore("127.0.0.1", store.port, 2, False,
                                                        timeout=datetime.timedelta(seconds=30))
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = datetime.timedelta(seconds=30)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            pg: Any = dist.ProcessGroupGloo(dist.PrefixStore("plan-kv", client), r, 2, options)
            buffer = torch.ones(numel, dtype=torch.bfloat16) if r == 0 else torch.empty(numel, dtype=torch.bfloat16)
            for i in range(rounds + 1):
                pg.barrier().wait()
                t0 = time.perf_counter()
                (pg.send([buffer], 1, i) if r == 0 else pg.recv([buffer], 0, i)).wait()
                if r == 1 and i:  # round 0 warms the pair up
                    times.append(time.perf_counter() - t0)
        except BaseException as exc:  # reported by the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors or len(times) < rounds:
        raise RuntimeError(f"KV transfer timing failed: {errors[0] if errors else 'timed out'}")
    return statistics.median(times) / tokens
