"""Telemetry shared by every service: traces, metrics and structured logs (no torch, no service imports).

- ``settings``: ``TelemetrySettings`` (``TANDEM_TRACE_CONSOLE``, ``TANDEM_LOG_FORMAT``...) and whether the
  standard ``OTEL_*`` variables ask for an OTLP export.
- ``tracing``: installs a TracerProvider (OTLP/gRPC exporter behind a BatchSpanProcessor, or a console
  exporter) only when asked; otherwise OpenTelemetry's no-op API stays in place and spans cost next to nothing.
- ``propagation``: grpc.aio client and server interceptors that carry W3C trace context in metadata, and
  the header dict that travels in KV-transfer control messages.
- ``spans``: span names, attribute keys, and helpers to build spans after the fact from recorded timings.
- ``metrics``: each service's Prometheus registry (names follow vLLM's, prefixed ``tandem:``), the
  engine-state collector read on scrape, and the ``/metrics`` HTTP endpoint.
- ``logs``: one-line JSON (or key=value) log records carrying the request id and trace id.

Telemetry lives at the edges (servicers, interceptors): the engine loop only records numbers.
"""
