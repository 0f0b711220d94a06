"""Start the gateway: load the tokenizer, connect to the nodes, serve ``tandem.v1.Tandem``."""

from __future__ import annotations

import asyncio
import functools
import logging

from common.serving.server import RunningServer, serve_until_signal, start_server
from common.serving.status import StatusInterceptor
from common.telemetry.metrics import GatewayMetrics, serve_metrics
from common.telemetry.propagation import client_interceptors
from gateway.coordinator import Coordinator
from gateway.model import ServedModel
from gateway.node_pool import NodePool
from gateway.router import Router
from gateway.servicer import SERVICE_NAME, TandemServicer
from gateway.settings import GatewaySettings
from tandem.v1 import generate_pb2_grpc

log = logging.getLogger(__name__)


async def serve_gateway(settings: GatewaySettings, model: ServedModel | None = None) -> RunningServer:
    """Start the gateway (health, reflection, status interceptor) and return it running.

    ``model`` lets a caller that already loaded the tokenizer (tests, an in-process launcher) share it.
    Stopping the returned server also stops the stats poller and closes the node channels.
    """
    if model is None:
        assert settings.model_dir is not None  # GatewaySettings guarantees it
        model = ServedModel.load(settings.model_dir, settings.served_model_name, settings.max_model_len,
                                 settings.dtype)
    router = Router(settings.prefill_targets, settings.decode_targets, settings.affinity_capacity,
                    settings.affinity_load_slack)
    pool = NodePool(router, settings.stats_interval_s, settings.block_size, interceptors=client_interceptors())
    await pool.start()
    coordinator = Coordinator(model, router, pool, settings.block_size, settings.kv_timeout_s)
    status = StatusInterceptor()
    metrics = GatewayMetrics()
    servicer = TandemServicer(model, coordinator, settings, metrics, status.status_for)
    metrics_server = None
    try:
        if settings.metrics_port:
            metrics_server = serve_metrics(metrics, settings.host, settings.metrics_port)
        running = await start_server([functools.partial(generate_pb2_grpc.add_TandemServicer_to_server, servicer)],
                                     [SERVICE_NAME], settings.host, settings.port, interceptors=[status])
    except BaseException:
        await pool.close()
        if metrics_server is not None:
            metrics_server.close()
        raise
    if metrics_server is not None:
        running.add_shutdown_hook(metrics_server.stop)
    running.add_shutdown_hook(pool.close)
    return running


def run_gateway(settings: GatewaySettings) -> None:
    """Serve until SIGINT/SIGTERM, then drain in-flight streams for ``shutdown_grace_s`` and exit."""

    async def main() -> None:
        running = await serve_gateway(settings)
        log.info("gateway for %s on %s -> prefill %s, decode %s", settings.served_model_name, running.address,
                 ", ".join(settings.prefill_targets), ", ".join(settings.decode_targets))
        await serve_until_signal(running, settings.shutdown_grace_s)

    asyncio.run(main())
