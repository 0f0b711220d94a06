"""Scripted prefill and decode nodes: real ``grpc.aio`` servers that speak the internal protocol with
deterministic tokens, and record what happened to each request (served, cancelled) for the tests.

The KV transfer is stood in for by ``KVBoard``: the scripted prefill "pushes" a transfer by resolving it on
the board, which is what the scripted decode node waits for before it streams the rest of the tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from common.serving.channel import open_channel
from common.serving.errors import DeadlineExceededError
from common.serving.port_reservation import reserve_port
from common.serving.server import RunningServer, start_server
from gateway.model import ServedModel
from gateway.server import serve_gateway
from gateway.settings import GatewaySettings
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, generate_pb2_grpc, prefill_pb2, prefill_pb2_grpc

DECODE_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
PREFILL_SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name

T = TypeVar("T")


class KVBoard:
    """transfer id -> the first token, resolved by the prefill that pushed the KV."""

    def __init__(self) -> None:
        self._transfers: dict[str, asyncio.Future[int]] = {}

    def open(self, transfer_id: str) -> asyncio.Future[int]:
        fut = self._transfers[transfer_id] = asyncio.get_running_loop().create_future()
        return fut

    def push(self, transfer_id: str, first_token: int) -> None:
        fut = self._transfers.get(transfer_id)
        if fut is None:
            raise KeyError(f"no reservation {transfer_id}")
        if not fut.done():
            fut.set_result(first_token)

    def close(self, transfer_id: str) -> None:
        self._transfers.pop(transfer_id, None)

    @property
    def open_transfers(self) -> int:
        return len(self._transfers)


def logprob(token: int, position: int) -> common_pb2.TokenLogprob:
    """The scripted logprob of the token at ``position`` of the generation."""
    return common_pb2.TokenLogprob(token_id=token, logprob=-0.5 * position)


@dataclass
class Script:
    """The generation every request gets: ``tokens[0]`` comes from the prefill, the rest from the decode.
    A migrated request (``resumed_output_tokens = k``: its prompt ends with ``tokens[:k]``) goes on at
    ``tokens[k]``, as a real engine's would."""

    tokens: list[int]
    token_delay_s: float = 0.0  # between decode deltas
    gate: asyncio.Event | None = None  # when set, decode deltas wait for it after the KV arrived


@dataclass
class Record:
    """What a scripted node saw."""

    requests: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)  # the decode's KV wait timed out


class ScriptedDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, node_id: str, board: KVBoard, script: Script, free_blocks: int = 1000) -> None:
        self.node_id, self.board, self.script, self.free_blocks = node_id, board, script, free_blocks
        # Stats' prefix-cache queries, hits, offload-tier hits and tier blocks, as a node reports them
        self.cache_counters = (0, 0, 0, 0)
        self.record = Record()
        self.last_request: decode_pb2.DecodeRequest | None = None
        self.num_cached_tokens = 0
        self.kv_endpoint = "127.0.0.1:1"
        self.stats_delay_s = 0.0  # how late Stats answers (a busy node)
        self.block_size = 16  # what Stats reports
        # After streaming this many token deltas of a request, hang (until the test stops the node: its death).
        self.hang_after: int | None = None
        self.hanging = asyncio.Event()  # set once a stream hangs there
        # After streaming this many token deltas of a request, end its call CANCELLED from this side (as a node
        # whose shutdown grace ran out cancels the RPCs still in flight).
        self.cancel_after: int | None = None
        # When set, the reservation waits for it (a busy engine, or a full pool); then, with reserve_fails_with,
        # the call fails with that status instead of reserving.
        self.reserve_gate: asyncio.Event | None = None
        self.reserve_fails_with: grpc.StatusCode | None = None
        self.reserved_at: dict[str, float] = {}  # request id -> when its reservation was sent (monotonic)

    async def Generate(self, request: decode_pb2.DecodeRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.DecodeResponse]:
        rid, transfer_id = request.request_id, f"{self.node_id}/{request.request_id}"
        self.record.requests.append(rid)
        self.last_request = request
        kv = self.board.open(transfer_id)
        try:
            if self.reserve_gate is not None:
                await self.reserve_gate.wait()
            if self.reserve_fails_with is not None:
                await context.abort(self.reserve_fails_with, f"scripted reservation failure on {self.node_id}")
            num_blocks = (len(request.prompt_token_ids) + 16) // 16
            self.reserved_at[rid] = time.monotonic()
            yield decode_pb2.DecodeResponse(reservation=decode_pb2.Reservation(
                transfer_id=transfer_id, block_ids=list(range(num_blocks)), num_cached_tokens=self.num_cached_tokens,
                kv_endpoint=self.kv_endpoint, node_id=self.node_id))
            try:
                await asyncio.wait_for(kv, request.kv_timeout_seconds)
            except TimeoutError:
                self.record.expired.append(rid)
                raise DeadlineExceededError(f"no KV for {transfer_id} in {request.kv_timeout_seconds:.3g} s") from None
            max_tokens, k = request.sampling.max_tokens, request.resumed_output_tokens
            tokens = self.script.tokens[k + 1:k + max_tokens]
            finish = (common_pb2.FINISH_REASON_LENGTH if k + max_tokens <= len(self.script.tokens)
                      else common_pb2.FINISH_REASON_STOP)
            if self.script.gate is not None:
                await self.script.gate.wait()
            if not tokens:  # the request ended at the prefill's token
                yield decode_pb2.DecodeResponse(delta=decode_pb2.TokenDelta(finish_reason=finish))
            for i, token in enumerate(tokens):
                if self.script.token_delay_s:
                    await asyncio.sleep(self.script.token_delay_s)
                if i == self.hang_after:
                    self.hanging.set()
                    await asyncio.Event().wait()  # until the node is stopped
                if i == self.cancel_after:
                    await context.abort(grpc.StatusCode.CANCELLED, f"{self.node_id} cancelled the call")
                last = i == len(tokens) - 1
                logprobs = [logprob(token, k + i + 1)] if request.sampling.HasField("logprobs") else []
                yield decode_pb2.DecodeResponse(delta=decode_pb2.TokenDelta(
                    token_ids=[token], logprobs=logprobs,
                    finish_reason=finish if last else common_pb2.FINISH_REASON_UNSPECIFIED))
            self.record.completed.append(rid)
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: cancelled while at a yield (the reservation)
            self.record.cancelled.append(rid)
            raise
        finally:
            self.board.close(transfer_id)

    async def Stats(self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> common_pb2.NodeStats:
        await asyncio.sleep(self.stats_delay_s)
        return common_pb2.NodeStats(node_id=self.node_id, role="decode", num_blocks=1000, free_blocks=self.free_blocks,
                                    block_size=self.block_size, prefix_cache_queries=self.cache_counters[0],
                                    prefix_cache_hits=self.cache_counters[1], offload_hits=self.cache_counters[2],
                                    offload_blocks=self.cache_counters[3])


class ScriptedPrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, node_id: str, board: KVBoard, script: Script) -> None:
        self.node_id, self.board, self.script = node_id, board, script
        self.record = Record()
        self.delay_before_push_s = 0.0
        self.answer_delay_s = 0.0  # from the push to the first answer (the first token)
        self.delay_after_push_s = 0.0  # from the first answer to the transfer's end (its acks)
        self.fail_with: grpc.StatusCode | None = None
        # When set, the next transfer fails with this status after the first answer, once (its decode node waits
        # for a KV that never comes, until the gateway cancels it).
        self.transfer_fails_with: grpc.StatusCode | None = None
        self.num_cached_tokens = 0
        self.last_request: prefill_pb2.PrefillRequest | None = None
        self.destinations: dict[str, float] = {}  # request id -> when its destination came (monotonic)
        self.destination_timeout_s: float | None = None  # the node's KV timeout for the destination (None: none)

    async def Prefill(self, request: prefill_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        self.record.requests.append(request.request_id)
        self.last_request = request
        return await self._serve(request, context, None)

    async def PrefillStream(self, request_iterator: AsyncIterator[prefill_pb2.PrefillMessage],
                            context: grpc.aio.ServicerContext) -> None:
        """As the real node's: the request first (recorded at once), its destination once the gateway has it;
        two answers, the first token (``kv_pending``) and the transfer's end."""
        first = await anext(request_iterator)
        request = first.request
        self.record.requests.append(request.request_id)
        self.last_request = request
        await context.write(await self._serve(request, context, request_iterator, early=context.write))

    async def _serve(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext,
                     later: AsyncIterator[prefill_pb2.PrefillMessage] | None,
                     early: Callable[[prefill_pb2.PrefillResponse], Coroutine[Any, Any, None]] | None = None,
                     ) -> prefill_pb2.PrefillResponse:
        rid = request.request_id
        try:
            if self.fail_with is not None:
                await context.abort(self.fail_with, f"scripted failure on {self.node_id}")
            if later is not None:
                try:
                    second = await asyncio.wait_for(anext(later), self.destination_timeout_s)
                except TimeoutError:  # as the real node's KV timeout
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no KV destination within the KV timeout")
                except StopAsyncIteration:  # the gateway cancelled the call (the stream ends with it)
                    raise asyncio.CancelledError from None
                request.destination.CopyFrom(second.destination)  # last_request shows it, as a unary call's
                self.destinations[rid] = time.monotonic()
            await asyncio.sleep(self.delay_before_push_s)
            k = request.resumed_output_tokens  # a migrated request goes on at tokens[k]
            first = self.script.tokens[k]
            reply = prefill_pb2.PrefillResponse(first_token=first, num_cached_tokens=self.num_cached_tokens,
                                                queue_seconds=0.001)
            if request.sampling.HasField("logprobs"):
                reply.first_logprob.CopyFrom(logprob(first, k))
            if self.transfer_fails_with is None:
                self.board.push(request.destination.transfer_id, first)
            await asyncio.sleep(self.answer_delay_s)
            if early is not None:
                pending = prefill_pb2.PrefillResponse()
                pending.CopyFrom(reply)
                pending.kv_pending = True
                await early(pending)
            await asyncio.sleep(self.delay_after_push_s)
            if (code := self.transfer_fails_with) is not None:
                self.transfer_fails_with = None
                await context.abort(code, f"scripted transfer failure on {self.node_id}")
            self.record.completed.append(rid)
            reply.transfer_bytes, reply.transfer_seconds = 1234, 0.01
            return reply
        except asyncio.CancelledError:
            self.record.cancelled.append(rid)
            raise

    async def Stats(self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> common_pb2.NodeStats:
        return common_pb2.NodeStats(node_id=self.node_id, role="prefill", block_size=16)


def free_port() -> int:
    """A loopback port with nothing listening on it (a node that is down), reserved so that none will."""
    return reserve_port()


@dataclass
class Cluster:
    gateway: RunningServer
    stub: generate_pb2_grpc.TandemStub
    channel: grpc.aio.Channel
    prefills: list[ScriptedPrefill]
    decodes: list[ScriptedDecode]
    node_servers: dict[str, RunningServer]  # by node id
    script: Script
    board: KVBoard


@contextlib.asynccontextmanager
async def scripted_cluster(model: ServedModel, model_dir: Path, script_tokens: Sequence[int], *,
                           num_prefill: int = 1, num_decode: int = 1, dead_prefill: int = 0, dead_decode: int = 0,
                           **settings: object) -> AsyncIterator[Cluster]:
    """Scripted nodes (dead ones, with nothing listening, are listed first), a gateway, a client stub."""
    board, script = KVBoard(), Script(list(script_tokens))
    prefills = [ScriptedPrefill(f"prefill-{i}", board, script) for i in range(num_prefill)]
    decodes = [ScriptedDecode(f"decode-{i}", board, script) for i in range(num_decode)]
    servers: dict[str, RunningServer] = {}
    for p in prefills:
        servers[p.node_id] = await start_server(
            [functools.partial(prefill_pb2_grpc.add_PrefillServicer_to_server, p)], [PREFILL_SERVICE], "127.0.0.1", 0)
    for d in decodes:
        servers[d.node_id] = await start_server(
            [functools.partial(decode_pb2_grpc.add_DecodeServicer_to_server, d)], [DECODE_SERVICE], "127.0.0.1", 0)
    dead = [f"127.0.0.1:{free_port()}" for _ in range(dead_prefill + dead_decode)]
    gateway_settings = GatewaySettings(
        model_dir=model_dir, model_name=model.name, port=0,
        prefill_targets=(*dead[:dead_prefill], *(servers[p.node_id].address for p in prefills)),
        decode_targets=(*dead[dead_prefill:], *(servers[d.node_id].address for d in decodes)),
        # The scripted decode nodes only reserve (no local prefill): every prompt goes to a prefill node
        # unless a test asks for conditional disaggregation.
        **{"local_prefill_max_tokens": 0, **settings},  # type: ignore[arg-type]
    )
    gateway = await serve_gateway(gateway_settings, model)
    channel = open_channel(gateway.address)
    try:
        stub = generate_pb2_grpc.TandemStub(channel)
        yield Cluster(gateway, stub, channel, prefills, decodes, servers, script, board)
    finally:
        await channel.close()
        await gateway.stop(0)
        for server in servers.values():
            await server.stop(0)


async def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait (bounded) until ``check()`` holds; fail the test if it never does. The bound is generous: on a
    busy machine the other side's step may come seconds late, and a passing check returns at once."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the condition did not hold within the bound"
        await asyncio.sleep(0.01)


def run_async(coro: Coroutine[Any, Any, T], timeout_s: float = 20.0) -> T:
    """Run one test scenario in a fresh event loop, failing (not hanging) after ``timeout_s``."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))
