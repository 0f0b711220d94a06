"""Scripted prefill and decode nodes for the relay benchmark: real ``grpc.aio`` servers that speak the
internal protocol and stream tokens as fast as the gateway reads them, so what is measured is the gateway.

The gateway is run with every prompt prefilled "locally" on the decode node (``--local-prefill-max-tokens``
above any prompt): the scripted decode answers ``local_prefill`` and then one ``TokenDelta`` per token,
``max_tokens`` of them, cycling through ``TOKENS``. The scripted prefill node only answers ``Stats`` (the
gateway needs a reachable one to be ready). Adapted from tests/gateway/scripted_nodes.py (benchmarks never
import tests).

    python -m benchmarks.relay_nodes      prints "ready <prefill> <decode>" (host:port), serves until killed
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import grpc

from common.serving.server import start_server
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

DECODE_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
PREFILL_SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
# SmolLM2 ids of ordinary words (" the", " of", ...): each decodes to text on its own, so every delta is a
# text delta on both fronts.
TOKENS = (260, 282, 284, 302, 314, 327, 347, 351, 355, 359, 366, 377, 392, 418, 421, 430)


class RelayDecode(decode_pb2_grpc.DecodeServicer):
    async def Generate(self, request: decode_pb2.DecodeRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.DecodeResponse]:
        if not request.prefill_locally:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the relay benchmark's decode node prefills locally")
        yield decode_pb2.DecodeResponse(local_prefill=decode_pb2.LocalPrefill(node_id="relay-decode"))
        n = request.sampling.max_tokens or 16
        for i in range(n):
            finish = common_pb2.FINISH_REASON_LENGTH if i == n - 1 else common_pb2.FINISH_REASON_UNSPECIFIED
            yield decode_pb2.DecodeResponse(delta=decode_pb2.TokenDelta(token_ids=[TOKENS[i % len(TOKENS)]],
                                                                        finish_reason=finish))

    async def Stats(self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> common_pb2.NodeStats:
        return common_pb2.NodeStats(node_id="relay-decode", role="decode", num_blocks=100_000, free_blocks=100_000,
                                    block_size=16)


class RelayPrefill(prefill_pb2_grpc.PrefillServicer):
    async def Stats(self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> common_pb2.NodeStats:
        return common_pb2.NodeStats(node_id="relay-prefill", role="prefill", num_blocks=100_000,
                                    free_blocks=100_000, block_size=16)


async def _main() -> None:
    prefill = await start_server([functools.partial(prefill_pb2_grpc.add_PrefillServicer_to_server, RelayPrefill())],
                                 [PREFILL_SERVICE], "127.0.0.1", 0)
    decode = await start_server([functools.partial(decode_pb2_grpc.add_DecodeServicer_to_server, RelayDecode())],
                                [DECODE_SERVICE], "127.0.0.1", 0)
    print(f"ready {prefill.address} {decode.address}", flush=True)
    await asyncio.Event().wait()  # until SIGTERM (the benchmark terminates this process)


if __name__ == "__main__":
    asyncio.run(_main())
