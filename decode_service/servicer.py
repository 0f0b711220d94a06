"""The decode node's gRPC servicer: reserve blocks, wait for the pushed KV, then stream tokens."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from common.protocol import finish_reason_to_proto, logprob_to_proto, sampling_from_proto, stats_to_proto
from common.serving.errors import ResourceExhaustedError
from decode_service.engine import DecodeEngine
from kv_transfer.errors import TransferFailed
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc

if TYPE_CHECKING:
    import grpc

    from common.engine.async_engine import AsyncEngine
    from common.engine.request import RequestOutput
    from kv_transfer.receiver import KVReceiver

log = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: AsyncEngine, receiver: KVReceiver, node_id: str, kv_endpoint: str,
                 kv_timeout_s: float) -> None:
        assert isinstance(engine.engine, DecodeEngine)
        self.engine = engine
        self.core: DecodeEngine = engine.engine
        self.receiver = receiver
        self.node_id = node_id
        self.kv_endpoint = kv_endpoint
        self.kv_timeout_s = kv_timeout_s

    async def Generate(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        params = sampling_from_proto(request.sampling)
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        eos = tuple(request.eos_token_ids)
        timeout = request.kv_timeout_seconds or self.kv_timeout_s
        transfer_id = f"{rid}/{uuid.uuid4().hex[:12]}"
        stream = self.engine.open_stream(rid)
        allocation = await self.engine.call(lambda: self.core.reserve(rid, prompt, params, eos))
        if allocation is None:
            self.engine.close_stream(rid)
            free = self.core.kv.num_free_blocks
            raise ResourceExhaustedError(
                f"KV cache full on {self.node_id}: the prompt needs {self.core.kv.blocks_needed(len(prompt))} "
                f"blocks, {free} free")
        self.receiver.expect(transfer_id, allocation.block_ids, allocation.num_cached_tokens)
        try:
            yield decode_pb2.DecodeResponse(reservation=decode_pb2.Reservation(
                transfer_id=transfer_id, block_ids=allocation.block_ids,
                num_cached_tokens=allocation.num_cached_tokens, kv_endpoint=self.kv_endpoint, node_id=self.node_id))
            result = await self.receiver.wait(transfer_id, timeout)
        except BaseException as exc:
            # Cancelled, timed out or the transfer failed: no recv may still write our blocks before we free them.
            await _abandon(self.receiver, transfer_id, repr(exc))
            self.engine.close_stream(rid)
            await asyncio.shield(self.engine.call(lambda: self.core.abort(rid)))
            raise
        first = await self.engine.call(lambda: self.core.start_decoding(rid, result.first_token))
        if first.finished:
            self.engine.close_stream(rid)
            yield decode_pb2.DecodeResponse(delta=decode_pb2.TokenDelta(
                finish_reason=finish_reason_to_proto(first.finish_reason)))
            return
        async for out in self.engine.stream(rid, stream):
            yield decode_pb2.DecodeResponse(delta=_delta(out))

    async def Stats(
        self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.NodeStats:
        return stats_to_proto(await self.engine.call(self.core.stats), self.node_id, "decode")


def _delta(out: RequestOutput) -> decode_pb2.TokenDelta:
    logprobs = []
    if out.logprobs:
        logprobs = [logprob_to_proto(t, lp, top) for t, (lp, top) in zip(out.new_token_ids, out.logprobs, strict=True)]
    return decode_pb2.TokenDelta(token_ids=out.new_token_ids, logprobs=logprobs,
                                 finish_reason=finish_reason_to_proto(out.finish_reason))


async def _abandon(receiver: KVReceiver, transfer_id: str, reason: str) -> None:
    try:
        await asyncio.shield(receiver.abandon(transfer_id, reason))
    except TransferFailed:
        pass
    except Exception:
        log.exception("abandoning transfer %s failed", transfer_id)
