"""Goodput and SLO attainment (DistServe's definition) with exact expectations: the math, the `--goodput` flag,
the benchmark's tables and JSON, the suite report's rows, and a system that fails to start; no service runs."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import bench_serve
from benchmarks.bench_serve import SYSTEMS, add_arguments, bench_system, configure_workload, results_json, slo_of
from benchmarks.report import serving_lines
from benchmarks.serve_client import Api, RequestRecord
from benchmarks.serve_stats import (
    Summary,
    capacities,
    capacity,
    capacity_table,
    markdown_table,
    not_started,
    summarize,
)
from benchmarks.slo import SLO, Attainment, parse_slo
from benchmarks.workloads import WORKLOADS

SLO_1S = SLO(ttft_s=1.0, tpot_s=0.25)


def records() -> list[RequestRecord]:
    return [
        # TTFT 0.5, TPOT (1.0 - 0.5) / 2 = 0.25: both met, exactly at the TPOT bound (<= counts).
        RequestRecord(0, "short", 10, 3, sent=0.0, first=0.5, last=1.0, num_tokens=3, num_messages=3),
        RequestRecord(1, "long", 20, 4, sent=0.1, error="UNAVAILABLE: down"),  # failed: misses both
        # TTFT 2.0 misses; TPOT 0.2 meets.
        RequestRecord(2, "long", 30, 2, sent=1.0, first=3.0, last=3.2, num_tokens=2, num_messages=2),
        # One token: no TPOT, so that half is met by definition; TTFT 0.125 meets.
        RequestRecord(3, "short", 5, 1, sent=2.0, first=2.125, last=2.125, num_tokens=1, num_messages=1),
        # TTFT 0.25 meets; TPOT (2.25 - 0.25) / 4 = 0.5 misses.
        RequestRecord(4, "short", 8, 5, sent=0.0, first=0.25, last=2.25, num_tokens=5, num_messages=5),
    ]


def test_attainment_counts_each_slo_and_both_over_every_request_sent() -> None:
    a = Attainment.of(SLO_1S, [(0.5, 0.25), None, (2.0, 0.2), (0.125, None), (0.25, 0.5)], duration_s=4.0)
    assert (a.num_requests, a.met_both, a.met_ttft, a.met_tpot) == (5, 2, 3, 3)
    assert (a.both, a.ttft, a.tpot) == (0.4, 0.6, 0.6)
    assert a.goodput == 0.5  # 2 requests meeting both / 4 s
    empty = Attainment.of(SLO_1S, [], duration_s=0.0)
    assert (empty.goodput, empty.both, empty.ttft, empty.tpot) == (0.0, 0.0, 0.0, 0.0)


def test_summary_judges_client_records_by_the_slo() -> None:
    s = summarize("x", "here", records(), duration_s=4.0, slo=SLO_1S)
    assert s.slo == Attainment(SLO_1S, num_requests=5, met_both=2, met_ttft=3, met_tpot=3, duration_s=4.0)
    table = markdown_table([s, summarize("y", "there", records(), duration_s=8.0, slo=SLO(3.0, 1.0))])
    assert "| goodput (requests/s meeting both SLOs) | 0.500 | 0.500 |" in table  # y: 4 of 5 in 8 s
    assert "| SLO attainment, both (%) | 40 | 80 |" in table
    assert "| SLO attainment, TTFT (%) | 60 | 80 |" in table
    assert "| SLO attainment, TPOT (%) | 60 | 80 |" in table
    assert summarize("z", "here", records(), 4.0).slo is None
    assert "goodput" not in markdown_table([summarize("z", "here", records(), 4.0)])


def test_slo_flag_parses_milliseconds_in_either_order() -> None:
    assert parse_slo("ttft:2000,tpot:150") == SLO(2.0, 0.15)
    assert parse_slo(" tpot:150 , ttft:2500") == SLO(2.5, 0.15)
    assert SLO(2.5, 0.2).flag == "ttft:2500,tpot:200" and parse_slo(SLO(2.5, 0.2).flag) == SLO(2.5, 0.2)
    for bad in ("ttft:2000", "ttft:x,tpot:1", "ttft:0,tpot:1", "foo:1,tpot:2", "ttft:1,ttft:2", "ttft=1,tpot=2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_slo(bad)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_each_workload_has_a_default_slo_and_goodput_overrides_it() -> None:
    assert {name: p.slo for name, p in WORKLOADS.items()} == {
        "serving": SLO(2.5, 0.2), "shared-prefix": SLO(1.5, 0.2), "mixed": SLO(4.0, 0.2),
        "multi-turn": SLO(2.5, 0.2)}
    assert slo_of(parse("--workload", "mixed")) == SLO(4.0, 0.2)
    assert slo_of(parse("--workload", "mixed", "--goodput", "ttft:800,tpot:90")) == SLO(0.8, 0.09)


def test_the_conditional_system_passes_its_threshold_to_the_gateway() -> None:
    assert parse().local_prefill_max_tokens == 256
    assert SYSTEMS["conditional"].gateway_args(256) == ("--local-prefill-max-tokens", "256")
    assert SYSTEMS["conditional"].disaggregated and SYSTEMS["conditional"].prefix_caching
    # The gateway's own default is conditional: the disaggregated system turns it off explicitly.
    assert SYSTEMS["disaggregated"].gateway_args(256) == ("--local-prefill-max-tokens", "0")


def test_a_system_that_fails_to_start_is_reported_and_the_json_and_report_carry_goodput(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def broken(system: bench_serve.System, *args: object, **kwargs: object) -> Iterator[tuple[list[str], str]]:
        seen.append((system.name, args[-3]))  # type: ignore[arg-type]
        assert kwargs == {"cpu_lending": True}  # as tandem up lays the nodes out
        raise RuntimeError("gateway exited with code 2 during start-up")
        yield [], ""

    monkeypatch.setattr(bench_serve, "deployment", broken)
    args = parse("--workload", "mixed", "--quick", "--cpus", "0-1", "--local-prefill-max-tokens", "128")
    args.rate = 1.0
    workload = configure_workload(args)
    [(summary, recs)] = bench_system(SYSTEMS["conditional"], args, workload, 1000, (), tmp_path, SLO_1S)
    assert seen == [("conditional", 128)] and recs == []
    assert (summary.started, summary.completed, summary.failed) == (False, 0, 12)
    assert summary.errors == ("failed to start: gateway exited with code 2 during start-up",)
    assert summary.slo == Attainment(SLO_1S, 12, 0, 0, 0, 0.0)
    assert "| completed / failed | failed to start (12) |" in markdown_table([summary])
    assert not_started("c", 3, "boom").slo is None

    measured = summarize("disaggregated", "gateway [unpinned]", records(), 4.0, SLO_1S)
    document = json.loads(json.dumps(results_json([(measured, records()), (summary, [])], workload, args, "tiny",
                                                  "float32")))
    assert document["slo"] == {"ttft_s": 4.0, "tpot_s": 0.2} and document["local_prefill_max_tokens"] == 128
    first, second = document["systems"]
    assert first["goodput"] == 0.5 and first["started"] and first["slo"]["met_both"] == 2
    assert second["goodput"] == 0.0 and not second["started"]
    text = "\n".join(serving_lines(document))
    assert "TTFT <= 4000 ms, TPOT <= 200 ms" in text
    assert "| completed / failed | 4 / 1 | failed to start (12) |" in text
    assert "| goodput (requests/s meeting both SLOs) | 0.500 | 0.000 |" in text
    assert "| SLO attainment, both (%) | 40 | 0 |" in text
    assert "| SLO attainment, TPOT (%) | 60 | 0 |" in text


def sweep_summary(system: str, rate: float, met: int, of: int = 10) -> Summary:
    summary = not_started(system, of, "unused", SLO(1.0, 0.1))
    return dataclasses.replace(summary, rate=rate, slo=Attainment(SLO(1.0, 0.1), of, met, met, met, 10.0))


def test_a_rate_sweep_reports_each_systems_highest_rate_meeting_90_percent() -> None:
    runs = [sweep_summary("a @ 1/s", 1.0, 10), sweep_summary("a @ 2/s", 2.0, 9), sweep_summary("a @ 4/s", 4.0, 8),
            sweep_summary("b @ 1/s", 1.0, 8), sweep_summary("b @ 2/s", 2.0, 10), sweep_summary("b @ 4/s", 4.0, 10)]
    assert capacity(runs[:3]) == 2.0  # 100%, 90%, then 80% ends it
    assert capacity(runs[3:]) is None  # the lowest rate misses: higher ones that pass do not count
    assert capacities(runs) == {"a": 2.0, "b": None}
    assert capacities(runs[:1]) == {}  # one rate: no sweep
    table = capacity_table(runs, capacities(runs))
    # Goodput: requests meeting both SLOs over the 10 s run.
    assert "| a | 1.000 (100%) | 0.900 (90%) | 0.800 (80%) | 2 requests/s |" in table
    assert "| b | 0.800 (80%) | 1.000 (100%) | 1.000 (100%) | none of these |" in table


def test_rate_flag_takes_one_rate_or_an_increasing_list() -> None:
    assert parse("--rate", "1,2.5,4").rate == (1.0, 2.5, 4.0)
    assert bench_serve.rates_of(parse("--rate", "3")) == (3.0,)
    assert bench_serve.column_name("conditional", Api.GRPC, 2.5, by_api=False, by_rate=True) == "conditional @ 2.5/s"
    for bad in ("2,1", "1,1", "0", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_serve.parse_rates(bad)
