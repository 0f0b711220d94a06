"""common.telemetry in process: settings, trace-context propagation over real grpc.aio calls, spans built
after the fact, metric names and the /metrics endpoint, structured log lines, prefill chunk timings."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from common.telemetry import spans as S
from common.telemetry.logs import JsonFormatter, TextFormatter, _ContextFilter, log_event, request_scope
from common.telemetry.metrics import DecodeMetrics, EngineSnapshot, GatewayMetrics, PrefillMetrics, serve_metrics
from common.telemetry.propagation import (
    TraceContextServerInterceptor,
    context_from_headers,
    context_headers,
    trace_context_client_interceptors,
)
from common.telemetry.settings import TelemetrySettings, TraceExport
from common.telemetry.tracing import setup_tracing, tracing_enabled


@pytest.fixture
def tracer() -> tuple[trace.Tracer, InMemorySpanExporter]:
    """A real SDK tracer of its own (the process-wide provider stays untouched)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


# ---- settings and setup ---------------------------------------------------------------------------


def test_export_is_asked_for_only_by_an_endpoint() -> None:
    assert TraceExport.from_env({}).otlp_endpoint is None
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
    assert TraceExport.from_env(env).otlp_endpoint == "http://127.0.0.1:4317"
    assert TraceExport.from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://j:4317"}).otlp_endpoint == "http://j:4317"
    assert TraceExport.from_env({**env, "OTEL_SDK_DISABLED": "true"}).disabled
    assert TraceExport.from_env({**env, "OTEL_TRACES_EXPORTER": "none"}).disabled
    with pytest.raises(ValueError, match="log_format"):
        TelemetrySettings(log_format="xml")
    assert TelemetrySettings(log_level="debug").log_level == "DEBUG"


def test_no_endpoint_installs_no_provider() -> None:
    assert not setup_tracing("gateway", "gateway", TelemetrySettings(), environ={})
    assert not setup_tracing("gateway", "gateway", TelemetrySettings(),
                             environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "true"})
    assert not tracing_enabled()
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)  # still the API's proxy: spans are no-ops
    span = trace.get_tracer("x").start_span("nothing")
    assert not span.is_recording()
    assert context_headers(span) == {}


# ---- propagation ----------------------------------------------------------------------------------


async def _echo_server(interceptors: list[grpc.aio.ServerInterceptor]) -> tuple[grpc.aio.Server, int]:
    """A raw-bytes service whose methods answer with the handler's current trace context."""

    def current() -> bytes:
        ctx = trace.get_current_span().get_span_context()
        return f"{ctx.trace_id:032x}/{ctx.span_id:016x}".encode() if ctx.is_valid else b"none"

    async def unary(request: bytes, context: Any) -> bytes:
        await asyncio.sleep(0.01)  # let concurrent calls interleave
        return current()

    async def stream(request: bytes, context: Any) -> Any:
        for _ in range(3):
            await asyncio.sleep(0)
            yield current()

    handler = grpc.method_handlers_generic_handler("test.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
    })
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _ids(span: trace.Span) -> bytes:
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}/{ctx.span_id:016x}".encode()


def test_context_crosses_grpc_aio_calls(tracer: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tr, _ = tracer

    async def main() -> None:
        server, port = await _echo_server([TraceContextServerInterceptor()])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                                 interceptors=trace_context_client_interceptors()) as channel:
                unary = channel.unary_unary("/test.Echo/Unary")
                stream = channel.unary_stream("/test.Echo/Stream")
                assert await unary(b"") == b"none"  # no current span: nothing is sent

                async def traced_call(name: str) -> tuple[bytes, bytes, list[bytes]]:
                    with tr.start_as_current_span(name) as span:
                        one = await unary(b"")
                        call = stream(b"")
                        many = [msg async for msg in call]
                        return _ids(span), one, many

                results = await asyncio.gather(*(traced_call(f"client-{i}") for i in range(8)))
                for ids, one, many in results:  # concurrent calls each see their own caller
                    assert one == ids and many == [ids] * 3
                assert len({ids for ids, _, _ in results}) == 8
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_headers_round_trip(tracer: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tr, _ = tracer
    span = tr.start_span("kv")
    headers = context_headers(span)
    assert set(headers) >= {"traceparent"}
    ctx = context_from_headers(headers)
    assert ctx is not None
    assert trace.get_current_span(ctx).get_span_context().span_id == span.get_span_context().span_id
    assert context_from_headers({}) is None and context_from_headers([("traceparent", "garbage")]) is None
    assert context_from_headers([("TraceParent", headers["traceparent"])]) is not None  # metadata keys: any case


def test_record_span_after_the_fact(tracer: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tr, exporter = tracer
    with tr.start_as_current_span("parent") as parent:
        S.record_span(tr, "child", 1_000, 5_000, {"k": 1}, parent=trace.set_span_in_context(parent),
                      kind=S.CONSUMER)
    child = next(s for s in exporter.get_finished_spans() if s.name == "child")
    assert (child.start_time, child.end_time, child.kind) == (1_000, 5_000, S.CONSUMER)
    assert child.parent is not None and child.parent.span_id == parent.get_span_context().span_id
    assert S.transfer_attributes(2_000_000_000, 2.0, 7)[S.KV_GBPS] == 1.0


def test_set_error_marks_status(tracer: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tr, exporter = tracer
    with tr.start_as_current_span("bad", record_exception=False, set_status_on_exception=False) as span:
        S.set_error(span, ValueError("bad"), grpc.StatusCode.INVALID_ARGUMENT)
    with tr.start_as_current_span("broken", record_exception=False, set_status_on_exception=False) as span:
        S.set_error(span, RuntimeError("boom"), grpc.StatusCode.INTERNAL)
    with tr.start_as_current_span("cancelled") as span:
        S.set_error(span, asyncio.CancelledError(), grpc.StatusCode.CANCELLED)
    bad, broken, cancelled = exporter.get_finished_spans()
    assert bad.attributes is not None and bad.attributes[S.STATUS] == "INVALID_ARGUMENT"
    assert bad.status.status_code == trace.StatusCode.UNSET and [e.name for e in bad.events] == ["exception"]
    assert broken.status.status_code == trace.StatusCode.ERROR and broken.attributes[S.STATUS_CODE] == 13
    assert not cancelled.events and cancelled.status.status_code == trace.StatusCode.UNSET
    assert S.log_level_for(grpc.StatusCode.UNAVAILABLE) == logging.WARNING
    assert S.log_level_for(grpc.StatusCode.CANCELLED) == logging.DEBUG
    internal = (grpc.StatusCode.INTERNAL, "")
    assert S.failure_code(asyncio.CancelledError(), lambda e: internal) == grpc.StatusCode.CANCELLED
    assert S.failure_code(ValueError(), lambda e: internal) == grpc.StatusCode.INTERNAL


# ---- metrics --------------------------------------------------------------------------------------


def _families(metrics: Any) -> dict[str, Any]:
    from prometheus_client import generate_latest

    return {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}


def test_metric_names_follow_vllm_with_a_node_label() -> None:
    g = GatewayMetrics()
    g.request_finished("length", 10, 5, 0.1, 0.5, 0.01)
    g.request_failed("UNAVAILABLE")
    fam = _families(g)
    assert {"tandem:time_to_first_token_seconds", "tandem:e2e_request_latency_seconds",
            "tandem:request_queue_time_seconds", "tandem:num_requests_running", "tandem:request_success",
            "tandem:request_failure", "tandem:prompt_tokens", "tandem:generation_tokens"} <= fam.keys()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fam.values() for s in f.samples}
    assert samples[("tandem:request_success_total", (("finish_reason", "length"), ("node", "gateway")))] == 1
    assert samples[("tandem:generation_tokens_total", (("node", "gateway"),))] == 5
    tpot = [s for s in fam["tandem:request_time_per_output_token_seconds"].samples if s.name.endswith("_sum")]
    assert tpot[0].value == pytest.approx(0.1)  # (0.5 - 0.1) / (5 - 1)

    d = DecodeMetrics("decode-0")
    snap = EngineSnapshot(num_running=2, num_waiting=1, kv_cache_usage=0.25, prefix_cache_queries=100,
                          prefix_cache_hits=40, num_preemptions=3, spec_num_drafts=4, spec_num_draft_tokens=12,
                          spec_num_accepted_tokens=7, num_steps=9, step_seconds=1.5, step_prefill_tokens=300,
                          step_decode_tokens=20)
    d.add_engine(lambda: snap, speculative=True)
    fam = _families(d)
    values = {s.name: s.value for f in fam.values() for s in f.samples if s.labels.get("node") == "decode-0"}
    assert values["tandem:kv_cache_usage_perc"] == 0.25 and values["tandem:num_requests_waiting"] == 1
    assert values["tandem:prefix_cache_hits_total"] == 40 and values["tandem:num_preemptions_total"] == 3
    assert values["tandem:spec_decode_num_accepted_tokens_total"] == 7
    assert values["tandem:engine_steps_total"] == 9 and values["tandem:engine_step_seconds_total"] == 1.5
    assert values["tandem:engine_step_prefill_tokens_total"] == 300
    assert values["tandem:engine_step_decode_tokens_total"] == 20
    assert {"tandem:inter_token_latency_seconds", "tandem:kv_transfer_bytes",
            "tandem:kv_transfer_seconds"} <= fam.keys()

    p = PrefillMetrics("prefill-0")
    p.add_engine(lambda: snap)
    assert "tandem:spec_decode_num_draft_tokens" not in _families(p)  # only where speculation runs


def test_a_failing_snapshot_does_not_break_the_scrape() -> None:
    p = PrefillMetrics("prefill-0")

    def broken() -> EngineSnapshot:
        raise RuntimeError("engine gone")

    p.add_engine(broken)
    assert "tandem:time_to_first_token_seconds" in _families(p)


def test_metrics_endpoint_serves_the_registry() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = PrefillMetrics("prefill-7")
    m.transfer_done(4096, 0.002)
    server = serve_metrics(m, "127.0.0.1", port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.close()
    assert 'tandem:kv_transfer_bytes_total{node="prefill-7"} 4096.0' in text
    assert "_created" not in text


# ---- logs -----------------------------------------------------------------------------------------


def _logger(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(formatter)
    logger = logging.getLogger(f"tandem.test.{id(out)}")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, out


def test_json_log_lines_carry_request_and_trace_ids(tracer: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tr, _ = tracer
    logger, out = _logger(JsonFormatter("gateway"))
    with tr.start_as_current_span("generate") as span, request_scope("req-42"):
        log_event(logger, logging.INFO, "request finished", completion_tokens=7, finish_reason="length")
    logger.info("outside")
    inside, outside = (json.loads(line) for line in out.getvalue().splitlines())
    ctx = span.get_span_context()
    assert inside["request_id"] == "req-42" and inside["trace_id"] == f"{ctx.trace_id:032x}"
    assert inside["span_id"] == f"{ctx.span_id:016x}" and inside["service"] == "gateway"
    assert (inside["msg"], inside["completion_tokens"], inside["finish_reason"]) == ("request finished", 7, "length")
    assert "request_id" not in outside and "trace_id" not in outside


def test_text_log_lines_are_key_value() -> None:
    logger, out = _logger(TextFormatter("decode-0"))
    with request_scope("r 1"):
        log_event(logger, logging.INFO, "decode failed", status="CANCELLED", seconds=0.25)
    line = out.getvalue().strip()
    assert line.endswith('decode failed request_id="r 1" status=CANCELLED seconds=0.25')
    assert " INFO decode-0 " in line


def test_request_scope_is_task_local() -> None:
    from common.telemetry.logs import current_request_id

    async def one(rid: str) -> str | None:
        with request_scope(rid):
            await asyncio.sleep(0.01)
            return current_request_id()

    async def main() -> list[str | None]:
        return await asyncio.gather(*(one(f"r{i}") for i in range(5)))

    assert asyncio.run(main()) == [f"r{i}" for i in range(5)]
    assert current_request_id() is None


# ---- prefill chunk timings ------------------------------------------------------------------------


class _Target:
    def __init__(self) -> None:
        self.pushed: list[list[int]] = []
        self.on_finished: list[Callable[[], None]] = []

    def push(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        self.pushed.append(list(dst_block_ids))

    def when_finished(self, callback: Callable[[], None]) -> None:
        self.on_finished.append(callback)

    def finish(self) -> None:
        for callback in self.on_finished:
            callback()


def test_prefill_engine_times_each_chunk(tiny_model_factory: Callable[..., Path]) -> None:
    from common.config.engine_config import CacheConfig, SchedulerConfig
    from common.engine.commands import AddRequest, ChunkTiming, KVDestination
    from common.engine.engine_core import EngineCore
    from common.model.loader import load_model
    from common.sampling.params import SamplingParams
    from prefill_service.kv_producer import KVProducer

    model = load_model(tiny_model_factory(), dtype="float32")
    producer = KVProducer(block_size=16)
    engine = EngineCore(model, CacheConfig(num_blocks=32), SchedulerConfig(max_prefill_chunk=16), connector=producer)
    timed: list[ChunkTiming] = []
    target = _Target()
    params = SamplingParams(max_tokens=1)
    engine.handle(AddRequest("a", tuple(range(3, 43)), params, (), KVDestination(target, (100, 101, 102), 0), timed))
    # not traced: nothing recorded
    other = _Target()
    engine.handle(AddRequest("b", tuple(range(3, 23)), params, (), KVDestination(other, (200, 201), 0)))
    while engine.has_unfinished():
        engine.step()
    assert [(t.start_token, t.num_tokens) for t in timed] == [(0, 16), (16, 16), (32, 8)]
    assert all(t.start_ns <= t.end_ns for t in timed) and timed[0].end_ns <= timed[1].start_ns
    assert all(t.step_tokens >= t.num_tokens for t in timed)
    assert set(producer._chunk_timings) == {"a"}
    assert [b for push in target.pushed for b in push] == [100, 101, 102]
    assert engine.kv.num_used_blocks == 3 + 2  # held for the transfers until they end
    target.finish()
    other.finish()  # the transfers' ends, reported into the connector; the next step frees the blocks
    assert engine.has_unfinished()
    engine.step()
    assert producer._chunk_timings == {} and engine.kv.num_used_blocks == 0


# ---- process setup, layering, topology ------------------------------------------------------------


def test_console_switch_installs_a_provider_and_shutdown_flushes() -> None:
    """In a fresh interpreter (the provider is process-wide): no endpoint, console on."""
    import subprocess
    import sys

    code = (
        "from opentelemetry import trace\n"
        "from common.telemetry.settings import TelemetrySettings\n"
        "from common.telemetry.tracing import setup_tracing, shutdown_tracing, tracing_enabled\n"
        "assert setup_tracing('decode', 'decode-3', TelemetrySettings(trace_console=True), environ={})\n"
        "assert tracing_enabled()\n"
        "with trace.get_tracer('t').start_as_current_span('hello') as span:\n"
        "    assert span.is_recording()\n"
        "shutdown_tracing()\n"
        "assert not tracing_enabled()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    exported = json.loads(out.stdout)  # ConsoleSpanExporter: one JSON document per span
    assert exported["name"] == "hello"
    assert exported["resource"]["attributes"]["service.name"] == "tandem-decode"
    assert exported["resource"]["attributes"]["service.instance.id"] == "decode-3"


def test_telemetry_imports_no_torch_and_no_service() -> None:
    import ast

    root = Path(__file__).resolve().parents[2]
    forbidden = {"torch", "triton", "gateway", "prefill_service", "decode_service", "kv_transfer", "tandem_cli"}
    for path in (root / "common" / "telemetry").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            modules = {n.split(".")[0] for n in names}
            assert not modules & forbidden, f"{path.name} imports {modules & forbidden}"
            assert not any(n.startswith("common.engine") for n in names), path.name


def test_topology_gives_each_service_a_metrics_port() -> None:
    from tandem_cli.launcher import Topology

    specs = Topology(num_prefill=2, num_decode=1, metrics_base_port=9400, cpus=(0,)).nodes()
    ports = {s.name: s.metrics_port for s in specs}
    assert ports == {"gateway": 9400, "prefill-0": 9401, "prefill-1": 9402, "decode-0": 9403}
    for spec in specs:
        assert spec.args[spec.args.index("--metrics-port") + 1] == str(spec.metrics_port)
    assert all(s.metrics_port is None and "--metrics-port" not in s.args for s in Topology(cpus=(0,)).nodes())
    free = Topology(free_ports=True, metrics_base_port=0, cpus=(0,)).nodes()
    assert len({s.metrics_port for s in free}) == 3 and all(s.metrics_port for s in free)
    with pytest.raises(ValueError, match="metrics_base_port"):
        Topology(metrics_base_port=65534)
