"""The offline benchmark's core runs on a tiny model and counts every token; no timing is asserted."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.bench_offline import EngineSetting, Workload, main, run_hf, run_tandem
from benchmarks.step_timer import NON_MATMUL_PARTS, print_profile

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


def test_single_request_profile_is_batch_one(tiny_model_factory: Callable[..., Path],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # The batch-1 profile: one request alone, every decode step after its prefill counted.
    alone = Workload(num_prompts=1, prompt_len=8, output_len=6)
    result, profile = run_tandem(tiny_model_factory(), "float32", alone, EngineSetting(64, None))
    assert result.output_tokens == 6
    assert (profile.batch, profile.num_steps) == (1, 5)
    parts = dict(profile.breakdown())
    outside = sum(parts[name] for name in NON_MATMUL_PARTS)
    assert profile.non_matmul_share == pytest.approx(outside / profile.seconds_per_step)
    assert 0 < profile.non_matmul_share < 1
    print_profile("tiny, one request (batch 1)", profile)
    out = capsys.readouterr().out
    assert "## Where a decode step goes — tiny, one request (batch 1)" in out
    assert "5 steps decoding the one request" in out
    assert f"**{100 * profile.non_matmul_share:.0f}%** of the step" in out
    assert sum(1 for line in out.splitlines() if line.startswith("| model:")) == 3


def test_main_writes_both_profiles(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    main(["--model", str(tiny_model_factory()), "--dtypes", "float32", "--num-prompts", "3", "--prompt-len", "8",
          "--output-len", "4", "--settings", "64:0", "--skip-hf", "--threads", "1", "--json", str(out)])
    profiles = json.loads(out.read_text())["profiles"]
    assert sorted(profiles) == ["batch 1", "float32"]
    assert (profiles["float32"]["batch"], profiles["batch 1"]["batch"]) == (3, 1)
    assert 0 < profiles["batch 1"]["non_matmul_share"] < 1
