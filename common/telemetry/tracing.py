"""Process-wide tracing setup from the standard ``OTEL_*`` variables.

Nothing is installed unless an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or the console exporter is switched on (``TANDEM_TRACE_CONSOLE=1``,
``--trace-console``). Without a provider, OpenTelemetry's API hands out non-recording spans: starting one
costs next to nothing (measured: benchmarks/results/figures-from-code.md) and nothing is exported, so the
services create their spans unconditionally and guard only attribute work that is not free with
``span.is_recording()``.

With a provider: BatchSpanProcessor (``OTEL_BSP_*``) -> OTLPSpanExporter over gRPC (``OTEL_EXPORTER_OTLP_*``),
sampler from ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default parentbased_always_on), resource
from ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``; ``service.name`` defaults to ``tandem-<role>``.
``shutdown_tracing`` flushes what is queued; the services call it once they stopped (SIGTERM included).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace

from common.telemetry.settings import TelemetrySettings, TraceExport

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)

_provider: TracerProvider | None = None


def setup_tracing(role: str, node_id: str, settings: TelemetrySettings | None = None,
                  environ: Mapping[str, str] | None = None) -> bool:
    """Install the process's TracerProvider if the environment or ``settings`` ask for traces.

    Returns whether tracing is on. Call once per process, before the servers start (the gRPC
    interceptors are added only when it is on).
    """
    global _provider
    if _provider is not None:
        return True
    settings = settings or TelemetrySettings()
    export = TraceExport.from_env(environ)
    if export.disabled or (export.otlp_endpoint is None and not settings.trace_console):
        return False

    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create({SERVICE_INSTANCE_ID: node_id, "tandem.role": role})
    if str(resource.attributes.get(SERVICE_NAME, "unknown_service")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"tandem-{role}"}))
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    targets = []
    if export.otlp_endpoint is not None:
        if export.protocol != "grpc":
            log.warning("OTLP protocol %r is not bundled; exporting over grpc to %s", export.protocol,
                        export.otlp_endpoint)
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        targets.append(f"otlp {export.otlp_endpoint}")
    if settings.trace_console:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        targets.append("console")
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing on: service %s -> %s", resource.attributes.get(SERVICE_NAME), ", ".join(targets))
    return True


def tracing_enabled() -> bool:
    """Whether this process installed a TracerProvider (spans are recorded and exported)."""
    return _provider is not None


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Flush and stop the exporters (idempotent). Spans started afterwards are dropped."""
    global _provider
    provider, _provider = _provider, None
    if provider is None:
        return
    if not provider.force_flush(int(timeout_s * 1000)):
        log.warning("tracing: spans still queued after %.1f s; some may be lost", timeout_s)
    provider.shutdown()


def get_tracer(name: str) -> trace.Tracer:
    """A tracer that follows the provider installed later (a proxy until ``setup_tracing`` ran)."""
    return trace.get_tracer(name)
