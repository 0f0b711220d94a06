"""Prometheus metrics of each service, named after vLLM's (``vllm:`` -> ``tandem:``) so dashboards translate.

Every series carries a ``node`` label (``gateway``, ``prefill-0``, ``decode-1``...). Each service owns one
registry; ``serve_metrics`` exposes it on ``http://<host>:<metrics_port>/metrics``.

Who records what:

- the gateway: what its client sees (time to first token, end to end, queue, time per output token, tokens,
  requests in flight, successes by finish reason, failures by status);
- prefill nodes: node-level time to first token, queue and prefill time, KV bytes/seconds sent;
- decode nodes: inter-token latency per engine step, end to end, time waiting for KV, KV bytes/seconds
  received, successes by finish reason;
- both nodes, read from the engine on scrape (``EngineCollector``): running / waiting requests, KV-cache
  usage, prefix-cache queries and hits, preemptions, speculative-decoding counters.

Servicers observe at the edges (once per request, once per engine step); the engine loop itself records
nothing here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.errors import AddressInUseError

if TYPE_CHECKING:
    import threading
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger(__name__)

PREFIX = "tandem:"

# vLLM's buckets, with sub-10 ms ones added where a small model on a fast device lands.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state at scrape time; counters are cumulative since the engine started."""

    num_running: int
    num_waiting: int  # queued, plus (decode) reserved and waiting for their KV
    kv_cache_usage: float  # fraction of KV blocks held by requests, in [0, 1] (vLLM's kv_cache_usage_perc)
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found cached
    num_preemptions: int
    spec_num_drafts: int = 0  # request-steps that verified at least one draft
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    num_steps: int = 0  # engine forwards
    step_seconds: float = 0.0  # their time
    step_prefill_tokens: int = 0  # prompt tokens they computed
    step_decode_tokens: int = 0  # decode tokens (draft slots included) they computed
    offload_hits: int = 0  # prompt tokens restored from the KV offload tier (a part of prefix_cache_hits)
    offload_blocks: int = 0  # blocks the offload tier holds


class EngineCounters(Protocol):
    """What ``snapshot_of`` reads: an ``EngineStats`` (common.engine.engine_core) satisfies it."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def used_blocks(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def prefix_cache_queries(self) -> int: ...

    @property
    def prefix_cache_hits(self) -> int: ...

    @property
    def num_preemptions(self) -> int: ...

    @property
    def num_steps(self) -> int: ...

    @property
    def step_seconds(self) -> float: ...

    @property
    def step_prefill_tokens(self) -> int: ...

    @property
    def step_decode_tokens(self) -> int: ...

    @property
    def offload_hits(self) -> int: ...

    @property
    def offload_blocks(self) -> int: ...


class SpecCounters(Protocol):
    """The scheduler's speculative-decoding counters."""

    @property
    def num_spec_steps(self) -> int: ...

    @property
    def num_draft_tokens(self) -> int: ...

    @property
    def num_accepted_tokens(self) -> int: ...


def snapshot_of(stats: EngineCounters, spec: SpecCounters | None = None) -> EngineSnapshot:
    return EngineSnapshot(
        num_running=stats.num_running, num_waiting=stats.num_waiting,
        kv_cache_usage=stats.used_blocks / stats.num_blocks if stats.num_blocks else 0.0,
        prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
        num_preemptions=stats.num_preemptions,
        num_steps=stats.num_steps, step_seconds=stats.step_seconds,
        step_prefill_tokens=stats.step_prefill_tokens, step_decode_tokens=stats.step_decode_tokens,
        offload_hits=stats.offload_hits, offload_blocks=stats.offload_blocks,
        spec_num_drafts=spec.num_spec_steps if spec else 0,
        spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
        spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
    )


class EngineCollector(Collector):
    """Reads an ``EngineSnapshot`` when scraped, so the engine thread does no metrics work at all."""

    def __init__(self, node: str, snapshot: Callable[[], EngineSnapshot], speculative: bool,
                 skip: frozenset[str] = frozenset()) -> None:
        """``skip``: series (names without the prefix) that the registry has from elsewhere already."""
        self._node = node
        self._snapshot = snapshot
        self._speculative = speculative
        self._skip = skip

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        try:
            snap = self._snapshot()
        except Exception:  # a scrape must not take the service down
            log.exception("engine snapshot failed")
            return iter(())
        return self._families(snap)

    def _families(self, s: EngineSnapshot | None) -> Iterator[Metric]:
        labels = [self._node]
        rows: list[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str, float]] = [
            (GaugeMetricFamily, "num_requests_running", "Requests in the engine's running batch.",
             s.num_running if s else 0),
            (GaugeMetricFamily, "num_requests_waiting", "Requests queued for compute (decode: or for their KV).",
             s.num_waiting if s else 0),
            (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
             s.kv_cache_usage if s else 0),
            (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries if s else 0),
            (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             s.prefix_cache_hits if s else 0),
            (CounterMetricFamily, "kv_offload_hits",
             "Prompt tokens restored from the KV offload tier (--kv-offload; a part of prefix_cache_hits).",
             s.offload_hits if s else 0),
            (GaugeMetricFamily, "kv_offload_blocks", "KV blocks the offload tier holds.",
             s.offload_blocks if s else 0),
            (CounterMetricFamily, "num_preemptions", "Requests preempted (recomputed) because blocks ran out.",
             s.num_preemptions if s else 0),
            # Mean step time and size between two scrapes: d(seconds) / d(steps), d(tokens) / d(steps).
            (CounterMetricFamily, "engine_steps", "Engine steps that ran the model (forward and sampling).",
             s.num_steps if s else 0),
            (CounterMetricFamily, "engine_step_seconds", "Time in those steps' forward and sampling.",
             s.step_seconds if s else 0),
            (CounterMetricFamily, "engine_step_prefill_tokens", "Prompt tokens computed by those steps.",
             s.step_prefill_tokens if s else 0),
            (CounterMetricFamily, "engine_step_decode_tokens",
             "Decode tokens (speculative draft slots included) computed by those steps.",
             s.step_decode_tokens if s else 0),
        ]
        if self._speculative:
            rows += [
                (CounterMetricFamily, "spec_decode_num_drafts", "Request-steps that verified speculative drafts.",
                 s.spec_num_drafts if s else 0),
                (CounterMetricFamily, "spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                 s.spec_num_draft_tokens if s else 0),
                (CounterMetricFamily, "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 s.spec_num_accepted_tokens if s else 0),
            ]
        for family_cls, name, doc, value in rows:
            if name in self._skip:
                continue
            family = family_cls(PREFIX + name, doc, labels=["node"])
            if s is not None:
                family.add_metric(labels, value)
            yield family


class ServiceMetrics:
    """One service's registry (its own ``process_*`` series included); every series bound to ``node``."""

    def __init__(self, node: str, registry: CollectorRegistry | None = None) -> None:
        self.node = node
        self.registry = registry if registry is not None else CollectorRegistry()
        prometheus_client.ProcessCollector(registry=self.registry)
        prometheus_client.GCCollector(registry=self.registry)

    def add_engine(self, snapshot: Callable[[], EngineSnapshot], speculative: bool = False,
                   skip: frozenset[str] = frozenset()) -> None:
        self.registry.register(EngineCollector(self.node, snapshot, speculative, skip))

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, doc, ["node"], buckets=buckets, registry=self.registry).labels(self.node)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, ["node"], registry=self.registry).labels(self.node)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, ["node"], registry=self.registry).labels(self.node)


class GatewayMetrics(ServiceMetrics):
    """What clients see, measured at the gateway."""

    def __init__(self, node: str = "gateway", registry: CollectorRegistry | None = None) -> None:
        super().__init__(node, registry)
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "Gateway admission to the first token sent to the client.", TTFT_BUCKETS)
        self.e2e_request_latency = self._histogram(
            "e2e_request_latency_seconds", "Gateway admission to the last token.", REQUEST_BUCKETS)
        self.request_queue_time = self._histogram(
            "request_queue_time_seconds", "Gateway admission to the start of the prefill compute.", TTFT_BUCKETS)
        self.time_per_output_token = self._histogram(
            "request_time_per_output_token_seconds", "Per request: (e2e - TTFT) / (completion tokens - 1).",
            ITL_BUCKETS)
        self.num_requests_running = self._gauge("num_requests_running", "Generate calls in progress.")
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated for finished requests.")
        self._success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                ["node", "finish_reason"], registry=self.registry)
        self._failure = Counter(PREFIX + "request_failure", "Requests that ended with an error status, by status.",
                                ["node", "code"], registry=self.registry)
        self._migrations = Counter(PREFIX + "request_migrations", "Requests continued on other nodes after a node "
                                   "was lost under them, by the lost node's role.", ["node", "role"],
                                   registry=self.registry)
        # gateway.kv_index: the prefix index kept from the nodes' KV events (peer: the node's address)
        self._kv_index_blocks = Gauge(PREFIX + "kv_index_blocks", "Blocks the gateway's prefix index holds for a "
                                      "node.", ["node", "peer"], registry=self.registry)
        self._kv_index_drift = Gauge(PREFIX + "kv_index_drift_blocks", "Blocks the prefix index's view of a node "
                                     "differs by from the node's own digest at the last batch (0: exact).",
                                     ["node", "peer"], registry=self.registry)
        self._kv_index_resyncs = Counter(PREFIX + "kv_index_resyncs", "Times the prefix index healed a node's view "
                                         "by replay or snapshot, by reason (gap, restart, dropped, drift, "
                                         "disconnect).", ["node", "peer", "reason"], registry=self.registry)

    def request_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, ttft_s: float,
                         e2e_s: float, queue_s: float) -> None:
        self._success.labels(self.node, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.time_to_first_token.observe(ttft_s)
        self.e2e_request_latency.observe(e2e_s)
        self.request_queue_time.observe(queue_s)
        if completion_tokens > 1:
            self.time_per_output_token.observe((e2e_s - ttft_s) / (completion_tokens - 1))

    def request_failed(self, code: str) -> None:
        self._failure.labels(self.node, code).inc()

    def request_migrated(self, role: str) -> None:
        """A request lost its ``role`` node (prefill or decode) and continues on another."""
        self._migrations.labels(self.node, role).inc()

    def kv_index_checked(self, peer: str, num_blocks: int, drift: int) -> None:
        """The prefix index's view of node ``peer`` after a batch: its blocks and its drift from the node's digest."""
        self._kv_index_blocks.labels(self.node, peer).set(num_blocks)
        self._kv_index_drift.labels(self.node, peer).set(drift)

    def kv_index_resynced(self, peer: str, reason: str) -> None:
        self._kv_index_resyncs.labels(self.node, peer, reason).inc()

    def kv_index_forgot(self, peer: str) -> None:
        """Node ``peer`` left: its series go with its entries."""
        for gauge in (self._kv_index_blocks, self._kv_index_drift):
            with contextlib.suppress(KeyError):
                gauge.remove(self.node, peer)


class _TransferMetrics(ServiceMetrics):
    def __init__(self, node: str, registry: CollectorRegistry | None, direction: str) -> None:
        super().__init__(node, registry)
        self.kv_transfer_bytes = self._counter("kv_transfer_bytes", f"KV-cache bytes {direction}.")
        self.kv_transfer_seconds = self._histogram(
            "kv_transfer_seconds", f"Duration of one request's KV transfer ({direction}).", TRANSFER_BUCKETS)
        self.kv_transfer_failures = self._counter("kv_transfer_failures", "KV transfers that failed or timed out.")

    def transfer_done(self, num_bytes: int, seconds: float) -> None:
        self.kv_transfer_bytes.inc(num_bytes)
        self.kv_transfer_seconds.observe(seconds)


class PrefillMetrics(_TransferMetrics):
    def __init__(self, node: str, registry: CollectorRegistry | None = None) -> None:
        super().__init__(node, registry, "sent to decode nodes")
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "Prefill RPC arrival to the first token sampled.", TTFT_BUCKETS)
        self.request_queue_time = self._histogram(
            "request_queue_time_seconds", "Prefill RPC arrival to the request's first scheduled step.", TTFT_BUCKETS)
        self.request_prefill_time = self._histogram(
            "request_prefill_time_seconds", "First scheduled step to the first token sampled.", TTFT_BUCKETS)

    def add_lending(self, layers: Callable[[], tuple[int, int]]) -> None:
        """``tandem:prefill_layers{cpus=own|borrowed}``: decoder layers this node ran on its own CPUs, and on its
        own plus an idle decode node's (core lending: common/engine/core_lending.py); ``layers`` reads both."""
        self.registry.register(_LendingCollector(self.node, layers))


class _LendingCollector(Collector):
    def __init__(self, node: str, layers: Callable[[], tuple[int, int]]) -> None:
        self._node, self._layers = node, layers

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(PREFIX + "prefill_layers", "Decoder layers run, on the node's own CPUs or on "
                                     "them and an idle decode node's (core lending).", labels=["node", "cpus"])
        borrowed, own = self._layers()
        family.add_metric([self._node, "borrowed"], borrowed)
        family.add_metric([self._node, "own"], own)
        yield family


class DecodeMetrics(_TransferMetrics):
    def __init__(self, node: str, registry: CollectorRegistry | None = None) -> None:
        super().__init__(node, registry, "received from prefill nodes")
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Time between a request's consecutive engine outputs.", ITL_BUCKETS)
        self.e2e_request_latency = self._histogram(
            "e2e_request_latency_seconds", "Decode Generate call to the request's last token.", REQUEST_BUCKETS)
        self.kv_wait_time = self._histogram(
            "request_kv_wait_seconds", "Reservation sent to the prompt's KV landed (includes the prefill).",
            REQUEST_BUCKETS)
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated (the first token included).")
        self._success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                ["node", "finish_reason"], registry=self.registry)

    def request_finished(self, finish_reason: str, e2e_s: float) -> None:
        self._success.labels(self.node, finish_reason).inc()
        self.e2e_request_latency.observe(e2e_s)


@dataclass
class MetricsServer:
    """The ``/metrics`` HTTP endpoint of one service (a daemon thread)."""

    httpd: WSGIServer
    thread: threading.Thread
    host: str
    port: int

    def close(self) -> None:
        self.httpd.shutdown()  # waits for serve_forever's poll loop (up to 0.5 s)
        self.httpd.server_close()

    async def stop(self) -> None:
        """``close`` off the event loop: a shutdown hook for ``RunningServer``."""
        await asyncio.to_thread(self.close)


def serve_metrics(metrics: ServiceMetrics, host: str, port: int) -> MetricsServer:
    """Expose ``metrics`` on ``http://host:port/metrics`` (any path answers; Prometheus asks for /metrics)."""
    prometheus_client.disable_created_metrics()  # the *_created series double the output for no dashboard
    try:
        httpd, thread = prometheus_client.start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as exc:
        raise AddressInUseError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    log.info("metrics on http://%s:%d/metrics", host, port)
    return MetricsServer(httpd, thread, host, port)
