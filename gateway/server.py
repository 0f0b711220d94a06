"""Start the gateway: load the tokenizer, connect to the nodes, serve ``tandem.v1.Tandem`` (and the
OpenAI-compatible HTTP API when ``http_port`` is set), both fronts over one ``RequestRunner``."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from common.config.settings import SecuritySettings
from common.serving.security import (
    TokenAuthInterceptor,
    channel_credentials,
    internal_auth,
    server_credentials,
    token_interceptors,
)
from common.serving.server import RunningServer, serve_until_signal, start_server
from common.serving.status import StatusInterceptor
from common.telemetry.metrics import EngineSnapshot, GatewayMetrics, serve_metrics
from common.telemetry.propagation import client_interceptors
from gateway.backend import GenerateBackend
from gateway.coordinator import Coordinator
from gateway.http_api import HttpApi, Readiness
from gateway.http_server import HttpServer
from gateway.kv_event_merger import KvEventMerger, KvIndexSync
from gateway.kv_index import KvIndex
from gateway.membership import SERVICE_NAME as MEMBERSHIP_SERVICE
from gateway.membership import MembershipServicer
from gateway.model import ServedModel
from gateway.node_pool import NodePool
from gateway.prefill_policy import LocalPrefillPolicy
from gateway.request_runner import RequestRunner
from gateway.router import Router
from gateway.servicer import SERVICE_NAME, KvEventsSource, LoadsSource, TandemServicer
from gateway.settings import GatewaySettings
from tandem.v1 import generate_pb2_grpc, membership_pb2_grpc

log = logging.getLogger(__name__)


async def serve_gateway(settings: GatewaySettings, model: ServedModel | None = None,
                        security: SecuritySettings | None = None) -> RunningServer:
    """Start the gateway (health, reflection, status interceptor) and return it running.

    ``model`` lets a caller that already loaded the tokenizer (tests, an in-process launcher) share it.
    ``security``: TLS on the public port and to the nodes, and the cluster token sent to them.
    Stopping the returned server also stops the stats poller and closes the node channels. With
    ``settings.internal_port``, the Membership service (gateway/membership.py) listens there, guarded like
    the nodes' internal services; ``running.internal_address`` is its address.
    """
    security = security or SecuritySettings()
    if model is None:
        assert settings.model_dir is not None  # GatewaySettings guarantees it
        model = ServedModel.load(settings.model_dir, settings.served_model_name, settings.max_model_len,
                                 settings.dtype)
    router = Router(settings.prefill_targets, settings.decode_targets, settings.affinity_capacity,
                    settings.affinity_load_slack)
    pool = NodePool(router, settings.stats_interval_s,
                    interceptors=[*client_interceptors(), *token_interceptors(security.internal_token)],
                    credentials=channel_credentials(security), drop_after_s=settings.node_drop_after_s,
                    close_grace_s=settings.request_timeout_s)
    await pool.start()
    metrics = GatewayMetrics()
    coordinator = Coordinator(model, router, pool, settings.kv_timeout_s,
                              LocalPrefillPolicy(max_tokens=settings.local_prefill_max_tokens),
                              recompute_on_kv_failure=settings.kv_load_failure_policy == "recompute",
                              migration_limit=settings.migration_limit, metrics=metrics)
    try:
        running = await serve_fronts(model, coordinator, settings, router=router, metrics=metrics,
                                     readiness=lambda: _readiness(router), security=security,
                                     kv_events=KvEventMerger(pool.kv_event_streams).subscribe)
    except BaseException:
        await pool.close()
        raise
    running.add_shutdown_hook(pool.close)
    index = KvIndex()
    router.cache_index = index  # routing reads what the nodes say they cache, beside its own records
    kv_index = KvIndexSync(index, pool.kv_event_streams, metrics)  # exact per node, drift reported
    kv_index.start()
    running.kv_index = kv_index
    running.add_shutdown_hook(kv_index.stop)  # runs before the node channels close
    if settings.internal_port:
        try:
            model_name = settings.model_dir.name if settings.model_dir else ""
            membership = MembershipServicer(pool, router, settings.stats_interval_s, model_name)
            internal = await serve_membership(membership, settings, security)
        except BaseException:
            await running.stop(0)
            raise
        running.internal_address = internal.address
        running.add_shutdown_hook(functools.partial(internal.stop, 0))  # runs before the node channels close
    return running


async def serve_membership(servicer: MembershipServicer, settings: GatewaySettings,
                           security: SecuritySettings) -> RunningServer:
    """The gateway's internal port: Membership, with the cluster's mutual TLS and token (docs/security.md)."""
    return await start_server([functools.partial(membership_pb2_grpc.add_MembershipServicer_to_server, servicer)],
                              [MEMBERSHIP_SERVICE], settings.host, settings.internal_port,
                              interceptors=[*internal_auth(security, [MEMBERSHIP_SERVICE]), StatusInterceptor()],
                              credentials=server_credentials(security, internal=True))


async def serve_fronts(model: ServedModel, backend: GenerateBackend, settings: GatewaySettings,
                       router: Router | None = None, loads: LoadsSource | None = None,
                       readiness: Readiness | None = None, security: SecuritySettings | None = None,
                       kv_events: KvEventsSource | None = None,
                       engine_snapshot: Callable[[], EngineSnapshot] | None = None,
                       metrics: GatewayMetrics | None = None) -> RunningServer:
    """Serve the public fronts over ``backend``: gRPC on ``settings.port``, HTTP on ``settings.http_port``
    (when set), /metrics on ``settings.metrics_port`` (when set; with ``engine_snapshot``, the engine's
    series too; ``metrics``: the series the backend records too, such as the coordinator's migrations).
    The gateway and the colocated server
    both start here; stopping the returned server stops all three.

    Both fronts take TLS from ``security`` (``tls_cert``/``tls_key``; no client certificates: the public
    API's callers authenticate with ``settings.api_key``, checked once per front).
    """
    security = security or SecuritySettings()
    credentials = server_credentials(security, internal=False)
    status = StatusInterceptor()
    # The API key guards the Tandem service only: health checking and reflection stay open.
    auth = [TokenAuthInterceptor(settings.api_key, [SERVICE_NAME], "API key")] if settings.api_key else []
    metrics = metrics or GatewayMetrics()
    if engine_snapshot is not None:  # the colocated server: its engine's series beside the gateway's
        metrics.add_engine(engine_snapshot, skip=frozenset({"num_requests_running"}))  # the gateway's own
    runner = RequestRunner(model, backend, settings, metrics, status.status_for)
    servicer = TandemServicer(runner, router, loads, kv_events)
    metrics_server = http = None
    try:
        if settings.metrics_port:
            metrics_server = serve_metrics(metrics, settings.host, settings.metrics_port)
        if settings.http_port:
            tls = (security.tls_cert, security.tls_key) if security.tls_cert and security.tls_key else None
            http = await HttpServer.start(HttpApi(runner, readiness, settings.api_key).app, settings.host,
                                          settings.http_port, settings.shutdown_grace_s, tls)
        running = await start_server([functools.partial(generate_pb2_grpc.add_TandemServicer_to_server, servicer)],
                                     [SERVICE_NAME], settings.host, settings.port, interceptors=[*auth, status],
                                     credentials=credentials)
    except BaseException:
        if metrics_server is not None:
            metrics_server.close()
        if http is not None:
            await http.stop()
        raise
    if metrics_server is not None:
        running.add_shutdown_hook(metrics_server.stop)
    if http is not None:
        running.http_url = http.url
        running.add_shutdown_hook(http.stop)  # hooks run last-first: HTTP stops before the node channels close
    return running


def _readiness(router: Router) -> str | None:
    """GET /health: 503 while no prefill or no decode node is reachable."""
    for role, nodes in (("prefill", router.prefill), ("decode", router.decode)):
        if not any(n.reachable for n in nodes.values()):
            return f"no reachable {role} node"
    return None


def run_gateway(settings: GatewaySettings, security: SecuritySettings | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then drain in-flight streams for ``shutdown_grace_s`` and exit."""

    async def main() -> None:
        running = await serve_gateway(settings, security=security)
        log.info("gateway for %s on %s -> prefill %s, decode %s", settings.served_model_name, running.address,
                 ", ".join(settings.prefill_targets) or "(registered only)",
                 ", ".join(settings.decode_targets) or "(registered only)")
        if running.http_url:
            log.info("OpenAI-compatible HTTP API on %s/v1", running.http_url)
        if running.internal_address:
            log.info("nodes register (and `tandem drain` calls) on %s", running.internal_address)
        await serve_until_signal(running, settings.shutdown_grace_s)

    asyncio.run(main())
