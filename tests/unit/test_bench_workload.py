"""The serving benchmark's workload generator: seeded, lengths in range with the expected statistics."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from benchmarks.bench_serve import Distribution, RequestRecord, markdown_table, summarize
from benchmarks.serve_workload import Workload, log_uniform_mean

VOCAB = 49152


def test_same_seed_same_requests_and_arrivals() -> None:
    a, b = Workload(num_requests=20, seed=7), Workload(num_requests=20, seed=7)
    assert a.requests(VOCAB) == b.requests(VOCAB)
    assert a.arrival_offsets(2.0) == b.arrival_offsets(2.0)
    other = Workload(num_requests=20, seed=8)
    assert other.requests(VOCAB) != a.requests(VOCAB)
    assert other.arrival_offsets(2.0) != a.arrival_offsets(2.0)


def test_lengths_within_bounds_and_token_ids_ordinary() -> None:
    requests = Workload(num_requests=300, prompt_len=(32, 512), output_len=(16, 128), seed=1).requests(VOCAB)
    assert [r.index for r in requests] == list(range(300))
    assert all(32 <= len(r.prompt_token_ids) <= 512 for r in requests)
    assert all(16 <= r.output_len <= 128 for r in requests)
    ids = [t for r in requests for t in r.prompt_token_ids]
    assert min(ids) >= 100 and max(ids) < VOCAB
    # Both bounds are reachable: the spread covers the whole range, not a middle band.
    assert min(len(r.prompt_token_ids) for r in requests) < 40 and max(len(r.prompt_token_ids) for r in requests) > 450


def test_length_statistics_match_the_log_uniform_distribution() -> None:
    requests = Workload(num_requests=4000, prompt_len=(32, 512), output_len=(16, 128), seed=3).requests(1000)
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    output_lens = [r.output_len for r in requests]
    # The exact means: sum_k k * ln((k+1)/k) / ln((high+1)/low) = 173.6 and 54.0.
    assert statistics.fmean(prompt_lens) == pytest.approx(log_uniform_mean(32, 512), rel=0.03)
    assert statistics.fmean(output_lens) == pytest.approx(log_uniform_mean(16, 128), rel=0.03)
    # Skewed toward short: the median sits near the geometric mean, well below the arithmetic mean.
    assert statistics.median(prompt_lens) == pytest.approx(math.sqrt(32 * 513), rel=0.06)
    assert statistics.median(prompt_lens) < 0.85 * statistics.fmean(prompt_lens)
    # The share below 128 tokens: P(n < 128) = ln(128 / 32) / ln(513 / 32) = 0.50.
    share_below_128 = sum(n < 128 for n in prompt_lens) / len(prompt_lens)
    assert share_below_128 == pytest.approx(math.log(128 / 32) / math.log(513 / 32), abs=0.03)


def test_log_uniform_mean_of_a_single_value_and_of_a_small_range() -> None:
    assert log_uniform_mean(64, 64) == pytest.approx(64)
    # P(1) = ln 2 / ln 3, P(2) = ln(3/2) / ln 3
    assert log_uniform_mean(1, 2) == pytest.approx((math.log(2) + 2 * math.log(1.5)) / math.log(3))


def test_tiny_vocabularies_keep_ordinary_ids() -> None:
    requests = Workload(num_requests=10, prompt_len=(4, 8), output_len=(1, 2)).requests(128)
    ids = [t for r in requests for t in r.prompt_token_ids]
    assert min(ids) >= 64 and max(ids) < 128


def test_poisson_arrivals_have_the_rate_and_start_at_zero() -> None:
    offsets = Workload(num_requests=4000, seed=5).arrival_offsets(rate=4.0)
    assert offsets[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.08)
    assert Workload(num_requests=5).arrival_offsets(math.inf) == [0.0] * 5


def test_arrivals_do_not_depend_on_the_length_ranges() -> None:
    a = Workload(num_requests=50, prompt_len=(32, 512), seed=2).arrival_offsets(1.0)
    b = Workload(num_requests=50, prompt_len=(8, 16), seed=2).arrival_offsets(1.0)
    assert a == b


@pytest.mark.parametrize("kwargs", [{"num_requests": 0}, {"prompt_len": (0, 10)}, {"output_len": (20, 10)}])
def test_bad_workloads_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Workload(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Workload().arrival_offsets(0.0)


def test_summary_of_client_records() -> None:
    # Request 0: sent at 0, tokens at 0.5, 0.6, 0.8 (3 messages, 4 tokens); request 1 failed.
    ok = RequestRecord(0, prompt_len=10, expected_tokens=4, sent=0.0, first=0.5, last=0.8, num_tokens=4,
                       num_messages=3, gaps=[0.1, 0.2], queue_s=0.05, kv_transfer_s=0.02)
    failed = RequestRecord(1, prompt_len=20, expected_tokens=4, sent=0.1, error="UNAVAILABLE: down")
    s = summarize("x", "here", [ok, failed], duration_s=2.0)
    assert (s.completed, s.failed, s.wrong_length) == (1, 1, 0)
    assert (s.input_tokens, s.output_tokens) == (10, 4)
    assert s.ttft_s == Distribution(0.5, 0.5, 0.5, 0.5)
    assert s.tpot_s is not None and s.tpot_s.mean == pytest.approx(0.1)  # (0.8 - 0.5) / 3
    assert s.itl_s is not None and s.itl_s.mean == pytest.approx(0.15)
    assert s.request_throughput == 0.5 and s.output_throughput == 2.0
    assert s.tokens_per_message == pytest.approx(4 / 3)
    assert s.queue_s == Distribution(0.05, 0.05, 0.05, 0.05) and s.kv_transfer_s is not None
    assert s.errors == ("UNAVAILABLE: down",)
    table = markdown_table([s, s])
    assert "| metric | x | x |" in table and "| TTFT p50 (ms) | 500 | 500 |" in table
    assert "| server queue p99 (ms) | 50.0 | 50.0 |" in table
