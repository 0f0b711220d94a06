"""common.serving.server: health, graceful stop, waiting for health, port conflicts; GatewaySettings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from scripted_nodes import run_async

from common.config.settings import load_settings
from common.serving.channel import open_channel
from common.serving.server import start_server, wait_for_health
from gateway.settings import GatewaySettings


def _slow_service(release: asyncio.Event) -> Any:
    async def run(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield b"started"
        await release.wait()
        yield b"done"

    def add(server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "test.Slow", {"Run": grpc.unary_stream_rpc_method_handler(run)}),))

    return add


def test_graceful_stop_drains_in_flight_calls_and_refuses_new_ones() -> None:
    async def scenario() -> None:
        release = asyncio.Event()
        server = await start_server([_slow_service(release)], ["test.Slow"], "127.0.0.1", 0)
        hooks: list[str] = []

        async def hook() -> None:
            hooks.append("closed")

        server.add_shutdown_hook(hook)
        await wait_for_health(server.address, timeout_s=5, service="test.Slow")
        async with open_channel(server.address) as channel:
            call = channel.unary_stream("/test.Slow/Run")(b"")
            assert await call.read() == b"started"
            stopping = asyncio.create_task(server.stop(grace_s=5))
            await asyncio.sleep(0.1)
            health = health_pb2_grpc.HealthStub(channel)
            # Stopped accepting: even health is refused now; the in-flight call goes on.
            with pytest.raises(grpc.aio.AioRpcError):
                await health.Check(health_pb2.HealthCheckRequest(service="test.Slow"), timeout=1)
            assert not stopping.done()
            release.set()
            assert await call.read() == b"done"
            await stopping
            assert hooks == ["closed"]
            await server.stop(0)  # idempotent

    run_async(scenario())


def test_grace_expiry_cancels_what_is_left() -> None:
    async def scenario() -> None:
        server = await start_server([_slow_service(asyncio.Event())], ["test.Slow"], "127.0.0.1", 0)
        async with open_channel(server.address) as channel:
            call = channel.unary_stream("/test.Slow/Run")(b"")
            assert await call.read() == b"started"
            await server.stop(grace_s=0.2)
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()

    run_async(scenario())


def test_port_conflict_fails_loudly_and_health_wait_times_out() -> None:
    async def scenario() -> None:
        server = await start_server([], [], "127.0.0.1", 0)
        try:
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{server.port}"):
                await start_server([], [], "127.0.0.1", server.port)
            await server.set_serving(False)
            with pytest.raises(TimeoutError, match="NOT_SERVING"):
                await wait_for_health(server.address, timeout_s=0.3)
        finally:
            await server.stop(0)

    run_async(scenario())


def test_gateway_settings_from_env(tmp_path: Path) -> None:
    env = {"TANDEM_MODEL_DIR": str(tmp_path), "TANDEM_PREFILL_TARGETS": "127.0.0.1:7001, 127.0.0.1:7002",
           "TANDEM_DECODE_TARGETS": "127.0.0.1:7101", "TANDEM_MAX_INFLIGHT": "8"}
    s = load_settings(GatewaySettings, {"port": 0}, environ=env)
    assert s.model_dir == tmp_path and s.served_model_name == tmp_path.name
    assert s.prefill_targets == ("127.0.0.1:7001", "127.0.0.1:7002") and s.decode_targets == ("127.0.0.1:7101",)
    assert (s.max_inflight, s.port, s.host, s.address) == (8, 0, "127.0.0.1", "127.0.0.1:0")
    with pytest.raises(ValueError, match="TANDEM_PREFILL_TARGETS"):
        load_settings(GatewaySettings, environ={**env, "TANDEM_PREFILL_TARGETS": ""})
    with pytest.raises(ValueError, match="not host:port"):
        load_settings(GatewaySettings, environ={**env, "TANDEM_DECODE_TARGETS": "localhost"})
    with pytest.raises(ValueError, match="model_dir is required"):
        GatewaySettings(prefill_targets=("a:1",), decode_targets=("b:2",))
