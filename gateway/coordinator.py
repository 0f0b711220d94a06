"""One request across two nodes: reserve on a decode node and prefill at once, the prefill's KV destination
following the reservation; relay the tokens.

    client ── Generate ──> gateway
                             ├─ Decode.Generate ──> decode node: Reservation, then TokenDeltas
                             └─ Prefill.PrefillStream ──> prefill node: the request (computes at once), then the
                                                          reservation as its destination (pushes KV into it);
                                                          answers with the first token, then the transfer's end
As vLLM's and Dynamo's routers do, the prefill does not wait for the decode node's reservation (which waits
for its engine's step, or for free blocks): the prompt computes meanwhile and its KV is held on the prefill
node until the destination comes.
With conditional disaggregation (``gateway.prefill_policy``) a short prompt skips the prefill node: the decode
node computes it itself (``prefill_locally``) and its first TokenDelta carries the first token.
The first token goes to the client as soon as the prefill node sampled it, before the KV transfer's acks (a
transfer that fails after it continues the request elsewhere, as a lost node's does); the decode stream is read
by its own task into a queue, so the decode node never waits for a slow client, and each client message carries
everything that queued up since the previous one. Whatever ends the request (its end, a stop string,
a failure, the client's cancel, a deadline) cancels whichever leg is still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias, TypeVar

import grpc
from opentelemetry import trace

from common.kv.block_hash import hash_prompt_blocks
from common.protocol import sampling_to_proto
from common.serving.errors import DeadlineExceededError, ServiceError, UnavailableError
from common.telemetry import spans
from common.telemetry.metrics import GatewayMetrics
from gateway.decode_leg import DecodeLeg, QueueItem, Reader, StreamEnd, cancelled_under_us, cancelling, start_reading
from gateway.model import ServedModel
from gateway.node_pool import NodePool
from gateway.output import Delta, OutputChunk, OutputProcessor, Timings, Usage, coalesced_chunks, visible
from gateway.prefill_call import PrefillCall
from gateway.prefill_policy import LocalPrefillPolicy, prefill_locally
from gateway.request import GatewayRequest
from gateway.router import NodeState, Router
from gateway.settings import DEFAULT_MIGRATION_LIMIT
from tandem.v1 import decode_pb2, prefill_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")

# A node's status that means the same to our client, passed on as it is; other codes become INTERNAL.
_PASSED_ON = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION})


# Failures of the prefill leg after which the decode node can still compute the prompt itself
# (--kv-load-failure-policy recompute): a node or a transfer broke. Not the caller's mistakes, not the deadline.
_RECOMPUTED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                         grpc.StatusCode.ABORTED})


class NodeLostError(UnavailableError):
    """A node went away under a request (its stream or call failed UNAVAILABLE, or was cancelled by the node):
    the request may continue elsewhere (``Coordinator.generate`` migrates it)."""

    def __init__(self, message: str, role: str, target: str) -> None:
        super().__init__(message)
        self.role, self.target = role, target



# A reserved decode leg, the queue its stream is read into and the reader.
_Reserved: TypeAlias = tuple[DecodeLeg, asyncio.Queue[QueueItem], Reader]
# The prefill node that answered, its first answer (the first token), when it was called, and the task that
# reads the rest of its call (the transfer's end: its bytes and seconds, or the failure).
_Prefilled: TypeAlias = tuple[NodeState, prefill_pb2.PrefillResponse, float,
                              asyncio.Task[prefill_pb2.PrefillResponse]]


@dataclass
class _Run:
    """One request across its attempts: what the client is told at the end comes from the first attempt that
    produced a first token (time to first token, queue time, cached prompt tokens), the KV moved is summed."""

    migrations: int = 0
    lost: list[str] = field(default_factory=list)  # targets of the nodes lost under this request
    first_token_time: float | None = None
    queue_seconds: float = 0.0
    cached_tokens: int = 0
    kv_seconds: float = 0.0
    kv_bytes: int = 0
    prefill_node: str = ""  # the node that prefilled the client's prompt

    def prefilled(self, reply: prefill_pb2.PrefillResponse, node_id: str, waited_s: float, now: float) -> None:
        """A prefill node answered with a first token ``waited_s`` after the request arrived."""
        self.transferred(reply)
        if self.first_token_time is None:
            self.first_token_time, self.prefill_node = now, node_id
            self.queue_seconds = waited_s + reply.queue_seconds
            self.cached_tokens = reply.num_cached_tokens

    def transferred(self, reply: prefill_pb2.PrefillResponse) -> None:
        """A prefill's KV transfer ended (a first answer with ``kv_pending`` counts nothing)."""
        self.kv_seconds += reply.transfer_seconds
        self.kv_bytes += reply.transfer_bytes

    def prefilled_locally(self, decode: DecodeLeg, now: float) -> None:
        """A decode node prefilled the prompt itself and sent its first token."""
        if self.first_token_time is None:
            self.first_token_time, self.prefill_node = now, decode.node_id
            self.queue_seconds, self.cached_tokens = decode.queue_seconds, decode.cached_tokens


def continued(req: GatewayRequest, streamed: Sequence[int]) -> GatewayRequest:
    """``req`` continued after the ``streamed`` tokens its client already has: they join the prompt (their KV
    is prefilled again), max_tokens and min_tokens count them, and ``resumed_output_tokens`` tells the
    sampler they are output (penalties count them; seeded randomness goes on at their position), so the
    continuation samples what an undisturbed run would have."""
    if not streamed:
        return req
    k = len(streamed)
    s = req.sampling
    sampling = replace(s, max_tokens=s.max_tokens - k, min_tokens=max(0, s.min_tokens - k),
                       resumed_output_tokens=s.resumed_output_tokens + k)
    return replace(req, prompt_token_ids=(*req.prompt_token_ids, *streamed), sampling=sampling)


class Coordinator:
    """The disaggregated ``GenerateBackend``: runs Generate requests over the nodes of one ``Router``."""

    def __init__(self, model: ServedModel, router: Router, pool: NodePool, kv_timeout_s: float,
                 local_prefill: LocalPrefillPolicy | None = None,
                 recompute_on_kv_failure: bool = False, migration_limit: int = DEFAULT_MIGRATION_LIMIT,
                 metrics: GatewayMetrics | None = None) -> None:
        self._model = model
        # A request's stream that lost its node continues on another one this many times (0: it fails).
        self._migration_limit = migration_limit
        self._metrics = metrics or GatewayMetrics()
        self._router = router
        self._pool = pool
        self._kv_timeout_s = kv_timeout_s
        self._local_prefill = local_prefill or LocalPrefillPolicy()
        self._recompute_on_kv_failure = recompute_on_kv_failure
        # Tokens of prompts a decode node prefills itself, routed but not answered by it yet: its backlog to come
        # (gateway.prefill_policy counts it). A remote prompt needs no such count: it is on its prefill node's
        # backlog (node.begin_prefill) at once, before the decode node has reserved.
        self._queued: Counter[str] = Counter()

    @property
    def block_size(self) -> int:
        return self._pool.block_size  # what the nodes report

    async def generate(self, req: GatewayRequest, arrival: float, deadline: float,
                       ) -> AsyncGenerator[OutputChunk, None]:
        """``GenerateBackend.generate`` over the nodes; the deadline is passed on to both of them.

        A node lost mid-request (``NodeLostError``) is migrated around, up to ``migration_limit`` times: the
        request continues on other nodes from its prompt plus the tokens already handed to the client
        (``continued``), through the same ``OutputProcessor``, so the client's stream goes on where it was.
        Raises ``ServiceError`` subclasses when a node fails past that budget or none is reachable.
        """
        out = OutputProcessor(self._model.tokenizer, req.prompt_token_ids, req.stop, req.include_stop_string)
        run = _Run()
        span = trace.get_current_span()
        while True:
            attempt = continued(req, out.token_ids)
            try:
                # aclosing: when the client goes away mid-attempt, its legs are cancelled now, not at collection.
                async with contextlib.aclosing(self._attempt(req, attempt, out, run, arrival, deadline)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            except NodeLostError as exc:
                streamed = len(out.token_ids)
                if run.migrations >= self._migration_limit or streamed >= req.sampling.max_tokens:
                    if self._migration_limit and span.is_recording():
                        span.add_event("migration_limit_reached", {spans.MIGRATIONS: run.migrations})
                    raise
                run.migrations += 1
                run.lost.append(exc.target)
                self._metrics.request_migrated(exc.role)
                log.warning("%s: %s; migrating (%d of at most %d) after %d streamed token(s)", req.request_id,
                            exc, run.migrations, self._migration_limit, streamed)
                if span.is_recording():
                    span.add_event("migrated", {spans.MIGRATIONS: run.migrations, spans.NODE: exc.target,
                                                spans.LOST_ROLE: exc.role, spans.STREAMED_TOKENS: streamed,
                                                "exception.message": str(exc)})
                    span.set_attribute(spans.MIGRATIONS, run.migrations)

    async def _attempt(self, req: GatewayRequest, attempt: GatewayRequest, out: OutputProcessor, run: _Run,
                       arrival: float, deadline: float) -> AsyncGenerator[OutputChunk, None]:
        """One run of ``attempt`` (``req`` itself, or ``req`` continued after a migration) on a decode node and,
        unless it prefills locally, a prefill node; its chunks go on ``out``'s stream."""
        resumed = bool(out.token_ids) or run.migrations > 0
        block_hashes = hash_prompt_blocks(attempt.prompt_token_ids, self.block_size)
        num_prompt_blocks = len(attempt.prompt_token_ids) // self.block_size
        local_target = self._prefill_locally(attempt, block_hashes, num_prompt_blocks)
        span = trace.get_current_span()
        prefilled: _Prefilled | None = None  # None: the decode node prefills the prompt (or recomputes it)
        if local_target is None:
            # The prefill starts at once, its destination follows the reservation (_remote_prefill).
            decode, queue, reader, prefilled = await self._remote_prefill(req, attempt, run, deadline,
                                                                          num_prompt_blocks, block_hashes)
        else:
            # Until the decode node answers, its backlog does not hold the prompt: count it meanwhile.
            num_tokens = len(attempt.prompt_token_ids)
            self._queued[local_target] += num_tokens
            try:
                decode = await self._reserve(attempt, deadline, num_prompt_blocks, True, avoid=run.lost,
                                             block_hashes=block_hashes)
            finally:
                self._queued[local_target] -= num_tokens
            if span.is_recording():
                span.add_event("local_prefill", {spans.DECODE_NODE: decode.node_id})
            queue, reader = start_reading(decode, attempt.request_id)
        # out.source_finished: the decode node sent its finish reason, so its call ends by itself.
        transfer: asyncio.Task[prefill_pb2.PrefillResponse] | None = None
        try:
            first: OutputChunk | None = None
            if prefilled is not None:
                prefill_node, reply, prefill_started, transfer = prefilled
                # The KV may still be landing: a transfer that fails now ends the attempt through the decode queue.
                transfer.add_done_callback(functools.partial(_queue_failure, queue))
                first = OutputChunk()
                out.add(first, [reply.first_token], [reply.first_logprob] if reply.HasField("first_logprob") else [])
                decode.first_token_time = time.monotonic()
                run.prefilled(reply, prefill_node.node_id, prefill_started - arrival, decode.first_token_time)
                if span.is_recording():
                    span.add_event("first_token", {spans.PREFILL_NODE: prefill_node.node_id,
                                                   spans.CACHED_TOKENS: reply.num_cached_tokens})
            to_delta = functools.partial(self._delta, decode=decode, run=run)
            async for chunk in coalesced_chunks(out, queue, to_delta, req, first):
                if resumed and not out.finished and not visible(chunk, req):
                    continue  # the client's stream goes on: no empty "first" message after a migration
                if out.finished:
                    if not out.source_finished:  # a stop string ended it: abort the rest on the decode node now
                        decode.call.cancel()
                    elif transfer is not None:
                        await _transfer_ended(transfer, run, req.request_id)
                    # The decode node's prefix cache now holds the conversation so far (every token but the last,
                    # whose K/V no step computed): its next turn is routed there (Router.pick_decode).
                    history = (*req.prompt_token_ids, *out.token_ids[:-1])
                    self._router.record_history(hash_prompt_blocks(history, self.block_size), decode.node.target)
                    chunk.usage = Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=out.num_tokens,
                                        cached_tokens=run.cached_tokens)
                    chunk.timings = Timings(
                        queue_seconds=run.queue_seconds,
                        time_to_first_token=(run.first_token_time or time.monotonic()) - arrival,
                        e2e_seconds=time.monotonic() - arrival,
                        kv_transfer_seconds=run.kv_seconds,
                        kv_transfer_bytes=run.kv_bytes,
                        prefill_node=run.prefill_node or decode.node_id,
                        decode_node=decode.node_id,
                    )
                yield chunk
        finally:
            # Runs on success, failure, client cancel and deadline alike: nothing is left running.
            if transfer is not None:
                transfer.cancel()  # a no-op once it ended; else the prefill node aborts its transfer
            decode.release(reader, running=not out.source_finished)

    async def _remote_prefill(self, req: GatewayRequest, attempt: GatewayRequest, run: _Run, deadline: float,
                              num_prompt_blocks: int, block_hashes: list[bytes],
                              ) -> tuple[DecodeLeg, asyncio.Queue[QueueItem], Reader, _Prefilled | None]:
        """Reserve on a decode node and prefill on a prefill node at the same time: the prefill node computes
        while the decode node reserves, and gets the destination once the reservation is there. Returns the
        decode leg (reading) and the prefill's answer; None when the prefill failed and the decode node
        recomputes the prompt (--kv-load-failure-policy recompute). A failed reservation cancels the prefill
        call, a failed prefill the reservation; nothing is left running when this raises."""
        span = trace.get_current_span()
        reserving = asyncio.ensure_future(self._reserve_remote(attempt, deadline, num_prompt_blocks, run.lost,
                                                               block_hashes))
        try:
            prefilled = await self._prefill(attempt, reserving, block_hashes, deadline, avoid=run.lost)
        except ServiceError as exc:
            if _failed(reserving) or not (self._recompute_on_kv_failure and exc.code in _RECOMPUTED):
                await _discard(reserving)
                raise
            # The KV never arrived and the client has seen nothing more yet: the decode node prefills the prompt
            # itself (--kv-load-failure-policy recompute), on a fresh call.
            log.warning("%s: %s; the decode node recomputes the prompt", req.request_id, exc)
            if span.is_recording():
                span.add_event("kv_load_failed", {"exception.message": str(exc)})
            await _discard(reserving)
            decode = await self._reserve(attempt, deadline, num_prompt_blocks, local=True, avoid=run.lost,
                                         block_hashes=block_hashes)
            queue, reader = start_reading(decode, attempt.request_id)
            return decode, queue, reader, None
        except BaseException:
            await _discard(reserving)
            raise
        decode, queue, reader = reserving.result()  # the prefill had its destination: the reservation is there
        return decode, queue, reader, prefilled

    async def _reserve_remote(self, req: GatewayRequest, deadline: float, num_prompt_blocks: int,
                              avoid: Sequence[str], block_hashes: Sequence[bytes]) -> _Reserved:
        """A decode node's reservation for a remote prefill, its stream read from then on."""
        decode = await self._reserve(req, deadline, num_prompt_blocks, avoid=avoid, block_hashes=block_hashes)
        span = trace.get_current_span()
        r = decode.reservation
        if span.is_recording() and r is not None:
            span.add_event("reserved", {spans.DECODE_NODE: decode.node_id,
                                        spans.TRANSFER_ID: r.transfer_id, spans.RESERVED_BLOCKS: len(r.block_ids),
                                        spans.CACHED_TOKENS: r.num_cached_tokens})
        queue, reader = start_reading(decode, req.request_id)
        return decode, queue, reader

    def _delta(self, item: QueueItem, decode: DecodeLeg, run: _Run) -> Delta:
        if isinstance(item, ServiceError):  # the prefill's KV transfer failed after its first token
            raise item
        if isinstance(item, grpc.aio.AioRpcError):
            raise self._node_error("decode", decode.node, item)
        if isinstance(item, StreamEnd) or not item.HasField("delta"):
            what = "ended its stream" if isinstance(item, StreamEnd) else "sent a second reservation or answer"
            raise ServiceError(f"decode node {decode.node.target} {what} before a finish reason")
        d = item.delta
        if decode.first_token_time is None:  # a local prefill's first token
            decode.first_token_time = time.monotonic()
            decode.settle_backlog()
            decode.cached_tokens, decode.queue_seconds = d.num_cached_tokens, d.queue_seconds
            run.prefilled_locally(decode, decode.first_token_time)
        return Delta(d.token_ids, d.logprobs, d.finish_reason or None)

    def _prefill_locally(self, req: GatewayRequest, block_hashes: list[bytes], num_prompt_blocks: int,
                         ) -> str | None:
        """Conditional disaggregation: the target of the decode node the router would pick if it prefills this
        prompt itself, else None."""
        if self._local_prefill.max_tokens == 0:
            return None
        node = self._router.pick_decode(num_prompt_blocks, block_hashes=block_hashes)
        if node is None:
            return None
        cached = {target: blocks * self.block_size for target, blocks in
                  self._router.cached_blocks(block_hashes).items()}
        local = prefill_locally(self._local_prefill, len(req.prompt_token_ids), node,
                                list(self._router.prefill.values()), self.block_size, cached,
                                queued_local_tokens=self._queued[node.target],
                                decode_cached_tokens=cached.get(node.target, 0))
        return node.target if local else None

    async def _reserve(self, req: GatewayRequest, deadline: float, num_prompt_blocks: int,
                       local: bool = False, avoid: Sequence[str] = (), block_hashes: Sequence[bytes] = ()
                       ) -> DecodeLeg:
        """Open a decode stream and read its reservation (``local``: its local-prefill answer); a node that
        cannot be reached is replaced once. ``avoid``: nodes this request lost, taken only when no other is;
        ``block_hashes``: the prompt's, for the node holding its history (``Router.pick_decode``)."""
        request = decode_pb2.DecodeRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_to_proto(req.sampling), eos_token_ids=self._model.eos_token_ids,
            kv_timeout_seconds=min(self._kv_timeout_s, _remaining(deadline)), prefill_locally=local,
            resumed_output_tokens=req.sampling.resumed_output_tokens,
        )
        tried: list[str] = []
        while True:
            node = (self._router.pick_decode(num_prompt_blocks, exclude=[*tried, *avoid], block_hashes=block_hashes)
                    or self._router.pick_decode(num_prompt_blocks, exclude=tried, block_hashes=block_hashes))
            if node is None and not tried:
                # Every node looked down at the last poll; nodes come back between polls, so ask now.
                await self._pool.poll_once()
                node = self._router.pick_decode(num_prompt_blocks, exclude=tried)
            if node is None:
                raise UnavailableError(f"no reachable decode node (targets: {_members(self._router.decode)})")
            tried.append(node.target)
            call = self._pool.decode(node.target).Generate(request, timeout=_remaining(deadline))
            node.begin()
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as exc:
                node.end()
                error = self._node_error("decode", node, exc)
                if len(tried) == 1 and self._never_reached(node, exc):
                    log.warning("%s: %s; trying another decode node", req.request_id, error)
                    continue
                raise error from None
            except BaseException as exc:
                call.cancel()
                node.end()
                if isinstance(exc, asyncio.CancelledError) and not cancelling():
                    raise self._node_error("decode", node, cancelled_under_us()) from None
                raise
            expected = "local_prefill" if local else "reservation"
            if first is grpc.aio.EOF or not first.HasField(expected):
                call.cancel()
                node.end()
                raise ServiceError(f"decode node {node.target} answered without a {expected.replace('_', ' ')}")
            if not local:
                return DecodeLeg(node, call, first.reservation)
            node.begin_prefill(len(req.prompt_token_ids))
            return DecodeLeg(node, call, None, backlog_tokens=len(req.prompt_token_ids))

    async def _prefill(self, req: GatewayRequest, reserving: asyncio.Future[_Reserved], block_hashes: list[bytes],
                       deadline: float, avoid: Sequence[str] = ()) -> _Prefilled:
        """Prefill on a prefill node at once and send it the destination once ``reserving`` has it; a node that
        cannot be reached is replaced once (the reservation stays valid: nothing was written into it). Returns
        the node, its answer and when it was called. Raises the reservation's failure as it is.
        ``avoid``: nodes this request lost, taken only when no other is."""
        request = prefill_pb2.PrefillRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_to_proto(req.sampling), eos_token_ids=self._model.eos_token_ids,
            resumed_output_tokens=req.sampling.resumed_output_tokens,
        )
        tried: list[str] = []
        waited = False  # whether a prefill already timed out waiting for the reservation
        matched = self._router.cached_blocks(block_hashes)  # before pick_prefill records this prompt
        while True:
            node = (self._router.pick_prefill(block_hashes, exclude=[*tried, *avoid])
                    or self._router.pick_prefill(block_hashes, exclude=tried))
            if node is None and not tried:
                await self._pool.poll_once()
                node = self._router.pick_prefill(block_hashes, exclude=tried)
            if node is None:
                raise UnavailableError(f"no reachable prefill node (targets: {_members(self._router.prefill)})")
            tried.append(node.target)
            # The prompt is on the prefill node from now on, before the decode node has reserved.
            backlog = max(1, len(req.prompt_token_ids) - matched.get(node.target, 0) * self.block_size)
            node.begin()
            node.begin_prefill(backlog)
            started = time.monotonic()
            call = self._pool.prefill(node.target).PrefillStream(timeout=_remaining(deadline))
            rest: asyncio.Task[prefill_pb2.PrefillResponse] | None = None
            try:
                reply = await self._stream_prefill(call, request, reserving)
                # The call goes on until the transfer ended: its task owns it (and the node's count) from here.
                rest = asyncio.ensure_future(self._transfer_end(call, node))
                rest.add_done_callback(functools.partial(_end_prefill_call, call, node))
                return node, reply, started, rest
            except grpc.aio.AioRpcError as exc:
                if (exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not reserving.done() and not waited
                        and time.monotonic() < deadline):
                    # The prefill node gave up waiting for the destination (its KV timeout) while the decode node
                    # still waits for blocks: prefill again once the reservation is there, as a sequential
                    # reserve-then-prefill would have (the prompt's KV is likely in its prefix cache by now).
                    waited = True
                    tried.pop()
                    await asyncio.wait({reserving})
                    continue
                error = self._node_error("prefill", node, exc)
                if len(tried) == 1 and self._never_reached(node, exc):
                    log.warning("%s: %s; trying another prefill node", req.request_id, error)
                    continue
                raise error from None
            except asyncio.CancelledError:
                if cancelling():
                    raise
                raise self._node_error("prefill", node, cancelled_under_us()) from None
            finally:
                node.end_prefill(backlog)  # its compute is done (or failed)
                if rest is None:
                    call.cancel()  # the prefill node aborts and frees its blocks
                    node.end()

    async def _stream_prefill(self, call: grpc.aio.StreamStreamCall, request: prefill_pb2.PrefillRequest,
                              reserving: asyncio.Future[_Reserved]) -> prefill_pb2.PrefillResponse:
        """Write the request, then (once reserved) its destination, and await the first answer (the first token);
        give up as soon as the decode stream fails."""
        prefill = PrefillCall(call)
        answer: asyncio.Future[prefill_pb2.PrefillResponse] = asyncio.ensure_future(prefill.first_answer())
        try:
            await prefill.write(answer, prefill_pb2.PrefillMessage(request=request))
            # The call may fail (its node unreachable) before the reservation comes: that is seen at once.
            legs: set[asyncio.Future[Any]] = {reserving, answer}
            await asyncio.wait(legs, return_when=asyncio.FIRST_COMPLETED)
            if answer.done() or not reserving.done():
                await answer  # raises the call's failure
                raise ServiceError("the prefill node answered before its KV destination was sent")
            decode, _, reader = reserving.result()  # raises the reservation's failure
            r = decode.reservation
            assert r is not None, "a local prefill has no prefill leg"
            await prefill.write(answer, prefill_pb2.PrefillMessage(destination=prefill_pb2.KVDestination(
                kv_endpoint=r.kv_endpoint, node_id=r.node_id, transfer_id=r.transfer_id, block_ids=r.block_ids,
                num_cached_tokens=r.num_cached_tokens, first_block=r.first_block)))
            await prefill.write(answer, None)
            return await self._unless_decode_fails(answer, reader, decode)
        finally:
            answer.cancel()

    async def _unless_decode_fails(self, awaitable: Awaitable[T], reader: Reader,
                                   decode: DecodeLeg) -> T:
        """Await ``awaitable``, but give up (cancelling it) as soon as the decode stream fails."""
        task = asyncio.ensure_future(awaitable)
        try:
            done, _ = await asyncio.wait({task, reader}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done and (failure := reader.result()) is not None:
                raise self._node_error("decode", decode.node, failure)
            # Otherwise the decode stream ended cleanly (a request that finished at its first token).
            return await task
        finally:
            task.cancel()

    async def _transfer_end(self, call: grpc.aio.StreamStreamCall, node: NodeState) -> prefill_pb2.PrefillResponse:
        """The prefill call's second answer: its KV transfer ended. A failure is a ``ServiceError``; one the decode
        node could have recomputed (--kv-load-failure-policy recompute) comes after the client saw the first
        token, so the request continues elsewhere from it (``NodeLostError``: ``generate`` migrates it)."""
        try:
            final = await call.read()
        except grpc.aio.AioRpcError as exc:
            error = self._node_error("prefill", node, exc)
            if (self._recompute_on_kv_failure and exc.code() in _RECOMPUTED
                    and not isinstance(error, NodeLostError)):
                raise NodeLostError(str(error), "prefill", node.target) from None
            raise error from None
        except asyncio.CancelledError:
            if cancelling():
                raise  # the attempt ended
            raise self._node_error("prefill", node, cancelled_under_us()) from None
        if final is grpc.aio.EOF or final.kv_pending:
            raise ServiceError(f"prefill node {node.target} ended its call without the KV transfer's end")
        return final

    def _never_reached(self, node: NodeState, exc: grpc.aio.AioRpcError) -> bool:
        return exc.code() == grpc.StatusCode.UNAVAILABLE and not self._pool.is_connected(node.target)

    def _node_error(self, role: str, node: NodeState, exc: grpc.aio.AioRpcError) -> ServiceError:
        """The status our client gets for a node's failure; an unreachable node is taken out of routing."""
        code, what = exc.code(), f"{role} node {node.target}"
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            if not self._pool.is_connected(node.target):
                self._router.mark_unreachable(node.target)
            return NodeLostError(f"{what} unavailable: {exc.details()}", role, node.target)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceededError(f"{what} did not finish before the request's deadline")
        if code in _PASSED_ON:
            return ServiceError(f"{what}: {exc.details()}", code)
        return ServiceError(f"{what} failed: {code.name}: {exc.details()}")


def _end_prefill_call(call: grpc.aio.StreamStreamCall, node: NodeState, _: object) -> None:
    call.cancel()  # a no-op once it ended; else the prefill node aborts its transfer
    node.end()


def _queue_failure(queue: asyncio.Queue[QueueItem], transfer: asyncio.Task[prefill_pb2.PrefillResponse]) -> None:
    """A prefill's transfer that failed after its first token: its error goes where the attempt reads."""
    if not transfer.cancelled() and (error := transfer.exception()) is not None:
        queue.put_nowait(error if isinstance(error, ServiceError) else ServiceError(f"the prefill failed: {error!r}"))


async def _transfer_ended(transfer: asyncio.Task[prefill_pb2.PrefillResponse], run: _Run, request_id: str) -> None:
    """The request's tokens are all out: its KV landed (the decode node generated from it), so the prefill
    call's end only adds the transfer's bytes and seconds; a failure to report them is logged, not raised."""
    try:
        run.transferred(await transfer)
    except Exception as exc:
        log.warning("%s: the prefill's transfer did not report its end: %s", request_id, exc)


def _failed(reserving: asyncio.Future[_Reserved]) -> bool:
    """Whether the reservation failed (then its failure, not the prefill's, ends the attempt)."""
    return reserving.done() and (reserving.cancelled() or reserving.exception() is not None)


async def _discard(reserving: asyncio.Future[_Reserved]) -> None:
    """Cancel a reservation still under way, or release the one made: its decode call ends, its blocks go."""
    if not reserving.done():
        reserving.cancel()  # _reserve cancels its decode call and ends the node's count
        await asyncio.wait({reserving})
    if reserving.cancelled() or reserving.exception() is not None:
        return
    decode, _, reader = reserving.result()
    decode.release(reader)


def _members(nodes: dict[str, NodeState]) -> str:
    """The targets for an error message; a draining node is said so, and no member at all too."""
    return ", ".join(f"{t} (draining)" if n.draining else t for t, n in nodes.items()) or "none registered yet"


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)
