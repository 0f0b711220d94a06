"""A traced multi-turn run of the disaggregated system (bench_serve --log-dir, TANDEM_TRACE_CONSOLE=1), per turn:
the gateway's TTFT, the hop in (gateway span start -> prefill span), the prefill queue, the compute (first chunk
start -> last chunk end), the hop out (-> the gateway's first_token event), and how much of the compute a decode
stream ran beside; compute per new token with and without a stream beside (session 40).

    PYTHONPATH=CHECKOUT python turns_spans.py LOG_DIR/disaggregated+shared
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.console_spans import seconds, traces


def turn_rows(folder: Path) -> list[dict[str, float]]:
    by_trace = traces(folder)
    streams = [(seconds(s["start_time"]), seconds(s["end_time"])) for spans in by_trace.values() for s in spans
               if s["name"] == "decode.stream"]
    rows = []
    for spans in by_trace.values():
        roots = [s for s in spans if s["_service"] == "gateway" and s["parent_id"] is None]
        chunks = [s for s in spans if s["name"] == "prefill.chunk"]
        prefill = [s for s in spans if s["name"] == "prefill"]
        if not roots or not chunks or not prefill:
            continue
        root: dict[str, Any] = roots[0]
        a, t0 = root["attributes"], seconds(root["start_time"])
        start = min(seconds(s["start_time"]) for s in chunks)
        end = max(seconds(s["end_time"]) for s in chunks)
        events = {e["name"]: seconds(e["timestamp"]) for e in root.get("events", [])}
        beside = sum(max(0.0, min(e, end) - max(s, start)) for s, e in streams) / (end - start)
        rows.append({"ttft": a["tandem.time_to_first_token_s"] * 1e3,
                     "in": (seconds(prefill[0]["start_time"]) - t0) * 1e3,
                     "queue": (start - seconds(prefill[0]["start_time"])) * 1e3, "compute": (end - start) * 1e3,
                     "out": (events.get("first_token", end) - end) * 1e3,
                     "new": a["gen_ai.usage.input_tokens"] - a.get("tandem.cached_tokens", 0), "beside": beside})
    return rows


def main(folder: Path) -> None:
    rows = turn_rows(folder)
    print(f"{len(rows)} requests")
    for key in ("ttft", "in", "queue", "compute", "out"):
        v = sorted(r[key] for r in rows)
        print(f"{key:8s} p50 {statistics.median(v):7.2f}  p90 {v[int(0.9 * len(v))]:7.2f} ms")
    alone = [r["compute"] / r["new"] for r in rows if r["beside"] < 0.05 and r["new"] > 30]
    beside = [r["compute"] / r["new"] for r in rows if r["beside"] > 0.5 and r["new"] > 30]
    print(f"compute per new token: no stream beside {statistics.median(alone):.3f} ms (n={len(alone)}), "
          f"a stream beside most of it {statistics.median(beside):.3f} ms (n={len(beside)})")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
