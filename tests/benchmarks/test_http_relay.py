"""The relay benchmark on a tiny model: both fronts stream every token (no speed is asserted), and the
serving benchmark's --api list."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks.bench_http_relay import bench, report, rows_json
from benchmarks.bench_serve import parse_apis
from benchmarks.report import http_relay_lines
from benchmarks.serve_client import Api
from tandem_cli.launcher import ColocatedTopology


def test_both_fronts_relay_every_token(tiny_served_model_dir: Path, tmp_path: Path) -> None:
    rows = bench(tiny_served_model_dir, streams=3, tokens=20, requests=5, log_dir=tmp_path)
    assert [(r.api, r.tokens) for r in rows] == [("openai", 100), ("grpc", 100)]
    assert all(r.seconds > 0 and r.gateway_cpu_s >= 0 for r in rows)
    assert "| OpenAI HTTP (SSE) | 3 | 20 | 100 |" in report(rows)
    lines = http_relay_lines(rows_json(rows))
    assert any(line.startswith("| gRPC | 3 | 20 |") for line in lines)


def test_api_lists() -> None:
    assert parse_apis("grpc,openai") == (Api.GRPC, Api.OPENAI)
    assert parse_apis("openai") == (Api.OPENAI,)
    for bad in ("", "grpc,grpc", "rest"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_apis(bad)


def test_colocated_replicas_serve_http_on_their_own_ports() -> None:
    specs = ColocatedTopology(replicas=2, free_ports=True, serve_http=True).nodes()
    ports = [s.http_port for s in specs]
    assert all(ports) and len({*ports, *(s.port for s in specs)}) == 4
    assert all(s.args[-2:] == ("--http-port", str(s.http_port)) for s in specs)
    assert all(s.http_port is None for s in ColocatedTopology(replicas=2, free_ports=True).nodes())


def test_each_front_gets_the_workload_with_shifted_token_ids() -> None:
    from benchmarks.bench_serve import shifted
    from benchmarks.workloads import SharedPrefixWorkload

    requests = SharedPrefixWorkload(num_requests=4, prefix_len=32, seed=3).requests(1000, 2.0)
    assert shifted(requests, 0, 1000) == requests
    second = shifted(requests, 1, 1000)
    assert [(r.index, len(r.prompt_token_ids), r.output_len, r.arrival_s) for r in second] == [
        (r.index, len(r.prompt_token_ids), r.output_len, r.arrival_s) for r in requests]
    assert all(100 <= t < 1000 for r in second for t in r.prompt_token_ids)
    assert all(a != b for r, s in zip(requests, second, strict=True) for a, b in zip(r.prompt_token_ids,
                                                                                     s.prompt_token_ids, strict=True))
    assert len({r.prompt_token_ids[:32] for r in second}) == 1  # the shared prefix is still shared
