"""Start a prefill node: model, prefill engine in its own thread, KV sender, gRPC server."""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from common.config.settings import ModelSettings, NodeSettings, SecuritySettings, parse_cpus
from common.engine.async_engine import AsyncEngine
from common.engine.core_lending import ActivityView, CoreBorrower, check_lending_role
from common.engine.engine_core import EngineCore
from common.engine.model_runner import kv_cache_spec
from common.engine.node_setup import engine_configs, load_node_model, prepare_kernels
from common.serving.channel import format_address
from common.serving.registrar import register_node
from common.serving.security import ChannelFactory, internal_auth, server_credentials
from common.serving.server import RunningServer, serve_until_signal, start_server
from common.serving.status import StatusInterceptor
from common.telemetry.metrics import PrefillMetrics, serve_metrics, snapshot_of
from kv_transfer.errors import TransferFailed
from kv_transfer.layout import make_layout, model_fingerprint
from kv_transfer.sender import KVSender
from prefill_service.kv_producer import KVProducer
from prefill_service.servicer import PrefillServicer
from tandem.v1 import membership_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)

PREFILL_SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


async def serve_prefill(model_settings: ModelSettings, node: NodeSettings,
                        security: SecuritySettings | None = None) -> RunningServer:
    security = security or SecuritySettings()
    credentials = server_credentials(security, internal=True)  # fails fast on a bad TLS setup, before the model loads
    check_lending_role("prefill", node, model_settings)
    borrower = None
    if node.borrow_cpus:
        import torch  # noqa: F401 - loads libgomp while this thread may run on both sets: it counts them

        borrower = CoreBorrower.adopt(parse_cpus(node.borrow_cpus),
                                      [ActivityView(path) for path in node.borrow_from.split(",") if path])
    loaded = load_node_model(model_settings)
    if borrower is not None:
        loaded.model.layer_threads = borrower
        log.info("prefill layers run on CPUs %s, and on %s too while %s say idle", sorted(borrower.own),
                 sorted(borrower.borrowed), node.borrow_from)
    cache, scheduler = engine_configs(node, model_settings.device)
    core = EngineCore(loaded.model, cache, scheduler, connector=KVProducer(cache.block_size),
                      parallel=loaded.parallel)
    engine = AsyncEngine(core, name="prefill-engine")
    await prepare_kernels(model_settings, engine, decode=False)
    layout = make_layout(kv_cache_spec(loaded.model, node.block_size), loaded.name, model_fingerprint(loaded.model_dir))
    node_id = node.node_id or f"prefill-{node.port}"
    sender = KVSender(core.runner.kv_cache, layout, node_id, group_timeout_s=node.kv_timeout_s,
                      transport=node.kv_transport, open_channel=ChannelFactory(security), host_identity=node.host_id)
    status = StatusInterceptor(extra={TransferFailed: grpc.StatusCode.UNAVAILABLE})
    metrics = PrefillMetrics(node_id)
    # Read on scrape from the HTTP thread: O(1) reads of lengths and counters, atomic under the GIL.
    metrics.add_engine(lambda: snapshot_of(core.stats()))
    if borrower is not None:
        metrics.add_lending(borrower.layer_counts)  # read on scrape: two ints the engine thread counts up
    servicer = PrefillServicer(engine, sender, node_id, node.kv_timeout_s, metrics, status.status_for)
    metrics_server = serve_metrics(metrics, node.host, node.metrics_port) if node.metrics_port else None
    try:
        running = await start_server(
            [lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, s)],
            [PREFILL_SERVICE],
            node.host, node.port, interceptors=[*internal_auth(security, [PREFILL_SERVICE]), status],
            credentials=credentials,
        )
    except BaseException:
        if metrics_server is not None:
            metrics_server.close()
        raise

    async def shutdown() -> None:
        await sender.close()
        engine.shutdown()
        if borrower is not None:
            borrower.close()
            borrowed, own = borrower.layer_counts()
            log.info("core lending: %d of %d prefill layers ran on borrowed CPUs too", borrowed, borrowed + own)
        if metrics_server is not None:
            await metrics_server.stop()

    running.add_shutdown_hook(shutdown)
    running.engine = engine
    if node.gateway:  # live membership: join the gateway's routing now that the node serves
        stats = core.stats()
        info = membership_pb2.NodeInfo(
            node_id=node_id, role="prefill", address=format_address(node.advertise_host or node.host, running.port),
            model=loaded.name, tensor_parallel_size=model_settings.tensor_parallel_size,
            pipeline_parallel_size=model_settings.pipeline_parallel_size, kv_endpoint="",
            num_blocks=stats.num_blocks, block_size=stats.block_size, incarnation=uuid.uuid4().hex)
        register_node(running, info, node.gateway, node.register_interval_s, ChannelFactory(security))
    log.info("prefill node %s serving on %s", node_id, running.address)
    return running


def run_prefill(model_settings: ModelSettings, node: NodeSettings, security: SecuritySettings | None = None) -> None:
    async def main() -> None:
        running = await serve_prefill(model_settings, node, security)
        print(f"prefill node listening on {running.address}", flush=True)
        await serve_until_signal(running, node.grace_s)

    asyncio.run(main())
