"""The speculative benchmark's parts on a tiny model: config parsing, token accounting, the step profile."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.bench_speculative import BenchConfig, generate, make_engine
from benchmarks.spec_profile import StepProfiler
from common.config.engine_config import SpeculativeMethod
from common.model.loader import load_model
from common.sampling.params import SamplingParams


def test_config_parsing_and_labels() -> None:
    ngram = BenchConfig.parse("ngram:k=8:n=2-4")
    assert ngram.label == "ngram k=8 n=2-4"
    assert ngram.speculative is not None and ngram.speculative.method is SpeculativeMethod.NGRAM
    assert (ngram.speculative.num_speculative_tokens, ngram.speculative.ngram_min_n,
            ngram.speculative.ngram_max_n, ngram.speculative.adaptive) == (8, 2, 4, True)
    layers = BenchConfig.parse("layers:k=2:L=15:fixed")
    assert layers.label == "layers L=15 k=2 fixed"
    assert layers.speculative is not None and layers.speculative.draft_layers == 15
    assert not layers.speculative.adaptive
    with pytest.raises(ValueError, match="method"):
        BenchConfig.parse("medusa:k=2")
    with pytest.raises(ValueError, match="unknown option"):
        BenchConfig.parse("ngram:q=2")
    draft = BenchConfig.parse("draft:k=8:q=int4")
    assert draft.label == "draft self int4 k=8" and draft.speculative is not None
    assert draft.speculative.draft_quantization == "int4" and draft.speculative.num_speculative_tokens == 8


def test_generate_counts_tokens_and_the_profile_adds_up(tiny_model_factory: Callable[..., Path]) -> None:
    model = load_model(tiny_model_factory("llama", num_hidden_layers=2), dtype="float32")
    prompt = ([5, 9, 13, 17, 21, 25] * 6)[:32]  # repetitive: the n-gram lookup finds matches
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = generate(make_engine(model, BenchConfig("no speculation", None), 128), prompt, params, ())
    assert len(base.tokens) == 24 and base.decode_steps == 23 and base.num_drafts == 0

    engine = make_engine(model, BenchConfig.parse("ngram:k=4:n=1-4"), 128)
    profiler = StepProfiler(engine)
    step_seconds: list[float] = []
    end_step = profiler.end_step

    def record(seconds: float, decoding: bool) -> None:
        if decoding:
            step_seconds.append(seconds)
        end_step(seconds, decoding)

    profiler.end_step = record  # type: ignore[method-assign]
    run = generate(engine, prompt, params, (), profiler)
    profiler.remove()
    assert run.tokens == base.tokens  # float32: speculation changes nothing
    assert run.num_accepted > 0 and run.num_verify_steps > 0
    # every decode step emits one token of its own plus the drafts it accepted
    assert len(run.tokens) - 1 == run.decode_steps + run.num_accepted
    assert profiler.num_steps == run.decode_steps == len(step_seconds)
    assert sum(profiler.seconds.values()) == pytest.approx(sum(step_seconds))
    assert profiler.num_rows == run.decode_steps + run.num_drafts  # each step: its token + its drafts
    assert "forward" not in vars(model) and "execute" not in vars(engine.runner)  # unwrapped
