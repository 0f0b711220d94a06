"""The prefill node's gRPC servicer: thin and async over the prefill engine and the KV sender.

Telemetry at this edge: the ``prefill`` span (a child of the gateway's, through the gRPC metadata) with
``prefill.queue``, one ``prefill.chunk`` per chunk (timed on the engine thread, made into spans here) and
``kv_transfer.send``, whose context travels to the decode node in the KV control messages; plus the
node's TTFT, queue, prefill-time and transfer metrics.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from common.engine.commands import AbortRequest, AddRequest, AttachDestination, ChunkTiming, KVDestination
from common.engine.kv_event_publisher import KVEventPublisher
from common.errors import InvalidRequestError
from common.protocol import logprob_to_proto, sampling_from_proto, stats_to_proto
from common.serving.errors import DeadlineExceededError, ServiceError
from common.serving.status import StatusInterceptor
from common.telemetry import spans
from common.telemetry.logs import request_scope
from common.telemetry.metrics import PrefillMetrics
from common.telemetry.propagation import context_headers
from common.telemetry.tracing import get_tracer
from kv_transfer.errors import TransferFailed
from prefill_service.kv_producer import KVProducer
from tandem.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

if TYPE_CHECKING:
    from common.engine.async_engine import AsyncEngine
    from common.engine.request import RequestCounters, RequestOutput
    from kv_transfer.sender import KVSender, TransferHandle, TransferStats

log = logging.getLogger(__name__)
_tracer = get_tracer(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: AsyncEngine, sender: KVSender, node_id: str, transfer_timeout_s: float,
                 metrics: PrefillMetrics | None = None, status_for: spans.StatusFor | None = None) -> None:
        assert isinstance(engine.engine.connector, KVProducer), "a prefill node's engine has the KV producer role"
        self.engine = engine
        self.block_size = engine.engine.block_size
        self._engine_stats = engine.engine.stats  # read without queueing (see Stats)
        self.kv_events = KVEventPublisher(engine, node_id, "prefill")
        self.sender = sender
        self.node_id = node_id
        self.transfer_timeout_s = transfer_timeout_s
        self.metrics = metrics or PrefillMetrics(node_id)
        self._status_for = status_for or StatusInterceptor().status_for

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        return await self._serve(request, context, None)

    async def PrefillStream(
        self, request_iterator: AsyncIterator[prefill_pb2.PrefillMessage], context: grpc.aio.ServicerContext
    ) -> None:
        """``Prefill`` started before its destination is known: the first message is the request, the second
        its destination (none when the request carries one). Compute starts at once; see ``_prefill``. Answers
        twice: the first token once it is sampled (``kv_pending``), the whole answer once the transfer ended."""
        first = await _next_message(request_iterator)
        if first is None or first.WhichOneof("message") != "request":
            raise InvalidRequestError("request", "the stream's first message must be the PrefillRequest")
        request = first.request
        later = None if request.HasField("destination") else _destination_from(request_iterator, context)
        await context.write(await self._serve(request, context, later, early=context.write))

    async def _serve(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext,
                     later: Coroutine[object, object, prefill_pb2.KVDestination] | None,
                     early: Callable[[prefill_pb2.PrefillResponse], Awaitable[None]] | None = None,
                     ) -> prefill_pb2.PrefillResponse:
        with (_tracer.start_as_current_span(spans.PREFILL, kind=spans.SERVER, record_exception=False,
                                            set_status_on_exception=False) as span,
              request_scope(request.request_id)):
            try:
                reply = await self._prefill(request, context, span, later, early)
            except BaseException as exc:
                spans.record_failure(span, exc, self._status_for, log, "prefill failed")
                raise
            finally:
                if later is not None and inspect.getcoroutinestate(later) == inspect.CORO_CREATED:
                    later.close()  # never awaited (the request failed first): no warning about it
            spans.set_ok(span)
            return reply

    async def _prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext,
                       span: trace.Span, later: Coroutine[object, object, prefill_pb2.KVDestination] | None,
                       early: Callable[[prefill_pb2.PrefillResponse], Awaitable[None]] | None = None,
                       ) -> prefill_pb2.PrefillResponse:
        """Prefill the prompt and push its KV into the destination: ``request.destination``, or, with ``later``,
        the one it reads (the prompt computes meanwhile, its KV held here; it is aborted when none comes within
        the KV timeout). Then sample the first token, tell the caller (``early``, with ``kv_pending`` set) at once,
        before anything of the transfer: on a node with one core, the first token's way out runs ahead of the
        attach's reply and the transfer's end (the client's time to first token is the request's critical path,
        the decode node's first step after the KV lands is not); then tell the decode node and wait for the
        transfer's end. A failure after the early answer ends the call with its status, as a failed transfer
        does: the caller already has the first token and continues the request elsewhere."""
        arrival = time.monotonic()
        arrival_ns = time.time_ns()
        params = sampling_from_proto(request.sampling, resumed_output_tokens=request.resumed_output_tokens)
        prompt = list(request.prompt_token_ids)
        traced = span.is_recording()
        if traced:
            span.set_attributes({spans.REQUEST_ID: request.request_id, spans.NODE: self.node_id,
                                 spans.PROMPT_TOKENS: len(prompt)})
        if later is None:
            self._check_destination(request.destination, len(prompt), span)
        # The engine's id for this call: a resend of the same request may arrive while the last is still aborting.
        rid = f"{request.request_id}@{uuid.uuid4().hex[:8]}"
        chunk_timings: list[ChunkTiming] | None = [] if traced else None
        eos = tuple(request.eos_token_ids)
        stream = self.engine.open_stream(rid)
        send_span: trace.Span | None = None
        handle: TransferHandle | None = None
        computing: asyncio.Task[tuple[list[RequestOutput], float]] | None = None
        attaching: asyncio.Future[bool] | None = None
        try:
            try:
                if later is None:
                    dest = request.destination
                    send_span, handle = await self._open_transfer(dest, context)
                    await self.engine.call(AddRequest(rid, tuple(prompt), params, eos, self._destination(dest, handle),
                                                      chunk_timings))
                else:
                    await self.engine.call(AddRequest(rid, tuple(prompt), params, eos, chunk_timings=chunk_timings,
                                                      awaits_destination=True))
                    # The prompt computes (its first token may come) while the destination is on its way.
                    computing = asyncio.ensure_future(self._first_output(rid, stream))
                    try:
                        dest = await asyncio.wait_for(later, self.transfer_timeout_s)
                    except TimeoutError:
                        raise DeadlineExceededError(f"no KV destination within the KV timeout "
                                                    f"({self.transfer_timeout_s:g} s)") from None
                    self._check_destination(dest, len(prompt), span)
                    send_span, handle = await self._open_transfer(dest, context)
                    # Applied between steps: the first token may come before its reply (awaited after `early`).
                    attaching = asyncio.ensure_future(self.engine.call(
                        AttachDestination(rid, self._destination(dest, handle))))
                outputs, first_token_time = await (computing or self._first_output(rid, stream))
                reply, counters = self._reply(outputs, first_token_time, arrival)
                if early is not None:
                    pending = prefill_pb2.PrefillResponse()
                    pending.CopyFrom(reply)
                    pending.kv_pending = True
                    await early(pending)
                if attaching is not None and not await attaching:
                    raise ServiceError("the request left the prefill engine before its destination came")
            except BaseException as exc:
                if computing is not None:
                    computing.cancel()
                if attaching is not None and not attaching.done():
                    attaching.cancel()
                if handle is not None:
                    await _drain(handle, f"prefill failed: {exc!r}", self.transfer_timeout_s)
                self.engine.close_stream(rid)
                self.engine.submit(AbortRequest(rid))
                raise
            assert handle is not None and send_span is not None
            # The first token is out and the destination attached, so every block of the prompt has been pushed
            # but those cached there or outside the decode node's window.
            num_blocks = max(-(-len(prompt) // self.block_size) - _unsent_blocks(dest, self.block_size), 0)
            stats = await self._transfer(handle, rid, reply, num_blocks, send_span)
        except BaseException as exc:
            if send_span is not None:
                spans.set_error(send_span, exc, spans.failure_code(exc, self._status_for))
            raise
        finally:
            if send_span is not None:
                send_span.end()
        reply.transfer_bytes, reply.transfer_seconds = stats.bytes, stats.seconds
        if traced:
            self._record_spans(span, reply, counters, arrival_ns, chunk_timings or [])
        return reply

    def _check_destination(self, dest: prefill_pb2.KVDestination, num_prompt_tokens: int, span: trace.Span) -> None:
        """Caller mistakes in the destination, named by field; the span gets its attributes."""
        bs = self.block_size
        if span.is_recording():
            span.set_attributes({spans.TRANSFER_ID: dest.transfer_id, spans.KV_PEER: dest.node_id,
                                 spans.DEST_CACHED_TOKENS: dest.num_cached_tokens})
        if dest.first_block * bs >= num_prompt_tokens:
            raise InvalidRequestError("destination.first_block", f"{dest.first_block} blocks of {bs} must be before "
                                      f"the prompt's last token ({num_prompt_tokens} tokens)")
        if (dest.first_block + len(dest.block_ids)) * bs < num_prompt_tokens:
            raise InvalidRequestError("destination.block_ids", f"{len(dest.block_ids)} blocks of {bs} from block "
                                      f"{dest.first_block} cannot hold {num_prompt_tokens} prompt tokens")
        if dest.num_cached_tokens >= num_prompt_tokens:
            raise InvalidRequestError("destination.num_cached_tokens",
                                      f"must be < the prompt's {num_prompt_tokens} tokens")

    async def _open_transfer(self, dest: prefill_pb2.KVDestination, context: grpc.aio.ServicerContext,
                             ) -> tuple[trace.Span, TransferHandle]:
        # The send span's context rides in the KV control messages: the decode node's receive span hangs off it.
        send_span = _tracer.start_span(spans.KV_SEND, kind=spans.PRODUCER,
                                       attributes={spans.TRANSFER_ID: dest.transfer_id, spans.KV_PEER: dest.node_id})
        trace_context = context_headers(send_span) if send_span.is_recording() else _trace_context(context)
        try:
            return send_span, await self.sender.open(dest.transfer_id, dest, trace_context)
        except BaseException as exc:
            spans.set_error(send_span, exc, spans.failure_code(exc, self._status_for))
            send_span.end()
            raise

    def _destination(self, dest: prefill_pb2.KVDestination, handle: TransferHandle) -> KVDestination:
        return KVDestination(handle, tuple(dest.block_ids), _unsent_blocks(dest, self.block_size), dest.first_block)

    async def _first_output(self, rid: str, stream: asyncio.Queue[RequestOutput | Exception],
                            ) -> tuple[list[RequestOutput], float]:
        """The request's outputs up to its first token (the prompt computed), and when that came."""
        outputs = [out async for out in self.engine.stream(rid, stream)]
        return outputs, time.monotonic()

    def _reply(self, outputs: list[RequestOutput], first_token_time: float, arrival: float,
               ) -> tuple[prefill_pb2.PrefillResponse, RequestCounters | None]:
        """The answer (first token, cached tokens, queue and compute time) and the node's metrics."""
        first = outputs[-1]
        counters = first.counters
        token = first.new_token_ids[0]
        logprob = None
        if first.logprobs:
            lp, top = first.logprobs[0]
            logprob = logprob_to_proto(token, lp, top)
        compute_start = counters.first_scheduled_time if counters and counters.first_scheduled_time else arrival
        m = self.metrics
        m.time_to_first_token.observe(first_token_time - arrival)
        m.request_queue_time.observe(max(0.0, compute_start - arrival))
        m.request_prefill_time.observe(first_token_time - compute_start)
        reply = prefill_pb2.PrefillResponse(
            first_token=token, first_logprob=logprob, num_cached_tokens=first.num_cached_tokens,
            queue_seconds=max(0.0, compute_start - arrival), compute_seconds=first_token_time - compute_start,
        )
        return reply, counters

    async def _transfer(self, handle: TransferHandle, rid: str, reply: prefill_pb2.PrefillResponse,
                        num_blocks: int, send_span: trace.Span) -> TransferStats:
        """Tell the decode node the first token and wait until every send ended. The blocks held for the transfer
        are freed by the engine once it ends (its connector hears it from the handle); a failed one's request is
        aborted here."""
        finished = False
        try:
            first_logprob = reply.first_logprob if reply.HasField("first_logprob") else None
            handle.complete(reply.first_token, first_logprob, reply.num_cached_tokens)
            stats = await handle.wait(self.transfer_timeout_s)
            finished = True
        except BaseException as exc:
            if isinstance(exc, TransferFailed):
                self.metrics.kv_transfer_failures.inc()
            await _drain(handle, f"prefill failed: {exc!r}", self.transfer_timeout_s)
            raise
        finally:
            self.engine.close_stream(rid)
            if not finished:  # no send is in flight any more (or the group timed out): the blocks can go
                self.engine.submit(AbortRequest(rid))
        self.metrics.transfer_done(stats.bytes, stats.seconds)
        if send_span.is_recording():
            send_span.set_attributes(spans.transfer_attributes(stats.bytes, stats.seconds, num_blocks))
            send_span.set_attribute(spans.KV_CHUNKS, stats.num_chunks)
        return stats

    def _record_spans(self, span: trace.Span, reply: prefill_pb2.PrefillResponse, counters: RequestCounters | None,
                      arrival_ns: int, chunk_timings: list[ChunkTiming]) -> None:
        """Attributes of the prefill span, and its queue and chunk children from the recorded timings."""
        span.set_attributes({spans.CACHED_TOKENS: reply.num_cached_tokens, spans.QUEUE_S: reply.queue_seconds,
                             spans.COMPUTE_S: reply.compute_seconds,
                             spans.PREEMPTIONS: counters.num_preemptions if counters else 0})
        parent = trace.set_span_in_context(span)
        queue_end = chunk_timings[0].start_ns if chunk_timings else arrival_ns + int(reply.queue_seconds * 1e9)
        spans.record_span(_tracer, spans.PREFILL_QUEUE, arrival_ns, queue_end, parent=parent)
        for i, t in enumerate(chunk_timings):
            spans.record_span(_tracer, spans.PREFILL_CHUNK, t.start_ns, t.end_ns, parent=parent, attributes={
                spans.CHUNK_INDEX: i, spans.CHUNK_START: t.start_token, spans.CHUNK_TOKENS: t.num_tokens,
                spans.STEP_TOKENS: t.step_tokens})

    async def Stats(
        self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.NodeStats:
        # Read without queueing behind the engine: a long step must not make the node look down to the
        # gateway's poller. Counters read mid-step may be one step stale, which routing tolerates.
        return stats_to_proto(self._engine_stats(), self.node_id, "prefill")

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        async for batch in self.kv_events.subscribe(request):
            yield batch


async def _next_message(messages: AsyncIterator[prefill_pb2.PrefillMessage]) -> prefill_pb2.PrefillMessage | None:
    """The stream's next message; None once it ended."""
    msg = await anext(messages, None)
    if msg is not None and not isinstance(msg, prefill_pb2.PrefillMessage):
        raise InvalidRequestError("request", "a message of the stream cannot be parsed")
    return msg


async def _destination_from(messages: AsyncIterator[prefill_pb2.PrefillMessage],
                            context: grpc.aio.ServicerContext) -> prefill_pb2.KVDestination:
    """The stream's second message: the destination of the request it began with."""
    msg = await _next_message(messages)
    if msg is None and context.cancelled():
        raise asyncio.CancelledError("the caller cancelled the call")  # its stream ends with it: not its mistake
    if msg is None:
        raise InvalidRequestError("destination", "the stream ended before the KV destination came")
    if msg.WhichOneof("message") != "destination":
        raise InvalidRequestError("destination", "the stream's second message must be the KVDestination")
    return msg.destination


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


def _unsent_blocks(dest: prefill_pb2.KVDestination, block_size: int) -> int:
    """The prompt's leading blocks not sent to ``dest``: cached on the decode node, or outside its window there."""
    return max(dest.num_cached_tokens // block_size, dest.first_block)
