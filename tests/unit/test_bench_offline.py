"""The offline benchmark's core runs on a tiny model and counts every token; no timing is asserted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.bench_offline import EngineSetting, Workload, run_hf, run_tandem

WORKLOAD = Workload(num_prompts=4, prompt_len=8, output_len=4)


def test_workload_is_seeded_and_in_range() -> None:
    prompts = WORKLOAD.prompts(vocab_size=128)
    assert prompts == WORKLOAD.prompts(vocab_size=128)
    assert [len(p) for p in prompts] == [8] * 4
    assert all(64 <= t < 128 for p in prompts for t in p)
    assert WORKLOAD.total_output_tokens == 16


@pytest.mark.parametrize("setting", [EngineSetting(16, 8), EngineSetting(64, None)])
def test_tandem_produces_every_token(tiny_model_factory: Callable[..., Path], setting: EngineSetting) -> None:
    result, profile = run_tandem(tiny_model_factory(), "float32", WORKLOAD, setting)
    assert (result.system, result.dtype, result.output_tokens) == ("Tandem", "float32", 16)
    assert result.first_tokens_s is not None and result.first_tokens_s <= result.seconds
    assert result.tokens_at_first >= 4
    # Every request decodes together after the prefill: 3 more tokens each, in full-batch steps.
    assert profile.batch == 4 and profile.num_steps >= 1
    # The parts of a step add up to the step.
    per_step = profile.seconds["step"] / profile.num_steps
    assert sum(seconds for _, seconds in profile.breakdown()) == pytest.approx(per_step)
    # The forward is split into its linear layers, attention and the rest (norms, rotary, ...).
    assert profile.seconds["matmul"] > 0 and profile.seconds["attention"] > 0
    assert profile.seconds["matmul"] + profile.seconds["attention"] < profile.seconds["model"]


def test_hf_baseline_counts_tokens(tiny_model_factory: Callable[..., Path]) -> None:
    result = run_hf(tiny_model_factory(), "float32", WORKLOAD, batch_size=2)
    assert (result.system, result.output_tokens, result.note) == ("HF generate", 16, "")
    # A budget of zero stops after the first batch and says so.
    partial = run_hf(tiny_model_factory(), "float32", WORKLOAD, batch_size=2, budget_s=0.0)
    assert partial.output_tokens == 8
    assert "1 of 2 batches" in partial.note
