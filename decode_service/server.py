"""Start a decode node: model, decode engine in its own thread, KV receiver, gRPC server."""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from common.config.engine_config import SpeculativeConfig
from common.config.settings import ModelSettings, NodeSettings, SecuritySettings
from common.engine.async_engine import AsyncEngine
from common.engine.core_lending import ActivityFile, check_lending_role
from common.engine.engine_core import EngineCore
from common.engine.model_runner import kv_cache_spec
from common.engine.node_setup import engine_configs, load_draft_model, load_node_model, prepare_kernels
from common.serving.channel import format_address
from common.serving.registrar import register_node
from common.serving.security import ChannelFactory, internal_auth, server_credentials
from common.serving.server import RunningServer, serve_until_signal, start_server
from common.serving.status import StatusInterceptor
from common.telemetry.metrics import DecodeMetrics, serve_metrics, snapshot_of
from decode_service.kv_consumer import KVConsumer
from decode_service.servicer import DecodeServicer
from kv_transfer.errors import TransferFailed
from kv_transfer.layout import make_layout, model_fingerprint
from kv_transfer.receiver import KVReceiver
from tandem.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, membership_pb2

log = logging.getLogger(__name__)

INTERNAL_SERVICES = (decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name,
                     kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name)


async def serve_decode(model_settings: ModelSettings, node: NodeSettings,
                       speculative: SpeculativeConfig | None = None,
                       security: SecuritySettings | None = None) -> RunningServer:
    security = security or SecuritySettings()
    credentials = server_credentials(security, internal=True)  # fails fast on a bad TLS setup, before the model loads
    check_lending_role("decode", node, model_settings)
    loaded = load_node_model(model_settings)
    cache, scheduler = engine_configs(node, model_settings.device)
    consumer = KVConsumer()
    core = EngineCore(loaded.model, cache, scheduler, speculative=speculative, connector=consumer,
                      draft_model=load_draft_model(speculative, model_settings, loaded.model_dir),
                      parallel=loaded.parallel)
    activity = ActivityFile(node.activity_file) if node.activity_file else None
    engine = AsyncEngine(core, name="decode-engine", activity=activity)
    await prepare_kernels(model_settings, engine)
    layout = make_layout(kv_cache_spec(loaded.model, node.block_size), loaded.name, model_fingerprint(loaded.model_dir))
    node_id = node.node_id or f"decode-{node.port}"
    # Same-host transport: the receiver moves the KV tensor into shared memory (before the engine's first step).
    receiver = KVReceiver(core.runner.kv_cache, layout, node_id, host=node.host, store_port=node.kv_store_port,
                          group_timeout_s=node.kv_timeout_s, transport=node.kv_transport,
                          on_finished=consumer.load_finished, host_identity=node.host_id)
    # The KV endpoint is this very server (KVTransfer is registered beside Decode); with port 0 its
    # address is known only once bound, so it is filled in below.
    status = StatusInterceptor(extra={TransferFailed: grpc.StatusCode.UNAVAILABLE})
    metrics = DecodeMetrics(node_id)
    speculating = core.scheduler.speculative is not None
    # Read on scrape from the HTTP thread: O(1) reads of lengths and counters, atomic under the GIL.
    metrics.add_engine(lambda: snapshot_of(core.stats(), core.scheduler), speculative=speculating)
    servicer = DecodeServicer(engine, receiver, node_id, kv_endpoint="", kv_timeout_s=node.kv_timeout_s,
                              metrics=metrics, status_for=status.status_for, queue_timeout_s=node.queue_timeout_s)
    metrics_server = serve_metrics(metrics, node.host, node.metrics_port) if node.metrics_port else None
    try:
        running = await start_server(
            [lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, s), receiver.add_to_server],
            list(INTERNAL_SERVICES), node.host, node.port,
            interceptors=[*internal_auth(security, INTERNAL_SERVICES), status], credentials=credentials,
        )
    except BaseException:
        if metrics_server is not None:
            metrics_server.close()
        raise
    servicer.kv_endpoint = format_address(node.advertise_host or node.host, running.port)

    async def shutdown() -> None:
        await receiver.close()
        engine.shutdown()
        if metrics_server is not None:
            await metrics_server.stop()

    running.add_shutdown_hook(shutdown)
    running.engine = engine
    if node.gateway:  # live membership: join the gateway's routing now that the node serves
        stats = core.stats()
        info = membership_pb2.NodeInfo(
            node_id=node_id, role="decode", address=format_address(node.advertise_host or node.host, running.port),
            model=loaded.name, tensor_parallel_size=model_settings.tensor_parallel_size,
            pipeline_parallel_size=model_settings.pipeline_parallel_size, kv_endpoint=servicer.kv_endpoint,
            num_blocks=stats.num_blocks, block_size=stats.block_size, incarnation=uuid.uuid4().hex)
        register_node(running, info, node.gateway, node.register_interval_s, ChannelFactory(security))
    log.info("decode node %s serving on %s", node_id, running.address)
    return running


def run_decode(model_settings: ModelSettings, node: NodeSettings, speculative: SpeculativeConfig | None = None,
               security: SecuritySettings | None = None) -> None:
    async def main() -> None:
        running = await serve_decode(model_settings, node, speculative, security)
        print(f"decode node listening on {running.address}", flush=True)
        await serve_until_signal(running, node.grace_s)

    asyncio.run(main())
