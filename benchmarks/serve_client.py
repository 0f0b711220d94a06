"""The serving benchmark's client: sends a workload's requests over gRPC (or, ``Api.OPENAI``, the gateway's
OpenAI HTTP API: benchmarks/openai_client.py) and records what it saw of each.

Open loop: each request leaves at its ``arrival_s`` whatever the answers do (a system slower than the
load builds a queue, as in production); a later turn of a conversation (``TimedRequest.follows``) leaves its
think time after the turn before it ends, carrying that turn's prompt and answer, to the front that served it
(sticky sessions: with several replicas the history's KV is there). Closed loop:
``concurrency`` requests in flight at all times, sent
in the workload's order. Every time is the client's ``time.perf_counter``.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from benchmarks.request_record import RequestRecord

if TYPE_CHECKING:
    from benchmarks.workloads import TimedRequest
    from tandem.v1.generate_pb2_grpc import TandemStub


class Api(enum.Enum):
    """The public front the client drives: targets are host:port for gRPC, http://host:port for OpenAI."""

    GRPC = "grpc"
    OPENAI = "openai"


async def _send(stub: TandemStub, req: TimedRequest, record: RequestRecord, timeout_s: float) -> None:
    import grpc

    from tandem.v1 import common_pb2, generate_pb2

    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=req.prompt_token_ids),
        sampling=common_pb2.SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True),
        stream=generate_pb2.StreamOptions(include_token_ids=True, skip_text=True),
    )
    record.sent = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=timeout_s):
            if response.HasField("timings"):
                record.queue_s = response.timings.queue_seconds
                record.kv_transfer_s = response.timings.kv_transfer_seconds
            n = len(response.token_ids)
            if not n:
                continue
            now = time.perf_counter()
            if record.last is not None:
                record.gaps.append(now - record.last)
            record.first = record.first or now
            record.last = now
            record.num_tokens += n
            record.num_messages += 1
            record.output_ids.extend(response.token_ids)
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"


Sender = Callable[[int, "TimedRequest", RequestRecord, float], Awaitable[None]]  # target index first


async def drive(targets: Sequence[str], requests: Sequence[TimedRequest], concurrency: int | None,
                timeout_s: float = 600.0, api: Api = Api.GRPC,
                temperature: float | None = 0.0) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` at their ``arrival_s`` (open loop, ``concurrency`` None) or ``concurrency`` at a
    time in their order (closed loop); return the records and the run's duration (first send to last
    answer). ``temperature``: the OpenAI API's only (None: the server's default); gRPC requests are greedy."""
    if api is Api.OPENAI and any(r.follows is not None for r in requests):
        raise ValueError("a multi-turn workload runs over gRPC only (--api grpc): a later turn's prompt carries "
                         "the token ids the server generated, which the OpenAI client does not record")
    if api is Api.OPENAI:
        from benchmarks.openai_client import open_client, send_openai, served_model

        client = open_client(concurrency or max(len(requests), 1))
        try:
            models = [await served_model(client, t) for t in targets]

            async def send_http(k: int, req: TimedRequest, record: RequestRecord, timeout: float) -> None:
                await send_openai(client, targets[k], models[k], req, record, timeout, temperature)

            return await _drive(targets, requests, concurrency, timeout_s, send_http)
        finally:
            await client.aclose()
    import grpc

    from tandem.v1 import generate_pb2_grpc

    channels = [grpc.aio.insecure_channel(t) for t in targets]
    stubs = [generate_pb2_grpc.TandemStub(c) for c in channels]

    async def send_grpc(k: int, req: TimedRequest, record: RequestRecord, timeout: float) -> None:
        await _send(stubs[k], req, record, timeout)

    try:
        return await _drive(targets, requests, concurrency, timeout_s, send_grpc)
    finally:
        await asyncio.gather(*(c.close() for c in channels))


async def _drive(targets: Sequence[str], requests: Sequence[TimedRequest], concurrency: int | None,
                 timeout_s: float, send: Sender) -> tuple[list[RequestRecord], float]:
    outstanding = [0] * len(targets)
    rotation = itertools.count()
    records = [RequestRecord(r.index, r.kind, len(r.prompt_token_ids), r.output_len) for r in requests]
    done = [asyncio.Event() for _ in requests]
    prompts: dict[int, tuple[int, ...]] = {}  # a conversation's turns: each one's whole prompt, for the next

    async def one(i: int) -> None:
        try:
            req = await _with_history(requests[i], records, prompts, done)
            if req is not None:
                await _one(i, req)
        finally:
            done[i].set()

    async def _one(i: int, req: TimedRequest) -> None:
        # A conversation's later turn goes where its previous turn went (sticky sessions, as a chat front keeps
        # them: the history's KV is there). Otherwise fewest outstanding requests first; ties rotate, so an idle
        # pair of replicas shares the load.
        start = next(rotation)
        if req.follows is not None:
            k = targets.index(records[req.follows].target)
        else:
            k = min(range(len(targets)), key=lambda j: (outstanding[j], (j - start) % len(targets)))
        outstanding[k] += 1
        records[i].target = targets[k]
        try:
            await send(k, req, records[i], timeout_s)
        finally:
            outstanding[k] -= 1

    began = time.perf_counter()
    if concurrency is not None:
        pending = iter(range(len(requests)))

        async def worker() -> None:
            for i in pending:
                await one(i)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:

        async def at(i: int) -> None:
            await asyncio.sleep(max(0.0, began + requests[i].arrival_s - time.perf_counter()))
            await one(i)

        await asyncio.gather(*(at(i) for i in range(len(requests))))
    return records, time.perf_counter() - began


async def _with_history(req: TimedRequest, records: Sequence[RequestRecord], prompts: dict[int, tuple[int, ...]],
                        done: Sequence[asyncio.Event]) -> TimedRequest | None:
    """``req`` as sent: a later turn waits for its previous turn and its think time, then carries the history
    (that turn's prompt and generated tokens) before its own message. None: the previous turn failed."""
    import dataclasses

    if req.follows is None:
        prompts[req.index] = req.prompt_token_ids
        return req
    await done[req.follows].wait()
    before = records[req.follows]
    if not before.ok:
        records[req.index].error = f"turn {req.follows} of this conversation failed: {before.error or 'no tokens'}"
        return None
    await asyncio.sleep(req.think_s)
    prompt = prompts[req.follows] + tuple(before.output_ids) + req.prompt_token_ids
    prompts[req.index] = prompt
    records[req.index].prompt_len = len(prompt)
    return dataclasses.replace(req, prompt_token_ids=prompt)
