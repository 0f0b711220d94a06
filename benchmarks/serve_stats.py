"""The serving benchmark's statistics: one system's run summarised (overall and per kind of request, with
its SLO attainment and goodput), the systems side by side in Markdown, and a system's entry in the JSON
results. A system that failed to start has a summary too (``started`` False): every request failed."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.serve_client import RequestRecord
from benchmarks.slo import SLO, Attainment, Latencies

PERCENTILES = ("p50", "p90", "p99")


@dataclass(frozen=True)
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float

    @staticmethod
    def of(values: Sequence[float]) -> Distribution | None:
        if not values:
            return None
        import numpy as np

        p50, p90, p99 = (float(v) for v in np.percentile(values, [50, 90, 99]))
        return Distribution(float(np.mean(values)), p50, p90, p99)


@dataclass(frozen=True)
class KindSummary:
    """The latencies of one kind of request (a workload's "short" or "long", say)."""

    completed: int
    ttft_s: Distribution | None
    tpot_s: Distribution | None
    e2e_s: Distribution | None

    @staticmethod
    def of(done: Sequence[RequestRecord]) -> KindSummary:
        return KindSummary(completed=len(done), ttft_s=_dist([r.ttft_s for r in done]),
                           tpot_s=_dist([r.tpot_s for r in done]), e2e_s=_dist([r.e2e_s for r in done]))


@dataclass(frozen=True)
class Summary:
    system: str
    placement: str
    completed: int
    failed: int
    wrong_length: int  # completed with another number of tokens than asked (EOS is ignored: should be 0)
    duration_s: float
    input_tokens: int
    output_tokens: int
    ttft_s: Distribution | None
    tpot_s: Distribution | None
    itl_s: Distribution | None
    e2e_s: Distribution | None
    queue_s: Distribution | None  # server-side, see RequestRecord
    kv_transfer_s: Distribution | None
    tokens_per_message: float
    errors: tuple[str, ...] = ()
    by_kind: dict[str, KindSummary] = field(default_factory=dict)  # in the order kinds first arrive
    slo: Attainment | None = None  # None: summarized without an SLO
    started: bool = True  # False: the system failed to start (or to serve its warm-up); nothing was measured
    rate: float | None = None  # the Poisson arrival rate it ran at (requests/s); None: closed loop or all at once
    # Prompt tokens the nodes looked up in their prefix caches during the run, found (pool or offload tier) and
    # restored from the offload tier (GetLoads before and after); empty when not read.
    cache: dict[str, int] = field(default_factory=dict)

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0


def summarize(system: str, placement: str, records: Sequence[RequestRecord], duration_s: float,
              slo: SLO | None = None) -> Summary:
    done = [r for r in records if r.ok]
    messages = sum(r.num_messages for r in done)
    output_tokens = sum(r.num_tokens for r in done)
    overall = KindSummary.of(done)
    return Summary(
        system=system, placement=placement, completed=len(done), failed=len(records) - len(done),
        wrong_length=sum(r.num_tokens != r.expected_tokens for r in done), duration_s=duration_s,
        input_tokens=sum(r.prompt_len for r in done), output_tokens=output_tokens,
        ttft_s=overall.ttft_s, tpot_s=overall.tpot_s,
        itl_s=Distribution.of([g for r in done for g in r.gaps]), e2e_s=overall.e2e_s,
        queue_s=_dist([r.queue_s for r in done]), kv_transfer_s=_dist([r.kv_transfer_s for r in done]),
        tokens_per_message=output_tokens / messages if messages else 0.0,
        errors=tuple(sorted({r.error for r in records if r.error}))[:5],
        by_kind={kind: KindSummary.of([r for r in done if r.kind == kind])
                 for kind in dict.fromkeys(r.kind for r in records)},
        slo=None if slo is None else Attainment.of(slo, map(latencies, records), duration_s),
    )


def latencies(record: RequestRecord) -> Latencies:
    """What the SLO judges of one request: None when it failed, else (TTFT, TPOT or None)."""
    ttft = record.ttft_s
    return None if ttft is None else (ttft, record.tpot_s)


def not_started(system: str, num_requests: int, error: str, slo: SLO | None = None) -> Summary:
    """The summary of a system that failed to start: each of its ``num_requests`` counts as failed."""
    return Summary(system=system, placement="failed to start", completed=0, failed=num_requests, wrong_length=0,
                   duration_s=0.0, input_tokens=0, output_tokens=0, ttft_s=None, tpot_s=None, itl_s=None,
                   e2e_s=None, queue_s=None, kv_transfer_s=None, tokens_per_message=0.0, errors=(error,),
                   slo=None if slo is None else Attainment.of(slo, [None] * num_requests, 0.0), started=False)


def system_json(summary: Summary, records: Sequence[RequestRecord]) -> dict[str, Any]:
    """A system's entry in ``--json``'s "systems": the summary, its throughputs and every request."""
    return {
        **asdict(summary),
        "request_throughput": summary.request_throughput,
        "output_throughput": summary.output_throughput,
        "goodput": None if summary.slo is None else summary.slo.goodput,
        "records": [{"index": r.index, "kind": r.kind, "prompt_len": r.prompt_len, "num_tokens": r.num_tokens,
                     "ok": r.ok, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2e_s": r.e2e_s} for r in records],
    }


def markdown_table(summaries: Sequence[Summary]) -> str:
    """The systems side by side, one metric per row (the SLO rows when the summaries have an SLO)."""
    rows: list[tuple[str, list[str]]] = [
        ("completed / failed", [f"{s.completed} / {s.failed}" if s.started else f"failed to start ({s.failed})"
                                for s in summaries]),
        ("duration (s)", [f"{s.duration_s:.1f}" if s.started else "-" for s in summaries]),
        ("requests/s", [f"{s.request_throughput:.3f}" if s.started else "-" for s in summaries]),
        *slo_rows(summaries),
        ("output tokens/s", [f"{s.output_throughput:.1f}" if s.started else "-" for s in summaries]),
        ("total tokens/s (in + out)", [f"{(s.input_tokens + s.output_tokens) / s.duration_s:.1f}"
                                       if s.duration_s > 0 else "-" for s in summaries]),
    ]
    for label, attr, scale, unit, stats in (
            ("TTFT", "ttft_s", 1000, "ms", ("mean", *PERCENTILES)),
            ("TPOT", "tpot_s", 1000, "ms", ("mean", *PERCENTILES)),
            ("ITL", "itl_s", 1000, "ms", ("mean", *PERCENTILES)),
            ("E2E latency", "e2e_s", 1, "s", ("mean", *PERCENTILES)),
            ("server queue", "queue_s", 1000, "ms", ("p50", "p99")),  # parts of TTFT, as the server saw them
            ("KV transfer", "kv_transfer_s", 1000, "ms", ("p50", "p99"))):
        for stat in stats:
            values = [_cell(getattr(s, attr), stat, scale) for s in summaries]
            rows.append((f"{label} {stat} ({unit})", values))
    rows.append(("tokens per streamed message", [f"{s.tokens_per_message:.2f}" for s in summaries]))
    rows.append(("outputs of the wrong length", [str(s.wrong_length) for s in summaries]))
    return _table("metric", summaries, rows)


def slo_rows(summaries: Sequence[Summary]) -> list[tuple[str, list[str]]]:
    """Goodput and SLO attainment (both SLOs, each alone), one row each; none when no summary has an SLO."""
    if all(s.slo is None for s in summaries):
        return []

    def cells(value: Callable[[Attainment], str]) -> list[str]:
        return ["-" if s.slo is None else value(s.slo) for s in summaries]

    return [("goodput (requests/s meeting both SLOs)", cells(lambda a: f"{a.goodput:.3f}")),
            ("SLO attainment, both (%)", cells(lambda a: f"{100 * a.both:.0f}")),
            ("SLO attainment, TTFT (%)", cells(lambda a: f"{100 * a.ttft:.0f}")),
            ("SLO attainment, TPOT (%)", cells(lambda a: f"{100 * a.tpot:.0f}"))]


def kind_table(summaries: Sequence[Summary]) -> str | None:
    """TTFT and TPOT percentiles per kind of request, the systems side by side; None for one kind."""
    kinds = list(dict.fromkeys(k for s in summaries for k in s.by_kind))
    if len(kinds) < 2:
        return None
    rows: list[tuple[str, list[str]]] = []
    for kind in kinds:
        parts = [s.by_kind.get(kind) for s in summaries]
        rows.append((f"{kind}: completed", ["-" if p is None else str(p.completed) for p in parts]))
        for label, attr in (("TTFT", "ttft_s"), ("TPOT", "tpot_s")):
            for stat in PERCENTILES:
                values = [_cell(None if p is None else getattr(p, attr), stat, 1000) for p in parts]
                rows.append((f"{kind}: {label} {stat} (ms)", values))
    return _table("kind: metric", summaries, rows)


def _table(corner: str, summaries: Sequence[Summary], rows: Sequence[tuple[str, list[str]]]) -> str:
    lines = [f"| {corner} | " + " | ".join(s.system for s in summaries) + " |", "|---|" + "---:|" * len(summaries)]
    lines += [f"| {label} | " + " | ".join(values) + " |" for label, values in rows]
    return "\n".join(lines)


def _cell(dist: Distribution | None, stat: str, scale: float) -> str:
    return "-" if dist is None else _fmt(getattr(dist, stat) * scale)


def _dist(values: Sequence[float | None]) -> Distribution | None:
    return Distribution.of([v for v in values if v is not None])


def _fmt(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


# ---- a rate sweep -----------------------------------------------------------------------------------

CAPACITY_ATTAINMENT = 0.9  # a rate sweep's goodput: the highest rate with this SLO attainment (DistServe's 90%)


def capacity(summaries: Sequence[Summary], target: float = CAPACITY_ATTAINMENT) -> float | None:
    """DistServe's goodput of one system over a rate sweep: the highest rate whose SLO attainment (both SLOs)
    is at least ``target``, where every lower rate's also was; None when even the lowest misses it."""
    best = None
    for s in summaries:
        if s.slo is None or s.rate is None or s.slo.num_requests == 0 or s.slo.met_both / s.slo.num_requests < target:
            break
        best = s.rate
    return best


def capacities(summaries: Sequence[Summary]) -> dict[str, float | None]:
    """Per system (and front), its goodput over the rate sweep (``capacity``); empty without a sweep."""
    by_system: dict[str, list[Summary]] = {}
    for s in summaries:
        if s.rate is not None:
            by_system.setdefault(_swept_system(s), []).append(s)
    if all(len(runs) < 2 for runs in by_system.values()):
        return {}
    return {name: capacity(sorted(runs, key=lambda s: s.rate or 0.0)) for name, runs in by_system.items()}


def capacity_table(summaries: Sequence[Summary], caps: Mapping[str, float | None]) -> str:
    """The sweep at a glance: each system's goodput at each rate, and its highest rate meeting the target."""
    rates = sorted({s.rate for s in summaries if s.rate is not None})
    goodput = {(_swept_system(s), s.rate): s.slo.goodput for s in summaries if s.slo is not None}
    attained = {(_swept_system(s), s.rate): 100 * s.slo.met_both / s.slo.num_requests
                for s in summaries if s.slo is not None and s.slo.num_requests}
    head = ["system", *[f"goodput @ {r:g}/s (attainment)" for r in rates],
            f"highest rate with >= {CAPACITY_ATTAINMENT:.0%} attainment"]
    rows = [[name, *[f"{goodput[name, r]:.3f} ({attained[name, r]:.0f}%)" if (name, r) in goodput else "-"
                     for r in rates], "none of these" if cap is None else f"{cap:g} requests/s"]
            for name, cap in caps.items()]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _swept_system(summary: Summary) -> str:
    """A sweep column's system (and front): its name without bench_serve.column_name's " @ R/s"."""
    return summary.system.split(" @ ")[0]
