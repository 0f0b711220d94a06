"""Traces, metrics and logs of the real system: gateway, prefill and decode as processes on 127.0.0.1.

One deployment serves a few requests while a real OTLP collector (tests/observability/collector.py) listens.
The batch span processor is told to wait 60 s before exporting, so every span seen here was flushed by the
services' graceful shutdown (SIGTERM), which is itself under test.
"""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.telemetry import spans as S
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tandem_cli.launcher import Launcher, Topology
from tests.observability.collector import CollectedSpan, Collector, trace_tree

pytestmark = pytest.mark.e2e

TRACED_ID = "trace-me-0001"
MAX_TOKENS = 12
CHUNK = 16  # --max-prefill-chunk: the traced 40-token prompt takes 3 chunks
TRACED_PROMPT = [(7 * i + 11) % 4000 + 20 for i in range(40)]
OTHER_PROMPTS = [TRACED_PROMPT[:32] + [900, 901, 902],  # shares two full blocks with the traced prompt
                 [30 + i for i in range(20)], [500 + 3 * i for i in range(9)], [42] * 25]
N_OK = 1 + len(OTHER_PROMPTS)
SERVICES = {"gateway": "test-gateway", "prefill": "test-prefill", "decode": "test-decode"}
TREE_KEYS = (S.REQUEST_ID, S.PROMPT_TOKENS, S.COMPLETION_TOKENS, S.CACHED_TOKENS, S.CHUNK_START, S.CHUNK_TOKENS,
             S.KV_BYTES, S.KV_BLOCKS, S.KV_GBPS, S.NUM_STEPS, S.PREEMPTIONS, S.SPEC_ACCEPTANCE)


@dataclass
class Observed:
    spans: list[CollectedSpan]
    metrics: dict[str, dict[str, Any]]  # role -> family name -> Metric
    replies: list[generate_pb2.GenerateResponse]  # last message of each successful request
    logs: dict[str, list[dict[str, Any]]]  # role -> JSON log records


def _request(ids: list[int], request_id: str = "") -> generate_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return generate_pb2.GenerateRequest(request_id=request_id, token_ids=generate_pb2.TokenIds(ids=ids),
                                        sampling=params)


def _scrape(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _json_lines(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    return records


@pytest.fixture(scope="module")
def observed(tiny_served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    collector = Collector().start()
    log_dir = tmp_path_factory.mktemp("telemetry-logs")
    topology = Topology(
        num_prefill=1, num_decode=1, free_ports=True, metrics_base_port=0,
        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
        node_args=("--num-blocks", "256", "--kv-timeout-s", "20", "--grace-s", "1",
                   "--max-prefill-chunk", str(CHUNK)),
        decode_args=("--speculative", "ngram", "--num-speculative-tokens", "3"),
        gateway_args=("--local-prefill-max-tokens", "0", "--stats-interval-s", "0.3", "--shutdown-grace-s", "1"),
    )
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "60000",
           "TANDEM_LOG_FORMAT": "json"}
    role_env = {role: {"OTEL_SERVICE_NAME": name} for role, name in SERVICES.items()}
    replies = []
    try:
        with Launcher(topology, log_dir=log_dir, env=env, role_env=role_env) as launcher:
            with grpc.insecure_channel(launcher.gateway.target) as channel:
                stub = generate_pb2_grpc.TandemStub(channel)
                for i, ids in enumerate([TRACED_PROMPT, *OTHER_PROMPTS]):
                    replies.append(list(stub.Generate(_request(ids, TRACED_ID if i == 0 else ""), timeout=60))[-1])
                with pytest.raises(grpc.RpcError) as bad:  # one failure: INVALID_ARGUMENT at the gateway
                    list(stub.Generate(_request([5] * 2000, "too-long"), timeout=60))
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            metrics = {spec.role: _scrape(spec.metrics_port) for spec in launcher.specs if spec.metrics_port}
        # Leaving the launcher sent SIGTERM and waited for every process: their spans were flushed on the way out.
        spans = collector.spans
    finally:
        collector.stop()
    logs = {role: _json_lines(log_dir / f"{name}.log")
            for role, name in (("gateway", "gateway"), ("prefill", "prefill-0"), ("decode", "decode-0"))}
    yield Observed(spans, metrics, replies, logs)


def _traced(observed: Observed) -> list[CollectedSpan]:
    roots = [s for s in observed.spans if s.name == S.GENERATE and s.attributes.get(S.REQUEST_ID) == TRACED_ID]
    assert len(roots) == 1, f"{len(roots)} root spans for {TRACED_ID}"
    return [s for s in observed.spans if s.trace_id == roots[0].trace_id]


def _one(spans: list[CollectedSpan], name: str) -> CollectedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name}: {[s.name for s in spans]}"
    return found[0]


def test_one_trace_spans_all_three_services(observed: Observed) -> None:
    spans = _traced(observed)
    print("\n" + trace_tree(spans, TREE_KEYS))
    assert {s.service for s in spans} == set(SERVICES.values())
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_span_id is None]
    assert [r.name for r in roots] == [S.GENERATE]
    assert all(s.parent_span_id in ids for s in spans if s is not roots[0])  # nothing dangles


def test_parent_links(observed: Observed) -> None:
    spans = _traced(observed)
    by_id = {s.span_id: s for s in spans}

    def parent(name: str) -> str:
        span = _one(spans, name)
        assert span.parent_span_id is not None
        return by_id[span.parent_span_id].name

    expected = {S.PREFILL: S.GENERATE, S.DECODE: S.GENERATE, S.PREFILL_QUEUE: S.PREFILL, S.KV_SEND: S.PREFILL,
                S.KV_RECEIVE: S.KV_SEND, S.DECODE_RESERVE: S.DECODE, S.DECODE_WAIT_KV: S.DECODE,
                S.DECODE_STREAM: S.DECODE}
    assert {name: parent(name) for name in expected} == expected
    chunks = [s for s in spans if s.name == S.PREFILL_CHUNK]
    assert len(chunks) == math.ceil(len(TRACED_PROMPT) / CHUNK)
    assert {by_id[c.parent_span_id].name for c in chunks if c.parent_span_id} == {S.PREFILL}
    # The receive span hangs off the sender (KV control messages) and links to the decode node's wait.
    receive, wait = _one(spans, S.KV_RECEIVE), _one(spans, S.DECODE_WAIT_KV)
    assert receive.service == SERVICES["decode"] and (wait.trace_id, wait.span_id) in receive.links
    kinds = {s.name: s.kind for s in spans}
    assert (kinds[S.GENERATE], kinds[S.PREFILL], kinds[S.DECODE]) == ("SERVER", "SERVER", "SERVER")
    assert (kinds[S.KV_SEND], kinds[S.KV_RECEIVE]) == ("PRODUCER", "CONSUMER")


def test_span_attributes(observed: Observed) -> None:
    spans = _traced(observed)
    root = _one(spans, S.GENERATE)
    a = root.attributes
    assert a[S.REQUEST_ID] == TRACED_ID and a[S.MODEL]
    assert (a[S.PROMPT_TOKENS], a[S.COMPLETION_TOKENS], a[S.CACHED_TOKENS]) == (len(TRACED_PROMPT), MAX_TOKENS, 0)
    assert a[S.FINISH_REASONS] == ["length"] and a[S.STATUS] == "OK" and a[S.STATUS_CODE] == 0
    assert a[S.PREFILL_NODE] == "prefill-0" and a[S.DECODE_NODE] == "decode-0"
    assert {"reserved", "first_token"} <= set(root.events)

    prefill = _one(spans, S.PREFILL).attributes
    assert prefill[S.REQUEST_ID] == TRACED_ID and prefill[S.CACHED_TOKENS] == 0 and prefill[S.QUEUE_S] >= 0
    chunks = sorted((s for s in spans if s.name == S.PREFILL_CHUNK), key=lambda s: s.attributes[S.CHUNK_START])
    assert [c.attributes[S.CHUNK_START] for c in chunks] == [0, 16, 32]
    assert [c.attributes[S.CHUNK_TOKENS] for c in chunks] == [16, 16, 8]
    assert all(c.start_ns <= c.end_ns for c in chunks) and chunks[0].end_ns <= chunks[-1].start_ns

    send, receive = _one(spans, S.KV_SEND).attributes, _one(spans, S.KV_RECEIVE).attributes
    blocks = math.ceil(len(TRACED_PROMPT) / 16)
    assert send[S.KV_BYTES] > 0 and send[S.KV_BLOCKS] == blocks and send[S.KV_GBPS] > 0 and send[S.KV_SECONDS] > 0
    assert receive[S.KV_BYTES] == send[S.KV_BYTES] and receive[S.KV_BLOCKS] == blocks
    assert send[S.TRANSFER_ID] == receive[S.TRANSFER_ID]

    reserve = _one(spans, S.DECODE_RESERVE).attributes
    assert reserve[S.RESERVED_BLOCKS] == blocks and reserve[S.CACHED_TOKENS] == 0
    stream = _one(spans, S.DECODE_STREAM).attributes
    assert 1 <= stream[S.NUM_STEPS] <= MAX_TOKENS - 1 and stream[S.COMPLETION_TOKENS] == MAX_TOKENS
    assert stream[S.PREEMPTIONS] == 0
    if S.SPEC_DRAFT_TOKENS in stream:  # n-gram speculation proposed something for this request
        assert 0 <= stream[S.SPEC_ACCEPTED_TOKENS] <= stream[S.SPEC_DRAFT_TOKENS]
        assert 0 <= stream[S.SPEC_ACCEPTANCE] <= 1


def test_every_request_is_one_trace_and_failures_carry_their_status(observed: Observed) -> None:
    roots = [s for s in observed.spans if s.name == S.GENERATE]
    ok = [r for r in roots if r.attributes.get(S.STATUS) == "OK"]
    assert len(ok) == N_OK and len({r.trace_id for r in ok}) == N_OK
    for root in ok:
        names = {s.name for s in observed.spans if s.trace_id == root.trace_id}
        assert {S.PREFILL, S.KV_SEND, S.KV_RECEIVE, S.DECODE, S.DECODE_STREAM} <= names
    failed = [r for r in roots if r.attributes.get(S.STATUS) != "OK"]
    assert len(failed) == 1
    # A caller's mistake: not a server error by OpenTelemetry's gRPC conventions, but the code is on the span.
    assert failed[0].status_code == 0 and failed[0].attributes[S.STATUS] == "INVALID_ARGUMENT"
    assert failed[0].attributes[S.STATUS_CODE] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "exception" in failed[0].events


def _value(families: dict[str, Any], name: str, sample: str | None = None, **labels: str) -> float:
    family = families[name]
    sample = sample or name
    values = [s.value for s in family.samples
              if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(values) == 1, f"{sample}{labels}: {values}"
    return float(values[0])


def _count(families: dict[str, Any], name: str, node: str) -> float:
    return _value(families, name, name + "_count", node=node)


def test_gateway_metrics(observed: Observed) -> None:
    m = observed.metrics["gateway"]
    for name in ("tandem:time_to_first_token_seconds", "tandem:e2e_request_latency_seconds",
                 "tandem:request_queue_time_seconds", "tandem:request_time_per_output_token_seconds"):
        assert _count(m, name, "gateway") == N_OK, name
    assert _value(m, "tandem:request_success", "tandem:request_success_total", node="gateway",
                  finish_reason="length") == N_OK
    assert _value(m, "tandem:request_failure", "tandem:request_failure_total", node="gateway",
                  code="INVALID_ARGUMENT") == 1
    assert _value(m, "tandem:generation_tokens", "tandem:generation_tokens_total", node="gateway") == N_OK * MAX_TOKENS
    prompts = len(TRACED_PROMPT) + sum(len(p) for p in OTHER_PROMPTS)
    assert _value(m, "tandem:prompt_tokens", "tandem:prompt_tokens_total", node="gateway") == prompts
    assert _value(m, "tandem:num_requests_running", node="gateway") == 0
    ttft_sum = _value(m, "tandem:time_to_first_token_seconds", "tandem:time_to_first_token_seconds_sum", node="gateway")
    e2e_sum = _value(m, "tandem:e2e_request_latency_seconds", "tandem:e2e_request_latency_seconds_sum", node="gateway")
    assert 0 < ttft_sum < e2e_sum < 60


def test_node_metrics(observed: Observed) -> None:
    p, d = observed.metrics["prefill"], observed.metrics["decode"]
    for name in ("tandem:time_to_first_token_seconds", "tandem:request_queue_time_seconds",
                 "tandem:request_prefill_time_seconds", "tandem:kv_transfer_seconds"):
        assert _count(p, name, "prefill-0") == N_OK, name
    for name in ("tandem:e2e_request_latency_seconds", "tandem:request_kv_wait_seconds", "tandem:kv_transfer_seconds"):
        assert _count(d, name, "decode-0") == N_OK, name
    assert _value(d, "tandem:request_success", "tandem:request_success_total", node="decode-0",
                  finish_reason="length") == N_OK
    steps = _count(d, "tandem:inter_token_latency_seconds", "decode-0")
    assert N_OK <= steps <= N_OK * (MAX_TOKENS - 1)  # one per engine step; speculation makes fewer
    sent = _value(p, "tandem:kv_transfer_bytes", "tandem:kv_transfer_bytes_total", node="prefill-0")
    received = _value(d, "tandem:kv_transfer_bytes", "tandem:kv_transfer_bytes_total", node="decode-0")
    assert sent == received > 0
    for families, node in ((p, "prefill-0"), (d, "decode-0")):
        queries = _value(families, "tandem:prefix_cache_queries", "tandem:prefix_cache_queries_total", node=node)
        hits = _value(families, "tandem:prefix_cache_hits", "tandem:prefix_cache_hits_total", node=node)
        assert queries >= len(TRACED_PROMPT) + sum(len(x) for x in OTHER_PROMPTS) and 32 <= hits < queries
        assert _value(families, "tandem:num_requests_running", node=node) == 0
        assert _value(families, "tandem:num_requests_waiting", node=node) == 0
        assert 0 <= _value(families, "tandem:kv_cache_usage_perc", node=node) <= 1
        assert _value(families, "tandem:num_preemptions", "tandem:num_preemptions_total", node=node) == 0
        assert _value(families, "tandem:kv_transfer_failures", "tandem:kv_transfer_failures_total", node=node) == 0
    # The engines' step counters: the prefill node computes prompt tokens only, the decode node the rest.
    step_tokens = {(node, kind): _value(families, f"tandem:engine_step_{kind}_tokens",
                                        f"tandem:engine_step_{kind}_tokens_total", node=node)
                   for families, node in ((p, "prefill-0"), (d, "decode-0")) for kind in ("prefill", "decode")}
    assert step_tokens["prefill-0", "decode"] == 0 < step_tokens["prefill-0", "prefill"]
    assert step_tokens["decode-0", "decode"] >= N_OK * (MAX_TOKENS - 1)
    for families, node in ((p, "prefill-0"), (d, "decode-0")):
        assert _value(families, "tandem:engine_steps", "tandem:engine_steps_total", node=node) > 0
        assert _value(families, "tandem:engine_step_seconds", "tandem:engine_step_seconds_total", node=node) > 0
    drafts = _value(d, "tandem:spec_decode_num_draft_tokens", "tandem:spec_decode_num_draft_tokens_total",
                    node="decode-0")
    accepted = _value(d, "tandem:spec_decode_num_accepted_tokens", "tandem:spec_decode_num_accepted_tokens_total",
                      node="decode-0")
    assert 0 <= accepted <= drafts
    assert "tandem:spec_decode_num_drafts" in d and "tandem:spec_decode_num_drafts" not in p
    assert "process_resident_memory_bytes" in d  # the process's own series come along


def test_logs_carry_request_and_trace_ids(observed: Observed) -> None:
    trace_id = _one(_traced(observed), S.GENERATE).trace_id
    finished = [r for r in observed.logs["gateway"] if r["msg"] == "request finished"]
    assert len(finished) == N_OK
    mine = [r for r in finished if r.get("request_id") == TRACED_ID]
    assert len(mine) == 1 and mine[0]["trace_id"] == trace_id
    assert mine[0]["finish_reason"] == "length" and mine[0]["completion_tokens"] == MAX_TOKENS
    failed = [r for r in observed.logs["gateway"] if r["msg"] == "request failed"]
    assert [r.get("status") for r in failed] == ["INVALID_ARGUMENT"] and failed[0]["request_id"] == "too-long"
    for role in ("gateway", "prefill", "decode"):
        records = observed.logs[role]
        assert records and all({"ts", "level", "service", "logger", "msg"} <= r.keys() for r in records), role
