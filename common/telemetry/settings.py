"""Telemetry settings: Tandem's own switches (``TANDEM_*``) and whether the ``OTEL_*`` variables ask for export.

The OpenTelemetry SDK reads the standard variables itself (endpoint, headers, timeout, sampler, batch
processor, resource attributes); Tandem reads only enough of them to decide whether to install a
TracerProvider at all, so that a process nobody asked to trace keeps the no-op API.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# The variables that name an OTLP trace endpoint (the traces-specific one wins in the SDK).
OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


@dataclass(frozen=True)
class TelemetrySettings:
    """Filled by ``load_settings`` from flags and ``TANDEM_*`` like every other settings class."""

    trace_console: bool = False  # print finished spans to stderr (local debugging), with or without OTLP
    log_format: str = "json"  # json: one JSON object per line; text: "ts level logger msg key=value ..."
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}; got {self.log_format!r}")
        object.__setattr__(self, "log_level", self.log_level.upper())
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}; got {self.log_level!r}")


@dataclass(frozen=True)
class TraceExport:
    """What the ``OTEL_*`` variables ask for."""

    otlp_endpoint: str | None  # None: no OTLP export
    disabled: bool  # OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none
    protocol: str  # OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL; only grpc is bundled

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> TraceExport:
        env = os.environ if environ is None else environ
        endpoint = next((env[v].strip() for v in OTLP_ENDPOINT_VARS if env.get(v, "").strip()), None)
        exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
        disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporters == {"none"}
        protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                    or "grpc").strip().lower()
        return TraceExport(endpoint, disabled, protocol)
