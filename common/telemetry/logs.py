"""Structured logs: one line per event, carrying the request id and the trace id.

``json`` (the default for services) writes one JSON object per line::

    {"ts": "2025-01-01T12:00:00.123Z", "level": "INFO", "service": "gateway", "logger": "gateway.servicer",
     "msg": "request finished", "request_id": "req-1", "trace_id": "4bf92f35...", "span_id": "00f067aa...",
     "finish_reason": "length", "completion_tokens": 16}

``text`` writes the same as ``ts level service logger: msg key=value ...``. The request id comes from
``request_scope`` (servicers enter it per RPC), the trace and span ids from the current OpenTelemetry span;
both are task-local (contextvars), so concurrent requests never mix. ``log_event`` adds key=value fields.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from opentelemetry import trace

from common.telemetry.settings import TelemetrySettings

_REQUEST_ID: ContextVar[str | None] = ContextVar("tandem_request_id", default=None)

# LogRecord attributes that are not user fields.
_FIELDS_ATTR = "tandem_fields"


@contextlib.contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """Tag every log record made in this task (and tasks it starts) with ``request_id``."""
    token = _REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # an async generator closed from another context
            _REQUEST_ID.reset(token)


def current_request_id() -> str | None:
    return _REQUEST_ID.get()


def log_event(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log ``msg`` with structured ``fields`` (JSON keys, or key=value in text)."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={_FIELDS_ATTR: fields})


class _ContextFilter(logging.Filter):
    """Stamp request id, trace id and span id on the record while still in the emitting task."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _REQUEST_ID.get()
        ctx = trace.get_current_span().get_span_context()
        record.trace_id = format(ctx.trace_id, "032x") if ctx.is_valid else None
        record.span_id = format(ctx.span_id, "016x") if ctx.is_valid else None
        return True


def _ts(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": _ts(record), "level": record.levelname, "service": self._service,
                               "logger": record.name, "msg": record.getMessage()}
        for key in ("request_id", "trace_id", "span_id"):
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        for key, value in getattr(record, _FIELDS_ATTR, {}).items():
            out.setdefault(key, value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        parts = [_ts(record), record.levelname, self._service, f"{record.name}: {record.getMessage()}"]
        fields = {k: getattr(record, k, None) for k in ("request_id", "trace_id")}
        fields.update(getattr(record, _FIELDS_ATTR, {}))
        parts += [f"{k}={_quote(v)}" for k, v in fields.items() if v is not None]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _quote(value: Any) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return json.dumps(text) if (not text or any(c in text for c in ' "=\n')) else text


def configure_logging(settings: TelemetrySettings, service: str) -> None:
    """Send every log record of this process to stderr, one line each, in ``settings.log_format``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(JsonFormatter(service) if settings.log_format == "json" else TextFormatter(service))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.log_level)
