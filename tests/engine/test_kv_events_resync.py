"""KV events a router can trust, on real servers: a tiny-model decode node (prefilling locally) behind a
gateway, and a prefix index (gateway.kv_index) that follows the node through a TCP proxy this test can cut.

* a dropped connection: the proxy is cut while requests run and reopened after them; the index is exact
  again (its view equals the node's cached set, drift 0) within one second after the reconnect;
* a full queue: a subscriber that stops reading loses batches, sees the gap and heals by replay;
* a node restart: the proxy is pointed at a fresh node (another incarnation); the old entries go.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import grpc

from common.config.settings import ModelSettings, NodeSettings
from decode_service.server import serve_decode
from gateway.kv_event_merger import KvIndexSync
from gateway.kv_index import KvIndex, Resync
from gateway.server import serve_gateway
from gateway.settings import GatewaySettings
from prefill_service.server import serve_prefill
from tandem.v1 import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc

BS = 4
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                  ("grpc.max_reconnect_backoff_ms", 200)]

SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 512), ("grpc.http2.bdp_probe", 0)]


def run(coro: object, timeout_s: float = 180.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))  # type: ignore[arg-type]


class TcpProxy:
    """Forwards 127.0.0.1:port to ``backend``; ``cut`` closes the listener and every connection."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.port = 0
        self.accepted: list[float] = []  # monotonic time of each connection
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted.append(time.monotonic())
        host, port = self.backend.rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def node_snapshot(stub: decode_pb2_grpc.DecodeStub) -> common_pb2.KvEventBatch:
    """The node's own cached set (the first message of a snapshot subscription)."""
    call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(snapshot=True))
    try:
        async for batch in call:
            assert batch.HasField("snapshot")
            return batch
    finally:
        call.cancel()
    raise AssertionError("no snapshot")


async def generate(gateway: generate_pb2_grpc.TandemStub, first: int, n: int) -> None:
    """Requests with distinct prompts: blocks get cached, and (a small pool) evicted."""
    for i in range(n):
        prompt = [first + i * 13 + j for j in range(14)]
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        _ = [r async for r in gateway.Generate(request)]


async def exact_within(index: KvIndex, target: str, stub: decode_pb2_grpc.DecodeStub, limit_s: float) -> float:
    """Seconds until the index's view of ``target`` equals the node's cached set with drift 0."""
    start = time.monotonic()
    truth = await node_snapshot(stub)
    while time.monotonic() - start < limit_s:
        if index.hashes(target) == set(truth.snapshot.block_hashes) and index.drift(target) == 0 \
                and target in index and index.view(target).sequence == truth.sequence:
            return time.monotonic() - start
        await asyncio.sleep(0.02)
    raise AssertionError(f"not exact within {limit_s} s: view {len(index.hashes(target))} blocks (seq "
                         f"{index.view(target).sequence}), node {len(truth.snapshot.block_hashes)} "
                         f"(seq {truth.sequence})")


def test_a_cut_connection_a_full_queue_and_a_restart_heal(tiny_served_model_dir: Path) -> None:
    model = ModelSettings(model=str(tiny_served_model_dir), dtype="float32")
    node = NodeSettings(num_blocks=24, block_size=BS, grace_s=0.1)

    async def main() -> None:
        decode = await serve_decode(model, node)
        prefill = await serve_prefill(model, node)
        gateway = await serve_gateway(GatewaySettings(
            model_dir=tiny_served_model_dir, port=0, prefill_targets=(prefill.address,),
            decode_targets=(decode.address,), local_prefill_max_tokens=1000, stats_interval_s=0.2,
            shutdown_grace_s=0.1))
        proxy = TcpProxy(decode.address)
        await proxy.open()
        node_channel = grpc.aio.insecure_channel(decode.address)
        proxy_channel = grpc.aio.insecure_channel(proxy.address, options=FAST_RECONNECT)
        gw_channel = grpc.aio.insecure_channel(gateway.address)
        restarted = None
        stub = decode_pb2_grpc.DecodeStub(node_channel)
        gateway_stub = generate_pb2_grpc.TandemStub(gw_channel)
        index = KvIndex()
        sync = KvIndexSync(index, lambda: {proxy.address: decode_pb2_grpc.DecodeStub(proxy_channel).SubscribeKvEvents},
                           retry_s=0.1, members_s=0.2)
        try:
            sync.start()
            await generate(gateway_stub, 1000, 3)
            await exact_within(index, proxy.address, stub, 2.0)
            assert index.hashes(proxy.address)  # blocks were cached

            # A dropped connection: cut mid-run, the requests go on (evicting what the view last saw), reopen.
            await proxy.cut()
            await generate(gateway_stub, 2000, 6)
            await proxy.open()
            reopened = time.monotonic()
            while len(proxy.accepted) < 2 or proxy.accepted[-1] < reopened:
                assert time.monotonic() - reopened < 5.0, "the index never reconnected"
                await asyncio.sleep(0.01)
            reconnected = proxy.accepted[-1]
            await exact_within(index, proxy.address, stub, 1.0)
            assert time.monotonic() - reconnected < 1.0
            assert sync.num_resyncs.get(Resync.DISCONNECT.value, 0) >= 1

            # A full queue: a subscriber reading nothing while requests run loses batches (a queue of 1 at the
            # node; a small HTTP/2 window, so the node cannot write ahead into the transport's buffers).
            view = KvIndex()
            slow_channel = grpc.aio.insecure_channel(decode.address, options=SMALL_WINDOW)
            call = decode_pb2_grpc.DecodeStub(slow_channel).SubscribeKvEvents(
                view.resume_request("d", max_queued_batches=1))
            stream = call.__aiter__()
            assert view.apply("d", await stream.__anext__()) is None  # its snapshot
            await generate(gateway_stub, 3000, 12)
            await asyncio.sleep(0.3)
            found = None
            while found is None:
                found = view.apply("d", await asyncio.wait_for(stream.__anext__(), 5.0))
            assert found is Resync.GAP
            call.cancel()
            await slow_channel.close()
            replay = view.resume_request("d")
            assert replay.incarnation and replay.from_sequence > 1
            call = stub.SubscribeKvEvents(replay)
            truth = await node_snapshot(stub)
            async for batch in call:
                assert not batch.HasField("snapshot")  # healed by replay, not by a snapshot
                assert view.apply("d", batch) is None
                if batch.sequence >= truth.sequence:
                    break
            call.cancel()
            assert view.hashes("d") == set(truth.snapshot.block_hashes)
            assert view.drift("d") == 0

            # A restart: the same address now reaches a fresh node (another incarnation, an empty cache).
            old = index.hashes(proxy.address)
            assert old
            restarted = await serve_decode(model, node)
            proxy.backend = restarted.address
            await proxy.cut()
            await proxy.open()
            restarted_stub = decode_pb2_grpc.DecodeStub(grpc.aio.insecure_channel(restarted.address))
            start = time.monotonic()
            while index.hashes(proxy.address) or index.view(proxy.address).needs_snapshot \
                    or index.view(proxy.address).incarnation == "":
                assert time.monotonic() - start < 5.0, "the restarted node's view never came"
                await asyncio.sleep(0.02)
            assert index.hashes(proxy.address) == set(
                (await node_snapshot(restarted_stub)).snapshot.block_hashes) == set()

            # The gateway's own index followed the node directly the whole time: exact, no drift.
            assert isinstance(gateway.kv_index, KvIndexSync)
            await exact_within(gateway.kv_index.index, decode.address, stub, 2.0)
        finally:
            await sync.stop()
            assert index.targets() == []  # stopping the index leaves no entries behind
            await proxy_channel.close()
            await node_channel.close()
            await gw_channel.close()
            await gateway.stop(0.1)
            await prefill.stop(0.1)
            await decode.stop(0.1)
            if restarted is not None:
                await restarted.stop(0.1)

    run(main())
