"""A real OTLP/gRPC trace collector for tests: the ``TraceService`` of opentelemetry-proto on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


@dataclass(frozen=True)
class CollectedSpan:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str | None
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace_id, span_id)
    events: list[str] = field(default_factory=list)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span in memory; ``endpoint`` is what OTEL_EXPORTER_OTLP_ENDPOINT takes.

    ``host``: the interface it listens on (loopback; "0.0.0.0" for exporters in containers on this host)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._lock = threading.Lock()
        self._spans: list[CollectedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"{host}:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Collector:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0)

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(CollectedSpan(
                        service=str(resource.get("service.name", "")), name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex() or None,
                        kind=KINDS.get(s.kind, str(s.kind)), start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano, attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        status_code=s.status.code, links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                        events=[e.name for e in s.events]))
        with self._lock:
            self._spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def spans(self) -> list[CollectedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[list[CollectedSpan]], bool], timeout_s: float) -> list[CollectedSpan]:
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)


def trace_tree(spans: list[CollectedSpan], keys: tuple[str, ...] = ()) -> str:
    """The spans of one trace, indented under their parents, children in start order."""
    by_parent: dict[str | None, list[CollectedSpan]] = {}
    ids = {s.span_id for s in spans}
    for s in spans:
        parent = s.parent_span_id if s.parent_span_id in ids else None
        by_parent.setdefault(parent, []).append(s)
    t0 = min((s.start_ns for s in spans), default=0)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for s in sorted(by_parent.get(parent, []), key=lambda s: (s.start_ns, s.name)):
            attrs = " ".join(f"{k.split('.')[-1]}={s.attributes[k]}" for k in keys if k in s.attributes)
            lines.append(f"{'  ' * depth}{s.name} [{s.service}, {s.kind}] +{(s.start_ns - t0) / 1e6:.1f}ms "
                         f"{s.duration_ms:.1f}ms {attrs}".rstrip())
            walk(s.span_id, depth + 1)

    walk(None, 0)
    return "\n".join(lines)
