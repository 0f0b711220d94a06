"""hop.py's disaggregated requests from the services' console spans (LOGDIR/disaggregated+shared): every span's
start and end and every event, in ms from the gateway's generate span, p10 / p50 / p90 in time order (session 40).

    PYTHONPATH=CHECKOUT python spans_hop.py LOGDIR/disaggregated+shared
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from benchmarks.console_spans import seconds, traces


def main(folder: Path) -> None:
    columns: dict[str, list[float]] = {}
    for spans in traces(folder).values():
        roots = [s for s in spans if s["_service"] == "gateway" and s["parent_id"] is None]
        if not roots or roots[0]["attributes"].get("gen_ai.request.max_tokens") != 8:  # the measured requests
            continue
        t0 = seconds(roots[0]["start_time"])
        for s in spans:
            key = f"{s['_service']}:{s['name']}"
            columns.setdefault(f"{key}.start", []).append((seconds(s["start_time"]) - t0) * 1e3)
            columns.setdefault(f"{key}.end", []).append((seconds(s["end_time"]) - t0) * 1e3)
            for e in s.get("events", []):
                columns.setdefault(f"{s['_service']}:event.{e['name']}", []).append(
                    (seconds(e["timestamp"]) - t0) * 1e3)
    for key in sorted(columns, key=lambda k: statistics.median(columns[k])):
        v = sorted(columns[key])
        print(f"{key:45s} n={len(v):3d} p10={v[len(v) // 10]:8.2f} p50={statistics.median(v):8.2f} "
              f"p90={v[9 * len(v) // 10]:8.2f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
