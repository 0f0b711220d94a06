"""The gateway reads the status a prefill node ended its call with, even when a write races that ending.

grpc.aio gives a call whose write fails in grpc's core the status INTERNAL "Internal error from Core", in place
of (or until) the node's own (gateway/prefill_call.py, ``PrefillCall``). A real server that fails every call as
soon as its request comes, while the client goes on writing its destination and half-close as the gateway
does: every call must read as the node's status, never as that placeholder.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import grpc
from scripted_nodes import run_async

from gateway.prefill_call import PrefillCall
from tandem.v1 import prefill_pb2, prefill_pb2_grpc

TRIALS = 80


class FailingPrefill(prefill_pb2_grpc.PrefillServicer):
    """Reads the request, then ends the call with ``code`` (as a node refusing or losing it)."""

    def __init__(self) -> None:
        self.code = grpc.StatusCode.UNAVAILABLE

    async def PrefillStream(self, request_iterator: AsyncIterator[prefill_pb2.PrefillMessage],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[prefill_pb2.PrefillResponse]:
        await anext(aiter(request_iterator))
        await context.abort(self.code, "scripted failure")
        yield prefill_pb2.PrefillResponse()  # never reached: makes this an async generator


def test_a_write_racing_the_nodes_failure_reads_the_nodes_status() -> None:
    async def scenario() -> Counter[tuple[grpc.StatusCode, str]]:
        servicer = FailingPrefill()
        server = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        seen: Counter[tuple[grpc.StatusCode, str]] = Counter()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = prefill_pb2_grpc.PrefillStub(channel)
                for i in range(TRIALS):
                    servicer.code = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT)[i % 2]
                    call = stub.PrefillStream(timeout=10)
                    prefill = PrefillCall(call)
                    answer = asyncio.ensure_future(prefill.first_answer())
                    try:
                        await prefill.write(answer, prefill_pb2.PrefillMessage(
                            request=prefill_pb2.PrefillRequest(request_id=f"r{i}")))
                        await asyncio.sleep((i % 4) * 0.0005)  # the destination comes at varied times after
                        destination = prefill_pb2.KVDestination(transfer_id=f"t{i}", block_ids=list(range(64)))
                        await prefill.write(answer, prefill_pb2.PrefillMessage(destination=destination))
                        await prefill.write(answer, None)
                        await answer
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == servicer.code, (i, exc.code(), exc.details())
                        seen[(exc.code(), exc.details())] += 1
                    finally:
                        answer.cancel()
                        call.cancel()
        finally:
            await server.stop(0)
        return seen

    seen = run_async(scenario())
    assert seen == {(grpc.StatusCode.UNAVAILABLE, "scripted failure"): TRIALS // 2,
                    (grpc.StatusCode.INVALID_ARGUMENT, "scripted failure"): TRIALS // 2}
