"""The serving benchmark's workloads: seeded, lengths in range with the expected statistics, Poisson
arrivals at the rate, and each workload's shape (a shared prefix; long prompts among short chats)."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from benchmarks.workloads import (
    WORKLOADS,
    MixedWorkload,
    ServingWorkload,
    SharedPrefixWorkload,
    TimedRequest,
    Workload,
    log_uniform_mean,
)

VOCAB = 49152
PRESETS = [pytest.param(w, id=f"{name}-{variant}") for name, p in WORKLOADS.items()
           for variant, w in (("full", p.full), ("quick", p.quick))]


def prompt_lens(requests: list[TimedRequest], kind: str | None = None) -> list[int]:
    return [len(r.prompt_token_ids) for r in requests if kind is None or r.kind == kind]


def output_lens(requests: list[TimedRequest], kind: str | None = None) -> list[int]:
    return [r.output_len for r in requests if kind is None or r.kind == kind]


def with_seed(workload: Workload, seed: int) -> Workload:
    import dataclasses

    return dataclasses.replace(workload, seed=seed)


# ---- every workload ------------------------------------------------------------------------------------


@pytest.mark.parametrize("workload", PRESETS)
def test_same_seed_same_requests_and_another_seed_others(workload: Workload) -> None:
    requests = workload.requests(VOCAB, 2.0)
    assert requests == with_seed(workload, 0).requests(VOCAB, 2.0)
    other = with_seed(workload, 1).requests(VOCAB, 2.0)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in requests]
    assert [r.arrival_s for r in other] != [r.arrival_s for r in requests]


@pytest.mark.parametrize("workload", PRESETS)
def test_requests_in_arrival_order_within_the_context_with_ordinary_ids(workload: Workload) -> None:
    requests = workload.requests(VOCAB, 2.0)
    assert len(requests) == workload.num_requests
    assert [r.index for r in requests] == list(range(workload.num_requests))
    # a later turn of a conversation leaves after its previous turn: its arrival is the conversation's start
    arrivals = [r.arrival_s for r in requests if r.follows is None]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert all(r.follows < r.index for r in requests if r.follows is not None)
    assert max(len(r.prompt_token_ids) + r.output_len for r in requests) <= workload.max_total_len
    ids = [t for r in requests for t in r.prompt_token_ids]
    assert min(ids) >= 100 and max(ids) < VOCAB


@pytest.mark.parametrize("workload", PRESETS)
def test_the_rate_scales_arrivals_and_keeps_the_order(workload: Workload) -> None:
    slow, fast, burst = (workload.requests(VOCAB, rate) for rate in (1.0, 4.0, math.inf))
    strip = [(r.prompt_token_ids, r.output_len, r.kind) for r in slow]
    assert [(r.prompt_token_ids, r.output_len, r.kind) for r in fast] == strip
    assert [(r.prompt_token_ids, r.output_len, r.kind) for r in burst] == strip  # the closed loop's order
    assert [r.arrival_s for r in fast] == pytest.approx([r.arrival_s / 4 for r in slow])
    assert [r.arrival_s for r in burst] == [0.0] * workload.num_requests


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_a_rate_that_is_not_positive_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="rate"):
        ServingWorkload(num_requests=3).requests(VOCAB, rate)


def test_registry_names_defaults_and_quick_variants() -> None:
    assert list(WORKLOADS) == ["serving", "shared-prefix", "mixed", "multi-turn"]
    for name, preset in WORKLOADS.items():
        assert preset.full.name == preset.quick.name == name
        assert 8 <= preset.quick.num_requests <= 12 < preset.full.num_requests
        assert preset.full.max_total_len <= 2048  # SmolLM2's context
        assert preset.quick.max_total_len <= 1024  # the tiny served test model's
    assert WORKLOADS["serving"].full == ServingWorkload(num_requests=48, prompt_len=(32, 512), output_len=(16, 128))
    assert WORKLOADS["mixed"].full.num_requests == 32


def test_tiny_vocabularies_keep_ordinary_ids() -> None:
    for workload in (ServingWorkload(num_requests=10, prompt_len=(4, 8), output_len=(1, 2)),
                     SharedPrefixWorkload(num_requests=4, prefix_len=8, question_len=(2, 4)),
                     MixedWorkload(num_requests=6, long_prompt_len=(20, 30))):
        ids = [t for r in workload.requests(128, 1.0) for t in r.prompt_token_ids]
        assert min(ids) >= 64 and max(ids) < 128


# ---- serving -------------------------------------------------------------------------------------------


def test_serving_lengths_within_bounds_reaching_both() -> None:
    requests = ServingWorkload(num_requests=300, seed=1).requests(VOCAB, 1.0)
    assert {r.kind for r in requests} == {"chat"}
    assert all(32 <= n <= 512 for n in prompt_lens(requests)) and all(16 <= n <= 128 for n in output_lens(requests))
    # The spread covers the whole range, not a middle band.
    assert min(prompt_lens(requests)) < 40 and max(prompt_lens(requests)) > 450


def test_serving_length_statistics_match_the_log_uniform_distribution() -> None:
    requests = ServingWorkload(num_requests=4000, seed=3).requests(1000, 1.0)
    prompts = prompt_lens(requests)
    # The exact means: sum_k k * ln((k+1)/k) / ln((high+1)/low) = 173.6 and 54.0.
    assert statistics.fmean(prompts) == pytest.approx(log_uniform_mean(32, 512), rel=0.05)
    assert statistics.fmean(output_lens(requests)) == pytest.approx(log_uniform_mean(16, 128), rel=0.05)
    # Skewed toward short: the median sits near the geometric mean, well below the arithmetic mean.
    assert statistics.median(prompts) == pytest.approx(math.sqrt(32 * 513), rel=0.06)
    assert statistics.median(prompts) < 0.85 * statistics.fmean(prompts)
    # The share below 128 tokens: P(n < 128) = ln(128 / 32) / ln(513 / 32) = 0.50.
    share_below_128 = sum(n < 128 for n in prompts) / len(prompts)
    assert share_below_128 == pytest.approx(math.log(128 / 32) / math.log(513 / 32), abs=0.03)


def test_log_uniform_mean_of_a_single_value_and_of_a_small_range() -> None:
    assert log_uniform_mean(64, 64) == pytest.approx(64)
    # P(1) = ln 2 / ln 3, P(2) = ln(3/2) / ln 3
    assert log_uniform_mean(1, 2) == pytest.approx((math.log(2) + 2 * math.log(1.5)) / math.log(3))


def test_serving_arrivals_are_poisson_at_the_rate() -> None:
    arrivals = [r.arrival_s for r in ServingWorkload(num_requests=4000, seed=5).requests(100, 4.0)]
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.1)
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: the deviation is the mean


def test_arrivals_and_ids_do_not_depend_on_the_length_ranges() -> None:
    a = ServingWorkload(num_requests=50, prompt_len=(32, 512), seed=2).requests(VOCAB, 1.0)
    b = ServingWorkload(num_requests=50, prompt_len=(8, 16), seed=2).requests(VOCAB, 1.0)
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]
    assert a[0].prompt_token_ids[:8] == b[0].prompt_token_ids[:8]


# ---- shared prefix -------------------------------------------------------------------------------------


def test_every_question_follows_the_same_prefix() -> None:
    workload = SharedPrefixWorkload(num_requests=200, seed=4)
    requests = workload.requests(VOCAB, 1.0)
    prefix = requests[0].prompt_token_ids[:768]
    assert all(r.prompt_token_ids[:768] == prefix and r.kind == "question" for r in requests)
    questions = [n - 768 for n in prompt_lens(requests)]
    assert all(16 <= n <= 64 for n in questions) and all(16 <= n <= 64 for n in output_lens(requests))
    assert len({r.prompt_token_ids[768:] for r in requests}) == len(requests)  # the questions differ
    assert SharedPrefixWorkload(seed=5).requests(VOCAB, 1.0)[0].prompt_token_ids[:768] != prefix


def test_shared_prefix_statistics() -> None:
    requests = SharedPrefixWorkload(num_requests=4000, prefix_len=32, seed=6).requests(1000, 2.0)
    assert statistics.fmean(prompt_lens(requests)) == pytest.approx(32 + log_uniform_mean(16, 64), rel=0.05)
    assert statistics.fmean(output_lens(requests)) == pytest.approx(log_uniform_mean(16, 64), rel=0.05)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(requests)]
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.1)


# ---- mixed ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_requests", "short", "long"), [(32, 26, 6), (12, 10, 2), (3, 2, 1), (4000, 3200, 800)])
def test_mixed_split_makes_both_streams_span_the_same_time(num_requests: int, short: int, long: int) -> None:
    workload = MixedWorkload(num_requests=num_requests, long_prompt_len=(64, 128))
    assert (workload.num_short, workload.num_long) == (short, long)
    requests = workload.requests(VOCAB, 1.0)
    assert [r.kind for r in requests].count("short") == short and [r.kind for r in requests].count("long") == long


def test_mixed_lengths_kinds_and_the_first_long_after_the_second_short() -> None:
    for seed in range(20):
        requests = MixedWorkload(seed=seed).requests(VOCAB, 1.0)
        shorts = [r for r in requests if r.kind == "short"]
        longs = [r for r in requests if r.kind == "long"]
        assert len(shorts) + len(longs) == 32 and shorts[0].index == 0 and shorts[1].index == 1
        assert min(r.arrival_s for r in longs) >= shorts[1].arrival_s
        assert all(1024 <= n <= 1536 for n in prompt_lens(longs)) and all(8 <= n <= 16 for n in output_lens(longs))
        assert all(32 <= n <= 128 for n in prompt_lens(shorts)) and all(64 <= n <= 128 for n in output_lens(shorts))
        assert max(len(r.prompt_token_ids) + r.output_len for r in requests) < 2048


def test_mixed_statistics_long_prompts_at_a_quarter_of_the_rate() -> None:
    requests = MixedWorkload(num_requests=4000, seed=7).requests(1000, 2.0)
    assert statistics.fmean(prompt_lens(requests, "long")) == pytest.approx(log_uniform_mean(1024, 1536), rel=0.05)
    assert statistics.fmean(output_lens(requests, "short")) == pytest.approx(log_uniform_mean(64, 128), rel=0.05)
    for kind, mean_gap in (("short", 0.5), ("long", 2.0)):  # 2 requests/s, the longs at 1/4 of it
        arrivals = [r.arrival_s for r in requests if r.kind == kind]
        assert statistics.fmean(b - a for a, b in itertools.pairwise(arrivals)) == pytest.approx(mean_gap, rel=0.1)


# ---- validation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "kwargs"), [
    (ServingWorkload, {"num_requests": 0}),
    (ServingWorkload, {"prompt_len": (0, 10)}),
    (ServingWorkload, {"output_len": (20, 10)}),
    (SharedPrefixWorkload, {"prefix_len": 0}),
    (SharedPrefixWorkload, {"question_len": (8, 4)}),
    (MixedWorkload, {"num_requests": 2}),
    (MixedWorkload, {"long_prompt_len": (0, 4)}),
    (MixedWorkload, {"short_output_len": (9, 8)}),
    (MixedWorkload, {"long_rate_fraction": 0.0}),
    (MixedWorkload, {"long_rate_fraction": 1.5}),
])
def test_bad_parameters_are_refused_naming_the_field(cls: type, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        cls(**kwargs)


def test_multi_turn_conversations_follow_their_previous_turns() -> None:
    from benchmarks.workloads import MultiTurnWorkload

    workload = MultiTurnWorkload(num_conversations=3, turns=4, system_len=10, message_len=(2, 5), output_len=(1, 3),
                                 think_s=0.5, seed=1)
    requests = workload.requests(vocab_size=1000, rate=2.0)
    assert len(requests) == workload.num_requests == 12 and [r.index for r in requests] == list(range(12))
    assert [r.kind for r in requests] == ["turn 1"] * 3 + ["turn 2"] * 3 + ["turns 3+"] * 6
    first = requests[:3]
    assert all(r.follows is None and r.think_s == 0 for r in first)
    assert len({r.prompt_token_ids[:10] for r in first}) == 1  # one shared system prompt
    assert [r.arrival_s for r in first] == sorted(r.arrival_s for r in first) and first[0].arrival_s == 0
    for r in requests[3:]:
        assert r.follows == r.index - 3 and r.think_s > 0 and 2 <= len(r.prompt_token_ids) <= 5  # the message
        assert r.arrival_s == requests[r.index % 3].arrival_s  # a conversation starts once
    assert workload.max_total_len == 10 + 4 * (5 + 3)
    assert workload.requests(1000, 2.0) == requests  # seeded
    with pytest.raises(ValueError, match=r"turns must be >= 1, got 0"):
        MultiTurnWorkload(turns=0)
