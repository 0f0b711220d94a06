"""The gateway's Stats poller: a node that answers late is busy, not down; one that never answers is."""

from __future__ import annotations

import asyncio
import functools

from common.serving.server import start_server
from gateway.node_pool import DEFAULT_BLOCK_SIZE, FIRST_POLL_TIMEOUT_S, SLOW_POLLS_UNTIL_DOWN, NodePool
from gateway.router import Router
from tandem.v1 import decode_pb2_grpc
from tests.gateway.scripted_nodes import DECODE_SERVICE, KVBoard, Script, ScriptedDecode, free_port, run_async


def test_a_late_stats_answer_keeps_a_connected_node_routed_until_it_looks_hung() -> None:
    async def scenario() -> None:
        node = ScriptedDecode("decode-0", KVBoard(), Script([1]))
        server = await start_server([functools.partial(decode_pb2_grpc.add_DecodeServicer_to_server, node)],
                                    [DECODE_SERVICE], "127.0.0.1", 0)
        dead = f"127.0.0.1:{free_port()}"
        router = Router((), (server.address, dead))
        pool = NodePool(router, stats_interval_s=0.2)  # each poll waits at most 0.2 s
        try:
            await pool.poll_once()  # answered: the connection is up
            assert router.node(server.address).reachable and not router.node(dead).reachable
            node.stats_delay_s = 1.0  # busy: every poll times out on a live connection
            for _ in range(SLOW_POLLS_UNTIL_DOWN - 1):
                await pool.poll_once()
                assert router.node(server.address).reachable  # still routed: busy, not down
            node.stats_delay_s = 0.0
            await pool.poll_once()  # an answer resets the count
            node.stats_delay_s = 1.0
            for _ in range(SLOW_POLLS_UNTIL_DOWN - 1):
                await pool.poll_once()
                assert router.node(server.address).reachable
            await pool.poll_once()  # the SLOW_POLLS_UNTIL_DOWN-th in a row: hung, taken out of routing
            assert not router.node(server.address).reachable
            node.stats_delay_s = 0.0
            await pool.poll_once()
            assert router.node(server.address).reachable  # answers again: routed again
        finally:
            await pool.close()
            await server.stop(0)

    run_async(scenario())


def test_the_first_poll_waits_for_a_node_that_starts_listening_late() -> None:
    # A node still finishing its start (or slow to answer the handshake on a loaded machine) when the gateway
    # starts is routed once it answers, instead of being marked unreachable by a first poll of one stats interval.
    async def scenario() -> None:
        node = ScriptedDecode("decode-0", KVBoard(), Script([1]))
        port = free_port()
        router = Router((), (f"127.0.0.1:{port}",))
        pool = NodePool(router, stats_interval_s=0.2)
        starting = asyncio.create_task(pool.start())
        await asyncio.sleep(1.0)  # five stats intervals: the first poll is still waiting for the connection
        assert not starting.done()
        server = await start_server([functools.partial(decode_pb2_grpc.add_DecodeServicer_to_server, node)],
                                    [DECODE_SERVICE], "127.0.0.1", port)
        try:
            await asyncio.wait_for(starting, FIRST_POLL_TIMEOUT_S)
            assert router.node(f"127.0.0.1:{port}").reachable
        finally:
            await pool.close()
            await server.stop(0)

    run_async(scenario())


def test_the_block_size_is_the_one_the_nodes_report() -> None:
    # The gateway has no block-size setting: prefix-affinity hashing and ModelInfo use the nodes' own.
    async def scenario() -> None:
        node = ScriptedDecode("decode-0", KVBoard(), Script([1]))
        node.block_size = 32
        server = await start_server([functools.partial(decode_pb2_grpc.add_DecodeServicer_to_server, node)],
                                    [DECODE_SERVICE], "127.0.0.1", 0)
        pool = NodePool(Router((), (server.address,)), stats_interval_s=0.5)
        try:
            assert pool.block_size == DEFAULT_BLOCK_SIZE  # nothing reported yet
            await pool.poll_once()
            assert pool.block_size == 32
        finally:
            await pool.close()
            await server.stop(0)

    run_async(scenario())
