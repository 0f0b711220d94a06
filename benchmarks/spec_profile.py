"""Where a speculative decode step's time goes: a profiler that wraps one engine's parts, and a pass using it.

Used by ``benchmarks.bench_speculative`` (its profile section): the baseline and one configuration per
proposer, over the same prompts, interleaved. The runs themselves come from ``benchmarks.spec_run``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from benchmarks.spec_run import BenchConfig, generate, make_engine
from common.engine.engine_core import ColocatedEngine
from common.sampling.params import SamplingParams

if TYPE_CHECKING:
    from benchmarks.spec_prompts import BenchPrompt
    from common.model.llama import LlamaDecoderLayer, LlamaForCausalLM
    from common.tokenizer import Tokenizer


class StepProfiler:
    """Where a decode step's time goes, by wrapping this engine's parts (instance attributes; code untouched).

    Parts are exclusive and add up to the step: the model forward without attention, attention (the
    backend: paged decode for 1 query row, the extend path for k + 1 rows), the LM head over the rows that
    sample or verify, proposing, the rest of the runner (inputs, metadata, sampling / verification),
    the scheduler (schedule + update) and the engine loop around them.
    """

    PARTS = ("model forward w/o attention", "attention", "LM head", "propose (draft)", "runner: inputs + verify",
             "scheduler", "engine loop")

    def __init__(self, engine: ColocatedEngine) -> None:
        self.num_steps = 0
        self.num_rows = 0  # query rows through the target's forward, summed over decode steps
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self._current: dict[str, float] = {}
        self._rows = 0
        self._in_propose = False
        self.enabled = True
        runner, model = engine.runner, engine.runner.model
        backend = cast("LlamaDecoderLayer", model.layers[0]).self_attn.backend  # one instance for all layers
        self._patched: list[tuple[object, str, object]] = []
        self._wrap(runner, "execute", "execute")
        self._wrap(runner, "_propose", "propose")
        self._wrap(engine.scheduler, "schedule", "scheduler")
        self._wrap(engine.scheduler, "update", "scheduler")
        self._wrap(model, "forward", "model")
        self._wrap(model, "compute_logits", "logits")
        self._wrap(backend, "forward", "attention")

    def _wrap(self, owner: object, name: str, part: str) -> None:
        fn: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return fn(*args, **kwargs)
            if part == "propose":
                self._in_propose = True
            elif part == "model" and not self._in_propose:
                self._rows += len(args[0])
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if part == "propose":
                    self._in_propose = False
                # A draft model's forwards are part of proposing, not of the target's step.
                if part in ("propose", "execute", "scheduler") or not self._in_propose:
                    self._current[part] = self._current.get(part, 0.0) + time.perf_counter() - start

        # Engines share the model: another profiler may have wrapped it already; remove() puts that back.
        self._patched.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, timed)

    def remove(self) -> None:
        """Unwrap; profilers sharing a model must be removed newest first."""
        for owner, name, previous in reversed(self._patched):
            if previous is None:
                delattr(owner, name)  # the class's method shows through again
            else:
                setattr(owner, name, previous)

    def end_step(self, seconds: float, decoding: bool) -> None:
        c, self._current = self._current, {}
        rows, self._rows = self._rows, 0
        if not decoding:
            return
        get = c.get
        self.num_steps += 1
        self.num_rows += rows
        parts = {
            "model forward w/o attention": get("model", 0.0) - get("attention", 0.0),
            "attention": get("attention", 0.0),
            "LM head": get("logits", 0.0),
            "propose (draft)": get("propose", 0.0),
            "runner: inputs + verify": get("execute", 0.0) - get("propose", 0.0) - get("model", 0.0)
            - get("logits", 0.0),
            "scheduler": get("scheduler", 0.0),
            "engine loop": seconds - get("execute", 0.0) - get("scheduler", 0.0),
        }
        for part, spent in parts.items():
            self.seconds[part] += spent


def profile(model: LlamaForCausalLM, tokenizer: Tokenizer, configs: list[BenchConfig], prompts: list[BenchPrompt],
            max_tokens: int, model_dir: Path | None = None) -> list[tuple[BenchConfig, StepProfiler, int]]:
    """One more pass over ``prompts`` with the step profiler on, interleaved: (config, profile, tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    encoded = [tokenizer.encode_chat([{"role": "user", "content": p.content}]) for p in prompts]
    max_len = max(len(ids) for ids in encoded) + max_tokens + 32
    engines = [make_engine(model, config, max_len, model_dir) for config in configs]
    tokens = [0] * len(configs)
    profilers: list[StepProfiler] = []
    for engine in engines:
        generate(engine, encoded[0], SamplingParams(temperature=0.0, max_tokens=8), tokenizer.eos_token_ids)
        profilers.append(StepProfiler(engine))
    # The engines share the model: only the running engine's profiler may see its forwards.
    for ids in encoded:
        for i, (engine, profiler) in enumerate(zip(engines, profilers, strict=True)):
            profiler.enabled = True
            tokens[i] += len(generate(engine, ids, params, tokenizer.eos_token_ids, profiler).tokens) - 1
            profiler.enabled = False
    for profiler in reversed(profilers):
        profiler.remove()
    return list(zip(configs, profilers, tokens, strict=True))


def print_profile(results: list[tuple[BenchConfig, StepProfiler, int]], what: str) -> None:
    print(f"\n## Where a decode step goes ({what}, one pass, ms per decode step)\n")
    print("| part | " + " | ".join(c.label for c, _, _ in results) + " |")
    print("|---|" + "---:|" * len(results))
    for part in StepProfiler.PARTS:
        print(f"| {part} | " + " | ".join(f"{1e3 * p.seconds[part] / max(p.num_steps, 1):.2f}"
                                          for _, p, _ in results) + " |")
    total = [sum(p.seconds.values()) for _, p, _ in results]
    print("| **step** | " + " | ".join(f"**{1e3 * t / max(p.num_steps, 1):.2f}**"
                                        for t, (_, p, _) in zip(total, results, strict=True)) + " |")
    print("| query rows per step | " + " | ".join(f"{p.num_rows / max(p.num_steps, 1):.2f}"
                                                   for _, p, _ in results) + " |")
    print("| tokens per step | " + " | ".join(f"{n / max(p.num_steps, 1):.2f}" for _, p, n in results) + " |")
    print("| ms per token | " + " | ".join(f"{1e3 * t / max(n, 1):.2f}"
                                           for t, (_, _, n) in zip(total, results, strict=True)) + " |")
