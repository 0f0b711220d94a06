"""common.serving.server: health, graceful stop, waiting for health, port conflicts; GatewaySettings."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from scripted_nodes import run_async

from common.config.settings import load_settings
from common.serving.channel import open_channel
from common.serving.server import SERVER_OPTIONS, UNREQUESTED_CALL_WAIT_S, start_server, wait_for_health
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


def _one_method(service: str,
                handler: Callable[[bytes, Any], AsyncIterator[bytes]]) -> Callable[[grpc.aio.Server], None]:
    """A servicer adder for ``start_server``: ``service``'s one streaming method ``Run``."""

    def add(server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            service, {"Run": grpc.unary_stream_rpc_method_handler(handler)}),))

    return add


def _calls_sent_while_the_loop_is_blocked(options: list[tuple[str, Any]], block_s: float,
                                          timeout_s: float) -> list[str]:
    """Four calls reach a server (``start_server`` with ``options``) while its event loop is blocked for
    ``block_s``, from a client in other threads; each call's outcome: "ok" or its status code's name."""

    async def echo(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield b"taken up"

    def call(channel: grpc.Channel) -> str:
        try:
            assert list(channel.unary_stream("/test.Echo/Run")(b"", timeout=timeout_s)) == [b"taken up"]
            return "ok"
        except grpc.RpcError as exc:
            return exc.code().name

    async def scenario() -> list[str]:
        server = await start_server([_one_method("test.Echo", echo)], ["test.Echo"], "127.0.0.1", 0, options=options)
        sending = threading.Event()

        def client() -> list[str]:
            with grpc.insecure_channel(server.address) as channel:
                grpc.channel_ready_future(channel).result(timeout=5)
                sending.set()
                time.sleep(0.3)  # the server's loop is blocked by now
                with ThreadPoolExecutor(4) as pool:
                    return list(pool.map(call, [channel] * 4))

        outcomes = asyncio.get_running_loop().run_in_executor(None, client)
        while not sending.is_set():
            await asyncio.sleep(0.01)
        time.sleep(block_s)  # on purpose: a loop too busy to take up the calls
        try:
            return await outcomes
        finally:
            await server.stop(0)

    return run_async(scenario(), timeout_s=30)


def test_calls_waiting_to_be_taken_up_end_only_at_their_deadline() -> None:
    # gRPC cancels a received call that the server has not taken up within server_max_unrequested_time_in_server
    # (default 30 s): what ended burst requests CANCELLED with no client cancelling them (issue 32), shown here
    # with the limit at 1 s. grpc.aio keeps one call taken up ahead, so one of the four is always served.
    unrequested = "grpc.server_max_unrequested_time_in_server"
    assert sorted(_calls_sent_while_the_loop_is_blocked([(unrequested, 1)], 2.5, 20)) == ["CANCELLED"] * 3 + ["ok"]
    # Tandem's servers let a call wait to be taken up longer than any deadline they set ...
    assert dict(SERVER_OPTIONS)[unrequested] == UNREQUESTED_CALL_WAIT_S
    assert UNREQUESTED_CALL_WAIT_S >= 24 * 3600  # request_timeout_s is 600 s unless set
    assert _calls_sent_while_the_loop_is_blocked([], 2.5, 20) == ["ok"] * 4
    # ... and a call's own deadline still ends it (the one taken up ahead too: its handler waits for the loop).
    assert _calls_sent_while_the_loop_is_blocked([], 2.5, 1.0) == ["DEADLINE_EXCEEDED"] * 4


def _burst(options: list[tuple[str, Any]], n: int) -> dict[str, int]:
    """``n`` streaming calls sent at once over one channel to a ``start_server`` server with ``options``: how many
    ended each way ("ok" or the status code's name)."""

    async def run(request: bytes, context: Any) -> AsyncIterator[bytes]:
        await asyncio.sleep(0.05)
        yield b"token"

    async def scenario() -> dict[str, int]:
        server = await start_server([_one_method("test.Burst", run)], ["test.Burst"], "127.0.0.1", 0, options=options)
        outcomes: dict[str, int] = {}

        async def one(stub: Any) -> None:
            try:
                assert [m async for m in stub(b"", timeout=30)] == [b"token"]
                key = "ok"
            except grpc.aio.AioRpcError as exc:
                key = exc.code().name
            outcomes[key] = outcomes.get(key, 0) + 1

        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                await channel.channel_ready()
                stub = channel.unary_stream("/test.Burst/Run")
                await asyncio.gather(*(one(stub) for _ in range(n)))
        finally:
            await server.stop(0)
        return outcomes

    return run_async(scenario(), timeout_s=60)


def test_a_burst_of_calls_is_taken_up_whole() -> None:
    # gRPC's own defaults cancel, at random, calls received while more than 1,000 wait to be taken up (a
    # burst of 1,200 requests lost 4-7 that way, issue 32) ...
    grpc_defaults = [("grpc.server.max_pending_requests", 1000), ("grpc.server.max_pending_requests_hard_limit", 3000)]
    lost = _burst(grpc_defaults, 2000)
    assert lost.get("CANCELLED", 0) > 0 and sum(lost.values()) == 2000
    # ... Tandem's servers take up every one (what waits, and for how long, is the admission queue's to say).
    assert _burst([], 2000) == {"ok": 2000}


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
