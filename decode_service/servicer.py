"""The decode node's gRPC servicer: reserve blocks, wait for the pushed KV, then stream tokens.

Telemetry at this edge: the ``decode`` span (a child of the gateway's, through the gRPC metadata) with
``decode.reserve``, ``decode.wait_kv``, ``decode.stream``, and ``kv_transfer.receive`` made from the
transfer's result under the prefill node's send span (its context came in the KV control messages); plus
the node's inter-token latency, end-to-end, KV-wait and transfer metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace
from opentelemetry.trace import Link

from common.engine.commands import AbortRequest, AddRequest, ReserveKV
from common.engine.kv_event_publisher import KVEventPublisher
from common.kv.kv_cache_manager import NULL_BLOCK
from common.protocol import finish_reason_to_proto, logprob_to_proto, sampling_from_proto, stats_to_proto
from common.serving.errors import ResourceExhaustedError
from common.serving.status import StatusInterceptor
from common.telemetry import spans
from common.telemetry.logs import request_scope
from common.telemetry.metrics import DecodeMetrics
from common.telemetry.propagation import context_from_headers
from common.telemetry.tracing import get_tracer
from decode_service.kv_consumer import KVConsumer
from kv_transfer.errors import TransferFailed
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc

if TYPE_CHECKING:
    from common.engine.async_engine import AsyncEngine
    from common.engine.request import RequestCounters, RequestOutput
    from common.sampling.params import SamplingParams
    from kv_transfer.receiver import KVReceiver
    from kv_transfer.receiver_transfer import TransferResult

log = logging.getLogger(__name__)
_tracer = get_tracer(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: AsyncEngine, receiver: KVReceiver, node_id: str, kv_endpoint: str,
                 kv_timeout_s: float, metrics: DecodeMetrics | None = None,
                 status_for: spans.StatusFor | None = None, queue_timeout_s: float = 300.0) -> None:
        assert isinstance(engine.engine.connector, KVConsumer), "a decode node's engine has the KV consumer role"
        self.engine = engine
        self.block_size = engine.engine.block_size
        self._engine_stats = engine.engine.stats  # read without queueing (see Stats)
        self.kv_events = KVEventPublisher(engine, node_id, "decode")
        self.receiver = receiver
        self.node_id = node_id
        self.kv_endpoint = kv_endpoint
        self.kv_timeout_s = kv_timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.metrics = metrics or DecodeMetrics(node_id)
        self._status_for = status_for or StatusInterceptor().status_for

    async def Generate(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        with (_tracer.start_as_current_span(spans.DECODE, kind=spans.SERVER, record_exception=False,
                                            set_status_on_exception=False) as span,
              request_scope(request.request_id)):
            ended = False
            # The engine's id for this call: a retry of the same request (a recompute after a failed KV load,
            # a client reusing its id) may arrive while the previous call's request is still being aborted.
            engine_id = f"{request.request_id}@{uuid.uuid4().hex[:8]}"
            try:
                # aclosing: a cancelled stream runs the inner generator's cleanup now, not at garbage collection.
                responses_of = self._generate_local if request.prefill_locally else self._generate
                async with contextlib.aclosing(responses_of(request, span, engine_id)) as responses:
                    async for response in responses:
                        yield response
                ended = True
            except BaseException as exc:
                spans.record_failure(span, exc, self._status_for, log, "decode failed")
                raise
            finally:
                if not ended:
                    # Whatever stage it stopped at (even inside a command the engine still applies, such as
                    # the reservation), the request leaves the engine: commands run in order, so this abort
                    # comes after it. Aborting a request that already ended is a no-op.
                    self.engine.close_stream(engine_id)
                    self.engine.submit(AbortRequest(engine_id))
            spans.set_ok(span)

    async def _generate(self, request: decode_pb2.DecodeRequest, span: trace.Span,
                        engine_id: str) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        arrival = time.monotonic()
        params = sampling_from_proto(request.sampling, resumed_output_tokens=request.resumed_output_tokens)
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        eos = tuple(request.eos_token_ids)
        timeout = request.kv_timeout_seconds or self.kv_timeout_s
        transfer_id = f"{rid}/{uuid.uuid4().hex[:12]}"
        if span.is_recording():
            span.set_attributes({spans.REQUEST_ID: rid, spans.NODE: self.node_id, spans.PROMPT_TOKENS: len(prompt),
                                 spans.TRANSFER_ID: transfer_id})
        stream = self.engine.open_stream(engine_id)
        with _tracer.start_as_current_span(spans.DECODE_RESERVE) as reserve_span:
            try:
                table, num_cached = await self._reserve(engine_id, prompt, params, eos, transfer_id, stream)
            except BaseException:
                self.engine.close_stream(engine_id)
                raise
            # The table's leading NULL_BLOCK slots lie outside every sliding window at the first decode query: no
            # block is held for them and none of their KV is sent (Reservation.first_block).
            first_block = next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table))
            block_ids = list(table[first_block:])
            assert NULL_BLOCK not in block_ids, "only a leading run of the table is outside the window"
            if reserve_span.is_recording():
                reserve_span.set_attributes({spans.RESERVED_BLOCKS: len(block_ids), spans.CACHED_TOKENS: num_cached})
        # The transfer's end is reported to the engine's KVConsumer by the receiver (the next step starts the
        # request or aborts it); here it is only awaited, for the trace, the metrics and the client's error.
        num_sent_from = max(num_cached // self.block_size, first_block)  # the first prompt block the prefill sends
        self.receiver.expect(transfer_id, block_ids, (num_sent_from - first_block) * self.block_size)
        try:
            yield decode_pb2.DecodeResponse(reservation=decode_pb2.Reservation(
                transfer_id=transfer_id, block_ids=block_ids, num_cached_tokens=num_cached,
                kv_endpoint=self.kv_endpoint, node_id=self.node_id, first_block=first_block))
            waited_from = time.monotonic()
            with _tracer.start_as_current_span(spans.DECODE_WAIT_KV) as wait_span:
                # The KV timeout runs from the prefill's first chunk: its node's queue does not count.
                result = await self.receiver.wait(transfer_id, timeout, start_timeout_s=self.queue_timeout_s)
            self.metrics.kv_wait_time.observe(time.monotonic() - waited_from)
        except BaseException as exc:
            if isinstance(exc, TransferFailed):
                self.metrics.kv_transfer_failures.inc()
            # Cancelled, timed out or the transfer failed: no recv may still write our blocks before we free them.
            await _abandon(self.receiver, transfer_id, repr(exc))
            self.engine.close_stream(engine_id)
            await asyncio.shield(self.engine.call(AbortRequest(engine_id)))
            raise
        self.metrics.transfer_done(result.bytes, result.seconds)
        if span.is_recording():  # (wait_span has ended: it records no more)
            num_blocks = len(block_ids) - (num_sent_from - first_block)
            _record_receive(result, num_blocks, transfer_id, wait_span)
        async for response in self._relay(engine_id, stream, span, arrival, remote=True):
            yield response

    async def _generate_local(self, request: decode_pb2.DecodeRequest, span: trace.Span,
                              engine_id: str) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        """Conditional disaggregation: this node prefills the prompt itself (queued like any other request),
        then decodes it: ``local_prefill`` once queued, then token deltas, the first one with the prompt's
        cached tokens and its queue time."""
        arrival = time.monotonic()
        rid = request.request_id
        if span.is_recording():
            span.set_attributes({spans.REQUEST_ID: rid, spans.NODE: self.node_id, spans.LOCAL_PREFILL: True,
                                 spans.PROMPT_TOKENS: len(request.prompt_token_ids)})
        stream = self.engine.open_stream(engine_id)
        try:
            await self.engine.call(AddRequest(engine_id, tuple(request.prompt_token_ids),
                                              sampling_from_proto(request.sampling, resumed_output_tokens=
                                                                  request.resumed_output_tokens),
                                              tuple(request.eos_token_ids)))
        except BaseException:
            self.engine.close_stream(engine_id)
            raise
        try:
            yield decode_pb2.DecodeResponse(local_prefill=decode_pb2.LocalPrefill(node_id=self.node_id))
        except BaseException:
            self.engine.close_stream(engine_id)
            self.engine.submit(AbortRequest(engine_id))
            raise
        async for response in self._relay(engine_id, stream, span, arrival):
            yield response

    async def _relay(self, rid: str, stream: asyncio.Queue[RequestOutput | Exception], span: trace.Span,
                     arrival: float, remote: bool = False) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        """Stream the request's outputs as token deltas. ``remote``: the first output is the remote prefill's
        token (its KV landed), which the gateway already has: only its finish, if it ends the request, is sent."""
        num_steps, num_tokens, last = 0, 0, time.monotonic()
        reason = counters = None
        cached = 0
        with _tracer.start_as_current_span(spans.DECODE_STREAM) as stream_span:
            try:
                async for out in self.engine.stream(rid, stream):
                    now = time.monotonic()
                    if remote and num_tokens == 0:
                        num_tokens, cached, last = 1, out.num_cached_tokens, now
                        reason, counters = out.finish_reason, out.counters
                        if out.finished:  # the prefill's token was the last one
                            yield decode_pb2.DecodeResponse(delta=decode_pb2.TokenDelta(
                                finish_reason=finish_reason_to_proto(out.finish_reason)))
                        continue
                    delta = _delta(out)
                    if num_tokens == 0:  # a local prefill's first token
                        cached = delta.num_cached_tokens = out.num_cached_tokens
                        scheduled = out.counters.first_scheduled_time if out.counters else None
                        delta.queue_seconds = max(0.0, (scheduled or arrival) - arrival)
                    else:
                        self.metrics.inter_token_latency.observe(now - last)
                    last = now
                    num_steps += 1
                    num_tokens += len(out.new_token_ids)
                    reason, counters = out.finish_reason, out.counters or counters
                    yield decode_pb2.DecodeResponse(delta=delta)
            finally:
                self.metrics.generation_tokens.inc(num_tokens)
                if stream_span.is_recording():
                    _stream_attributes(stream_span, counters, num_steps, num_tokens)
        finish = reason.value if reason is not None else "unknown"
        self.metrics.request_finished(finish, time.monotonic() - arrival)
        if span.is_recording():
            span.set_attributes({spans.COMPLETION_TOKENS: num_tokens, spans.FINISH_REASONS: [finish],
                                 spans.CACHED_TOKENS: cached})

    async def _reserve(self, rid: str, prompt: list[int], params: SamplingParams, eos: tuple[int, ...],
                       transfer_id: str, stream: asyncio.Queue[RequestOutput | Exception],
                       ) -> tuple[tuple[int, ...], int]:
        """The request's blocks and cached tokens, as the engine announces them on the stream: at once when
        they are free, else after waiting in its admission queue (at most ``queue_timeout_s``; a cancelled
        call leaves the queue)."""
        await self.engine.call(ReserveKV(rid, tuple(prompt), params, transfer_id, eos))
        try:
            item = await asyncio.wait_for(stream.get(), self.queue_timeout_s)
        except BaseException as exc:
            await asyncio.shield(self.engine.call(AbortRequest(rid)))
            if isinstance(exc, TimeoutError):
                needed = -(-len(prompt) // self.block_size)
                raise ResourceExhaustedError(
                    f"no KV room on {self.node_id} within queue_timeout_s = {self.queue_timeout_s:g}s: the prompt "
                    f"needs {needed} blocks, {self._engine_stats().free_blocks} are free") from None
            raise
        if isinstance(item, Exception):
            raise item
        assert item.reserved_block_ids is not None, "a reservation's first output announces its blocks"
        return item.reserved_block_ids, item.num_cached_tokens

    async def Stats(
        self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.NodeStats:
        # Read without queueing behind the engine: a long step must not make the node look down to the
        # gateway's poller. Counters read mid-step may be one step stale, which routing tolerates.
        return stats_to_proto(self._engine_stats(), self.node_id, "decode")

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        async for batch in self.kv_events.subscribe(request):
            yield batch


def _record_receive(result: TransferResult, num_blocks: int, transfer_id: str, wait_span: trace.Span) -> None:
    """The receive side of the transfer, first chunk announced -> everything landed, as a span under the
    prefill's send span (its context came in the KV messages), linked to the decode node's wait."""
    end_ns = time.time_ns()
    start_ns = end_ns - int(result.seconds * 1e9)
    sender = context_from_headers(result.trace_context)
    parent = sender if sender is not None else trace.set_span_in_context(wait_span)
    attributes = {spans.TRANSFER_ID: transfer_id, **spans.transfer_attributes(result.bytes, result.seconds,
                                                                              num_blocks)}
    spans.record_span(_tracer, spans.KV_RECEIVE, start_ns, end_ns, attributes, parent=parent, kind=spans.CONSUMER,
                      links=[Link(wait_span.get_span_context())] if sender is not None else ())


def _stream_attributes(span: trace.Span, state: RequestCounters | None, num_steps: int, num_tokens: int) -> None:
    """Per-request engine counters, from the request's last output (None: it did not finish, e.g. cancelled)."""
    span.set_attributes({spans.NUM_STEPS: num_steps, spans.COMPLETION_TOKENS: num_tokens})
    if state is None:
        return
    span.set_attribute(spans.PREEMPTIONS, state.num_preemptions)
    if state.num_draft_tokens:
        span.set_attributes({spans.SPEC_DRAFT_TOKENS: state.num_draft_tokens,
                             spans.SPEC_ACCEPTED_TOKENS: state.num_accepted_tokens,
                             spans.SPEC_ACCEPTANCE: round(state.num_accepted_tokens / state.num_draft_tokens, 4)})


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
