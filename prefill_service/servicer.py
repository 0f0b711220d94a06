"""The prefill node's gRPC servicer: thin and async over the prefill engine and the KV sender."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from common.errors import InvalidRequestError
from common.protocol import logprob_to_proto, sampling_from_proto, stats_to_proto
from kv_transfer.errors import TransferFailed
from prefill_service.engine import PrefillEngine, TransferPlan
from tandem.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

if TYPE_CHECKING:
    import grpc

    from common.engine.async_engine import AsyncEngine
    from kv_transfer.sender import KVSender, TransferHandle

log = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: AsyncEngine, sender: KVSender, node_id: str, transfer_timeout_s: float) -> None:
        assert isinstance(engine.engine, PrefillEngine)
        self.engine = engine
        self.core: PrefillEngine = engine.engine
        self.sender = sender
        self.node_id = node_id
        self.transfer_timeout_s = transfer_timeout_s

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        arrival = time.monotonic()
        params = sampling_from_proto(request.sampling)
        prompt = list(request.prompt_token_ids)
        dest = request.destination
        bs = self.core.kv.block_size
        if len(dest.block_ids) * bs < len(prompt):
            raise InvalidRequestError("destination.block_ids", f"{len(dest.block_ids)} blocks of {bs} cannot hold "
                                      f"{len(prompt)} prompt tokens")
        if dest.num_cached_tokens >= len(prompt):
            raise InvalidRequestError("destination.num_cached_tokens", f"must be < the prompt's {len(prompt)} tokens")
        rid = request.request_id
        handle = await self.sender.open(dest.transfer_id, dest, _trace_context(context))
        stream = self.engine.open_stream(rid)
        finished = False
        try:
            plan = TransferPlan(handle, list(dest.block_ids), dest.num_cached_tokens // bs)
            eos = tuple(request.eos_token_ids)

            def admit() -> None:
                self.core.add_request(rid, prompt, params, eos)
                self.core.attach(rid, plan)

            await self.engine.call(admit)
            outputs = [out async for out in self.engine.stream(rid, stream)]
            started = self.core.scheduler.retained.get(rid)
            first = outputs[-1]
            token = first.new_token_ids[0]
            logprob = None
            if first.logprobs:
                lp, top = first.logprobs[0]
                logprob = logprob_to_proto(token, lp, top)
            handle.complete(token, logprob, first.num_cached_tokens)
            stats = await handle.wait(self.transfer_timeout_s)
            finished = True
        except BaseException as exc:
            await _drain(handle, f"prefill failed: {exc!r}", self.transfer_timeout_s)
            raise
        finally:
            self.engine.close_stream(rid)
            # No send is in flight any more: the blocks can go (they stay in the prefix cache).
            self.engine.submit(lambda: self.core.release(rid) if finished else self.core.abort(rid))
        compute_start = started.first_scheduled_time if started and started.first_scheduled_time else arrival
        return prefill_pb2.PrefillResponse(
            first_token=token,
            first_logprob=logprob,
            num_cached_tokens=first.num_cached_tokens,
            transfer_bytes=stats.bytes,
            transfer_seconds=stats.seconds,
            queue_seconds=max(0.0, compute_start - arrival),
            compute_seconds=time.monotonic() - compute_start,
        )

    async def Stats(
        self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.NodeStats:
        return stats_to_proto(await self.engine.call(self.core.stats), self.node_id, "prefill")


async def _drain(handle: TransferHandle, reason: str, timeout_s: float) -> None:
    """Abort the transfer and wait until none of its sends is in flight (they read our blocks)."""
    handle.abort(reason)
    try:
        await handle.wait(timeout_s)
    except TransferFailed:
        pass
    except Exception:  # a failure while failing: log, the blocks are freed regardless after the timeout
        log.exception("draining transfer failed")


def _trace_context(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """W3C trace context headers of the incoming call, to travel in KV control messages."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if k in ("traceparent", "tracestate")}
