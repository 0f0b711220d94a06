"""Spans the console exporter (``TANDEM_TRACE_CONSOLE=1``) wrote into the services' logs of a ``bench_serve
--log-dir`` folder, read back by the results pages' trace scripts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any


def seconds(stamp: str) -> float:
    """A span's ISO time stamp (``...Z``) as seconds since the epoch."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def spans_in(path: Path) -> Iterator[dict[str, Any]]:
    """Every span a log holds (one-line records and indented span dumps mixed)."""
    text, decoder, i = path.read_text(), json.JSONDecoder(), 0
    while (j := text.find("{", i)) >= 0:
        try:
            obj, i = decoder.raw_decode(text, j)
        except ValueError:
            i = j + 1
            continue
        if isinstance(obj, dict) and "name" in obj and "context" in obj:
            yield obj


def traces(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """The spans of every ``*.log`` in ``folder`` by trace id, each with ``_service``: its log's name."""
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for log in sorted(folder.glob("*.log")):
        for span in spans_in(log):
            span["_service"] = log.stem
            by_trace.setdefault(span["context"]["trace_id"], []).append(span)
    return by_trace
