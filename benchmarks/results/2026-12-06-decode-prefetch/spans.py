"""Per-request span timings from the services' console span export (``TANDEM_TRACE_CONSOLE=1``, a ``bench_serve
--log-dir`` folder), in ms from the start of the gateway's generate span; p10 / p50 / p90 of each (session 31).

    python benchmarks/results/2026-12-06-decode-prefetch/spans.py LOG_DIR/SYSTEM OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _objects(path: Path) -> Iterator[dict[str, Any]]:
    """Every JSON object in a log mixing one-line records and indented span dumps."""
    text, decoder, i = path.read_text(), json.JSONDecoder(), 0
    while (j := text.find("{", i)) >= 0:
        try:
            obj, i = decoder.raw_decode(text, j)
        except ValueError:
            i = j + 1
            continue
        if isinstance(obj, dict):
            yield obj


def main(folder: Path, out: Path) -> None:
    traces: dict[str, list[dict[str, Any]]] = {}
    for log in folder.glob("*.log"):
        for obj in _objects(log):
            if "name" in obj and "context" in obj:
                obj["_service"] = log.stem
                traces.setdefault(obj["context"]["trace_id"], []).append(obj)
    rows: list[dict[str, Any]] = []
    for spans in traces.values():
        roots = [s for s in spans if s["_service"] == "gateway" and s["parent_id"] is None]
        if not roots:
            continue
        root = roots[0]
        t0 = _seconds(root["start_time"])
        row: dict[str, Any] = {"attributes": root["attributes"]}
        for event in root.get("events", []):
            row[f"event.{event['name']}"] = (_seconds(event["timestamp"]) - t0) * 1000
        for span in spans:
            if span is not root:
                key = f"{span['_service']}:{span['name']}"
                row[f"{key}.start"] = (_seconds(span["start_time"]) - t0) * 1000
                row[f"{key}.end"] = (_seconds(span["end_time"]) - t0) * 1000
        rows.append(row)
    out.write_text(json.dumps(rows, indent=0))
    keys = sorted({k for row in rows for k in row if k != "attributes"})
    print(f"{len(rows)} requests")
    for key in keys:
        values = sorted(row[key] for row in rows if key in row)
        print(f"{key:50s} n={len(values):3d} p10={values[len(values) // 10]:8.1f} "
              f"p50={statistics.median(values):8.1f} p90={values[int(0.9 * len(values))]:8.1f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
