"""Live membership on real gRPC servers in this process: a gateway with no static nodes, tiny-model prefill
and decode nodes that register with it (``--gateway``), a drain under in-flight streams, a drain of an unknown
node, and a node that dies and is dropped after its health checks fail."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from common.config.settings import ModelSettings, NodeSettings, SecuritySettings
from common.serving.port_reservation import reserve_port
from common.serving.server import RunningServer
from decode_service.server import serve_decode
from gateway.server import serve_gateway
from gateway.settings import GatewaySettings
from prefill_service.server import serve_prefill
from tandem.v1 import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc, membership_pb2, membership_pb2_grpc
from tandem_cli import cli

BS = 4
PROMPT = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110]


def run(coro: Awaitable[None], timeout_s: float = 150.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))  # type: ignore[arg-type]


def request(max_tokens: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=PROMPT), stream=generate_pb2.StreamOptions(include_token_ids=True),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def gateway_settings(model_dir: Path, internal_port: int, **overrides: object) -> GatewaySettings:
    values: dict[str, object] = dict(model_dir=model_dir, port=0, internal_port=internal_port,
                                     stats_interval_s=0.2, shutdown_grace_s=0.1, local_prefill_max_tokens=0)
    values.update(overrides)
    return GatewaySettings(**values)  # type: ignore[arg-type]


def node_settings(gateway: str = "", node_id: str = "") -> NodeSettings:
    return NodeSettings(num_blocks=64, block_size=BS, grace_s=5.0, gateway=gateway, node_id=node_id,
                        register_interval_s=0.2)


async def loads(gateway: RunningServer) -> list[generate_pb2.NodeLoad]:
    async with grpc.aio.insecure_channel(gateway.address) as channel:
        reply = await generate_pb2_grpc.TandemStub(channel).GetLoads(generate_pb2.GetLoadsRequest())
    return list(reply.nodes)


async def wait_until(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.05)


async def members(gateway: RunningServer, role: str) -> set[str]:
    return {n.target for n in await loads(gateway) if n.role == role}


async def generate(gateway: RunningServer, max_tokens: int) -> list[generate_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(gateway.address) as channel:
        return [r async for r in generate_pb2_grpc.TandemStub(channel).Generate(request(max_tokens), timeout=60)]


async def used_blocks(node: RunningServer) -> int:
    async with grpc.aio.insecure_channel(node.address) as channel:
        stats = await decode_pb2_grpc.DecodeStub(channel).Stats(common_pb2.StatsRequest(), timeout=10)
    return stats.used_blocks


def membership(gateway: RunningServer) -> tuple[grpc.aio.Channel, membership_pb2_grpc.MembershipStub]:
    channel = grpc.aio.insecure_channel(gateway.internal_address)
    return channel, membership_pb2_grpc.MembershipStub(channel)


def test_nodes_register_serve_survive_a_gateway_restart_and_deregister(tiny_served_model_dir: Path) -> None:
    model = ModelSettings(model=str(tiny_served_model_dir), dtype="float32")
    internal_port = reserve_port()

    async def main() -> None:
        gateway = await serve_gateway(gateway_settings(tiny_served_model_dir, internal_port))
        internal = gateway.internal_address
        events_channel = grpc.aio.insecure_channel(gateway.address)  # a KV-event subscriber from before any node
        events = generate_pb2_grpc.TandemStub(events_channel).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
        prefill = await serve_prefill(model, node_settings(internal, "p0"))
        decode = await serve_decode(model, node_settings(internal, "d0"))
        try:
            await wait_until("both nodes registered", lambda: _both(gateway, prefill, decode))
            await asyncio.sleep(1.5)  # the merger follows the new members (every second) before the request
            responses = await generate(gateway, 6)
            assert len([t for r in responses for t in r.token_ids]) == 6
            assert responses[-1].timings.prefill_node == "p0" and responses[-1].timings.decode_node == "d0"
            batch = await events.read()
            while not any(e.WhichOneof("kind") == "stored" for e in batch.events):
                batch = await events.read()
            assert batch.target in (prefill.address, decode.address)
            events.cancel()
            await events_channel.close()

            # The gateway restarts (same internal port): the nodes' next heartbeat registers them again.
            await gateway.stop(0)
            gateway = await serve_gateway(gateway_settings(tiny_served_model_dir, internal_port))
            await wait_until("re-registered after the restart", lambda: _both(gateway, prefill, decode))
            assert len([t for r in await generate(gateway, 4) for t in r.token_ids]) == 4

            # A drain of a node the gateway does not know: NOT_FOUND naming it, at once.
            channel, stub = membership(gateway)
            async with channel:
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Drain(membership_pb2.DrainRequest(node_id="decode-nope"), timeout=10)
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
                assert "decode-nope" in (err.value.details() or "") and "d0" in (err.value.details() or "")
                assert time.monotonic() - started < 2.0
                with pytest.raises(grpc.aio.AioRpcError) as err:  # a registration that names no role
                    await stub.Register(membership_pb2.NodeInfo(node_id="x", role="both", address="h:1"))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in (err.value.details() or "")

            # A graceful shutdown deregisters the node first; its in-flight stream still finishes (the gateway
            # closes the connection after it), and new requests find no decode node.
            async with grpc.aio.insecure_channel(gateway.address) as gw_channel:
                call = generate_pb2_grpc.TandemStub(gw_channel).Generate(request(150), timeout=60)
                head = await call.read()
                stopping = asyncio.ensure_future(decode.stop(5.0))  # (it waits out the KV connections)
                await wait_until("d0 deregistered", lambda: _none(gateway, "decode"))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await generate(gateway, 3)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "no reachable decode node (targets: none registered yet)" in (err.value.details() or "")
                rest = await _rest(call)
                assert len([*head.token_ids, *(t for r in rest for t in r.token_ids)]) == 150
                assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
                await stopping
        finally:
            await asyncio.gather(prefill.stop(0), decode.stop(0))
            await gateway.stop(0)

    run(main())


async def _both(gateway: RunningServer, prefill: RunningServer, decode: RunningServer) -> bool:
    nodes = {n.target: n for n in await loads(gateway)}
    return (prefill.address in nodes and decode.address in nodes
            and all(n.reachable and n.node_id in ("p0", "d0") for n in nodes.values()))


def test_drain_finishes_in_flight_streams_then_the_node_leaves(tiny_served_model_dir: Path) -> None:
    model = ModelSettings(model=str(tiny_served_model_dir), dtype="float32")
    max_tokens = 150

    async def main() -> None:
        gateway = await serve_gateway(gateway_settings(tiny_served_model_dir, reserve_port()))
        internal = gateway.internal_address
        prefill = await serve_prefill(model, node_settings(internal, "p0"))
        decodes = {"d0": await serve_decode(model, node_settings(internal, "d0")),
                   "d1": await serve_decode(model, node_settings(internal, "d1"))}
        gw_channel = grpc.aio.insecure_channel(gateway.address)
        channel, stub = membership(gateway)
        try:
            for node in decodes.values():
                await wait_until("decode nodes registered", lambda node=node: _has(gateway, node.address))  # type: ignore[misc]
            tandem = generate_pb2_grpc.TandemStub(gw_channel)
            calls = [tandem.Generate(request(max_tokens), timeout=60) for _ in range(4)]
            firsts = [await call.read() for call in calls]  # every stream is running
            inflight = {n.node_id: n.num_inflight for n in await loads(gateway) if n.role == "decode"}
            victim = max(inflight, key=lambda node_id: inflight[node_id])
            other = next(node_id for node_id in decodes if node_id != victim)

            # A drain that runs out of time names the node and what it still holds, and routes the node again.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Drain(membership_pb2.DrainRequest(node_id=victim, timeout_seconds=0.05), timeout=10)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert f"node {victim} did not drain" in (err.value.details() or "")
            assert "in flight" in (err.value.details() or "") or "running" in (err.value.details() or "")
            assert not await _draining(gateway, decodes[victim].address)

            drain = asyncio.ensure_future(stub.Drain(membership_pb2.DrainRequest(node_id=victim, timeout_seconds=60)))
            await wait_until(f"{victim} draining", lambda: _draining(gateway, decodes[victim].address))
            assert {n.node_id: n.num_inflight for n in await loads(gateway)}[victim] > 0  # a drain under load
            # Meanwhile new requests go to the other decode node.
            assert (await generate(gateway, 3))[-1].timings.decode_node == other
            rests = await asyncio.gather(*(_rest(call) for call in calls))
            reply = await drain
            assert reply.address == decodes[victim].address
            for head, rest in zip(firsts, rests, strict=True):
                tokens = [*head.token_ids, *(t for r in rest for t in r.token_ids)]
                assert len(tokens) == max_tokens and rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert victim in {rest[-1].timings.decode_node for rest in rests}
            assert await members(gateway, "decode") == {decodes[other].address}
            assert await used_blocks(decodes[victim]) == 0
            # A drained incarnation is not let back in: its registrar stops.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Drain(membership_pb2.DrainRequest(node_id=victim), timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            await asyncio.sleep(0.6)  # three heartbeats
            assert await members(gateway, "decode") == {decodes[other].address}
            assert (await generate(gateway, 3))[-1].timings.decode_node == other
        finally:
            await channel.close()
            await gw_channel.close()
            await asyncio.gather(prefill.stop(0), *(node.stop(0) for node in decodes.values()))
            await gateway.stop(0)

    run(main())


async def _none(gateway: RunningServer, role: str) -> bool:
    return not await members(gateway, role)


async def _has(gateway: RunningServer, target: str) -> bool:
    return any(n.target == target and n.reachable for n in await loads(gateway))


async def _draining(gateway: RunningServer, target: str) -> bool:
    return any(n.target == target and n.draining for n in await loads(gateway))


async def _rest(call: grpc.aio.UnaryStreamCall) -> list[generate_pb2.GenerateResponse]:
    out = []
    while (r := await call.read()) is not grpc.aio.EOF:
        out.append(r)
    return out


def test_a_node_that_dies_is_dropped(tiny_served_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = ModelSettings(model=str(tiny_served_model_dir), dtype="float32")

    async def main() -> None:
        gateway = await serve_gateway(gateway_settings(tiny_served_model_dir, reserve_port(), node_drop_after_s=1.0))
        decode = await serve_decode(model, node_settings())  # registered by hand below, so that it can die alone
        channel, stub = membership(gateway)
        try:
            await stub.Register(membership_pb2.NodeInfo(node_id="d9", role="decode", address=decode.address,
                                                        kv_endpoint=decode.address, incarnation="1",
                                                        model="another-model"), timeout=10)
            assert "node d9 serves model another-model" in caplog.text  # said, not refused
            await wait_until("d9 polled", lambda: _has(gateway, decode.address))
            await decode.server.stop(0)  # the process is gone: no deregistration, no answers
            started = time.monotonic()
            await wait_until("d9 dropped", lambda: _gone(gateway, decode.address))
            assert time.monotonic() - started < 10.0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Deregister(membership_pb2.DeregisterRequest(node_id="d9"), timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            await channel.close()
            await decode.stop(0)
            await gateway.stop(0)

    run(main())


async def _gone(gateway: RunningServer, target: str) -> bool:
    return all(n.target != target for n in await loads(gateway))


def test_the_internal_port_wants_the_cluster_token_and_drain_names_an_unknown_node(
        tiny_served_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def main() -> None:
        gateway = await serve_gateway(gateway_settings(tiny_served_model_dir, reserve_port()),
                                      security=SecuritySettings(internal_token="s3cret"))
        try:
            channel, stub = membership(gateway)
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Drain(membership_pb2.DrainRequest(node_id="d0"), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            async with grpc.aio.insecure_channel(gateway.address) as public:  # not on the public port
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await membership_pb2_grpc.MembershipStub(public).Drain(membership_pb2.DrainRequest(node_id="d0"))
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            started = time.monotonic()
            assert await asyncio.to_thread(cli.main, ["drain", "decode-7", "--gateway", gateway.internal_address,
                                                      "--internal-token", "s3cret"]) == 1
            assert time.monotonic() - started < 5.0
            # A gateway that is not there: UNAVAILABLE at once, not the drain's timeout.
            started = time.monotonic()
            assert await asyncio.to_thread(cli.main, ["drain", "decode-7", "--gateway",
                                                      f"127.0.0.1:{reserve_port()}"]) == 1
            assert time.monotonic() - started < 10.0
        finally:
            await gateway.stop(0)

    run(main())
    err = capsys.readouterr().err
    assert "drain decode-7: NOT_FOUND: node 'decode-7' is not registered with this gateway" in err
    assert "drain decode-7: UNAVAILABLE" in err
