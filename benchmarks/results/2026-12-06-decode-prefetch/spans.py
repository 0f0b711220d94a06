"""Per-request span timings from the services' console span export (``TANDEM_TRACE_CONSOLE=1``, a ``bench_serve
--log-dir`` folder), in ms from the start of the gateway's generate span; p10 / p50 / p90 of each (session 31).

    PYTHONPATH=. python benchmarks/results/2026-12-06-decode-prefetch/spans.py LOG_DIR/SYSTEM OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.console_spans import seconds, traces


def main(folder: Path, out: Path) -> None:
    rows: list[dict[str, Any]] = []
    for spans in traces(folder).values():
        roots = [s for s in spans if s["_service"] == "gateway" and s["parent_id"] is None]
        if not roots:
            continue
        root = roots[0]
        t0 = seconds(root["start_time"])
        row: dict[str, Any] = {"attributes": root["attributes"]}
        for event in root.get("events", []):
            row[f"event.{event['name']}"] = (seconds(event["timestamp"]) - t0) * 1000
        for span in spans:
            if span is not root:
                key = f"{span['_service']}:{span['name']}"
                row[f"{key}.start"] = (seconds(span["start_time"]) - t0) * 1000
                row[f"{key}.end"] = (seconds(span["end_time"]) - t0) * 1000
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
