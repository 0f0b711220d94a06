"""One speculative configuration of the batch-1 benchmark, its engine, and one timed generation.

What ``benchmarks.bench_speculative`` (the measured runs) and ``benchmarks.spec_profile`` (the profile
pass) both run; it imports neither of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from common.config.engine_config import CacheConfig, SchedulerConfig, SpeculativeConfig, SpeculativeMethod
from common.engine.engine_core import ColocatedEngine
from common.sampling.params import SamplingParams

if TYPE_CHECKING:
    from common.model.llama import LlamaForCausalLM

BLOCK_SIZE = 16


@dataclass(frozen=True)
class BenchConfig:
    label: str
    speculative: SpeculativeConfig | None  # None: the baseline

    @staticmethod
    def parse(text: str) -> BenchConfig:
        """``ngram:k=8:n=1-4[:fixed]``, ``layers:k=4:L=8[:fixed]`` or
        ``draft:k=8:q=int4[:m=MODEL][:ngram[=N]][:nk=K][:fixed]`` (fixed: no adaptive k; ngram[=N]: n-gram
        lookup first, for matches of >= N tokens (default 3), the draft where it finds none; nk=K: the lookup
        proposes up to K tokens (default k); a draft model is the target itself, quantized ``q``, unless ``m``
        names one)."""
        method_name, *options = text.strip().split(":")
        method = {"ngram": SpeculativeMethod.NGRAM, "layers": SpeculativeMethod.DRAFT_LAYERS,
                  "draft": SpeculativeMethod.DRAFT_MODEL}.get(method_name)
        if method is None:
            raise ValueError(f"config {text!r}: method must be ngram, layers or draft, got {method_name!r}")
        kwargs: dict[str, Any] = {"method": method}
        if method is SpeculativeMethod.DRAFT_MODEL:
            kwargs["draft_model"] = SELF_DRAFT
        for option in options:
            key, _, value = option.partition("=")
            if key == "k":
                kwargs["num_speculative_tokens"] = int(value)
            elif key == "n":
                low, _, high = value.partition("-")
                kwargs["ngram_min_n"], kwargs["ngram_max_n"] = int(low), int(high or low)
            elif key == "L":
                kwargs["draft_layers"] = int(value)
            elif key == "q" and method is SpeculativeMethod.DRAFT_MODEL:
                kwargs["draft_quantization"] = value
            elif key == "m" and method is SpeculativeMethod.DRAFT_MODEL:
                kwargs["draft_model"] = value
            elif key == "ngram" and method is SpeculativeMethod.DRAFT_MODEL:
                kwargs["ngram_first"] = True
                if value:  # ngram=N: the lookup's drafts after matches of >= N tokens
                    kwargs["ngram_first_min_n"] = int(value)
            elif key == "nk" and method is SpeculativeMethod.DRAFT_MODEL:
                kwargs["ngram_first_max_tokens"] = int(value)
            elif key == "fixed":
                kwargs["adaptive"] = False
            else:
                raise ValueError(f"config {text!r}: unknown option {key!r} (k, n, L, q, m, ngram, nk, fixed)")
        spec = SpeculativeConfig(**kwargs)
        if method is SpeculativeMethod.NGRAM:
            label = f"ngram k={spec.num_speculative_tokens} n={spec.ngram_min_n}-{spec.ngram_max_n}"
        elif method is SpeculativeMethod.DRAFT_MODEL:
            who = "self" if spec.draft_model == SELF_DRAFT else spec.draft_model
            label = (f"draft {who} {spec.draft_quantization} k={spec.num_speculative_tokens}"
                     + (f" +ngram>={spec.ngram_first_min_n}" if spec.ngram_first else "")
                     + (f" (lookup k={spec.ngram_first_max_tokens})" if spec.ngram_first_max_tokens else ""))
        else:
            label = f"layers L={spec.draft_layers} k={spec.num_speculative_tokens}"
        return BenchConfig(label + ("" if spec.adaptive else " fixed"), spec)


SELF_DRAFT = "<the target>"  # draft:...: without m=, the target's own weights draft (quantized with q=)


@dataclass(frozen=True)
class Run:
    """One generation of one prompt."""

    tokens: list[int]
    decode_seconds: float  # first token -> last token
    decode_steps: int  # engine steps after the first token
    num_drafts: int
    num_accepted: int
    num_verify_steps: int
    draft_seconds: float
    forward_seconds: float


class StepObserver(Protocol):
    """Told each engine step's wall time (``benchmarks.spec_profile.StepProfiler`` is one)."""

    def end_step(self, seconds: float, decoding: bool) -> None: ...


def make_engine(model: LlamaForCausalLM, config: BenchConfig, max_len: int,
                model_dir: Path | None = None) -> ColocatedEngine:
    # Prefix caching off: every repeat prefills the same way (the prefill is not timed anyway).
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=-(-max_len // BLOCK_SIZE) + 8, enable_prefix_caching=False)
    return ColocatedEngine(model, cache, SchedulerConfig(max_num_seqs=1), speculative=config.speculative,
                           draft_model=_draft_model(config.speculative, model, model_dir))


def _draft_model(spec: SpeculativeConfig | None, model: LlamaForCausalLM,
                 model_dir: Path | None) -> LlamaForCausalLM | None:
    """A draft config's model: the target's own weights (``m`` unset) or the named model, quantized ``q``."""
    if spec is None or spec.method is not SpeculativeMethod.DRAFT_MODEL:
        return None
    from common.config.settings import ModelSettings, load_settings
    from common.engine.node_setup import check_same_tokenizer
    from common.model.loader import load_model
    from common.model.model_store import resolve_model

    assert model_dir is not None, "a draft-model config needs the target's directory"
    draft_dir = model_dir if spec.draft_model == SELF_DRAFT else resolve_model(spec.draft_model,
                                                                               load_settings(ModelSettings).home)
    check_same_tokenizer(draft_dir, model_dir)
    return load_model(draft_dir, dtype=model.dtype, quantization=spec.draft_quantization)


_next_id = 0


def generate(engine: ColocatedEngine, prompt_ids: list[int], params: SamplingParams,
             eos_token_ids: tuple[int, ...], profiler: StepObserver | None = None) -> Run:
    """Generate one request alone; counters and timers are taken from the first token on."""
    global _next_id
    _next_id += 1
    engine.add_request(f"r{_next_id}", prompt_ids, params, eos_token_ids)
    sched, runner = engine.scheduler, engine.runner
    tokens: list[int] = []
    first_at = last_at = 0.0
    steps = 0
    counters: tuple[float, ...] = ()
    while engine.has_unfinished():
        started = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if profiler is not None:
            profiler.end_step(now - started, decoding=bool(tokens))
        if tokens:
            steps += 1
        for out in outputs:
            if out.new_token_ids:
                if not tokens:
                    first_at = now
                    counters = (sched.num_draft_tokens, sched.num_accepted_tokens, sched.num_spec_steps,
                                runner.draft_seconds, runner.forward_seconds)
                tokens.extend(out.new_token_ids)
                last_at = now
    drafts, accepted, verifies, draft_s, forward_s = (
        after - before for after, before in zip((sched.num_draft_tokens, sched.num_accepted_tokens,
                                                 sched.num_spec_steps, runner.draft_seconds,
                                                 runner.forward_seconds), counters, strict=True))
    return Run(tokens, last_at - first_at, steps, int(drafts), int(accepted), int(verifies), draft_s, forward_s)

